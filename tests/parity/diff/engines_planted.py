"""Engines the diff tests hold to the reference, each built as a user builds one: a factory
``factory(checkpoint, *, dtype, device)`` named on the command line as ``module:factory``.

* ``fb_doubled``: llama.cpp's Kimi-Linear bug (ggml-org/llama.cpp pull 17592): a KDA layer's
  ``f_b_proj`` output doubled. Built as the float64 NumPy model over the checkpoint with that
  layer's ``f_b_proj.weight`` times 2 (``f_b`` is a bias-free linear map, and a power-of-two scale
  commutes with every rounding: bitwise the doubled output). NumPy keeps the test at seconds; its
  float64 numbers are within any float32 bound, so only the planted bug can exceed one.
* ``fb_doubled_transformers``: the same bug planted in transformers' own model, through a forward
  hook on its ``forget_gate.f_b_proj`` (the ``.hf_model`` a user hooks).
* ``untraced``: the NumPy model behind a wrapper that fills no trace; ``bent_logits``: the same
  with a small bias added to every seventh logit (not lm_head of anything, too small to flip a token).
* ``fb_doubled_on_trigger``: ``fb_doubled`` for a prompt that holds the token id ``TRIGGER``, the
  clean float64 model for any other (a bug only some prompts of a corpus reach); it has
  ``decode_batch``, so a corpus decodes it in batches.
* ``bf16_state``: our optimized model holding its KDA recurrent state in bf16 between calls (a
  shipped precision option below bf16 rounding of the state): a correct engine, clean.
* ``softplus_on_bounded``: the float64 NumPy model with the softplus KDA gate, whatever gate the
  checkpoint's config names (Kimi-Linear-48B's path run on a Kimi-K3 / GLM-5.3 checkpoint).
* ``raises``, ``wrong_vocab``, ``two_rows``, ``half_traced``, ``not_an_engine``,
  ``one_row_batches``: engines that break the protocol.
* engines that cannot run, each failing in one phase as a real engine does: ``prefill_raises``
  (KeyError 'query'), ``decode_raises`` (a CUDA error's multi-line message), ``prefill_out_of_gpu_memory``
  (torch.OutOfMemoryError), ``decode_out_of_host_memory`` (NumPy's own _ArrayMemoryError, from an
  allocation NumPy refuses at once), ``factory_out_of_memory``, ``transformers_raises``
  (transformers' own model, a layer of which raises in its forward).
"""
from __future__ import annotations

import numpy as np

from tests.parity.diff_helpers import Override

FB_LAYER = 1  # a KDA layer of the bundled checkpoint (layers 0-2 are KDA, 3 is MLA)


def _source(checkpoint):
    from kimi.checkpoint import WeightSource, open_source

    return checkpoint if isinstance(checkpoint, WeightSource) else open_source(checkpoint)


def fb_doubled_source(source, layer: int = FB_LAYER):
    name = f"model.layers.{layer}.self_attn.f_b_proj.weight"
    return Override(source, {name: source.get(name) * 2.0})


def fb_doubled(checkpoint, *, dtype, device):
    import reference

    return reference.load(fb_doubled_source(_source(checkpoint)))


def softplus_on_bounded(checkpoint, *, dtype, device):
    import reference

    return reference.load(_source(checkpoint), kda_gate="softplus")


TRIGGER = 90  # byte 'W' + 3: a token id the bundled checkpoint's byte-level prompts may hold


class _OnTrigger:
    """The buggy model for a prompt holding ``TRIGGER`` (decided at prefill, carried in the cache).
    ``decode_batch`` decodes a batch's clean and buggy sequences each through their own model's
    ``decode_batch``, the rows and trace entries put back in batch order."""

    def __init__(self, clean, buggy):
        self.clean, self.buggy = clean, buggy

    def prefill(self, token_ids, *, trace=None):
        model = self.buggy if TRIGGER in token_ids else self.clean
        logits, cache = model.prefill(token_ids, trace=trace)
        return logits, (model, cache)

    def decode(self, token_id, cache, *, trace=None):
        model, inner = cache
        logits, inner = model.decode(token_id, inner, trace=trace)
        return logits, (model, inner)

    def decode_batch(self, token_ids, caches, *, trace=None):
        from reference.batch import split_trace

        B = len(caches)
        rows, new, traces = [None] * B, [None] * B, [None] * B
        for model in (self.clean, self.buggy):
            idx = [b for b in range(B) if caches[b][0] is model]
            if not idx:
                continue
            part = {} if trace is not None else None
            logits, inner = model.decode_batch([token_ids[b] for b in idx], [caches[b][1] for b in idx], trace=part)
            own = split_trace(part, len(idx)) if part is not None else [None] * len(idx)
            for j, b in enumerate(idx):
                rows[b], new[b], traces[b] = logits[j], (model, inner[j]), own[j]
        if trace is not None:
            trace.update({k: np.concatenate([t[k] for t in traces]) for k in traces[0]})
        return np.stack(rows), new


def fb_doubled_on_trigger(checkpoint, *, dtype, device):
    import reference

    source = _source(checkpoint)
    return _OnTrigger(reference.load(source), reference.load(fb_doubled_source(source)))


def fb_doubled_transformers(checkpoint, *, dtype, device):
    from parity.diff.engines import load_engine

    engine = load_engine("transformers", checkpoint, dtype=dtype, device=device)
    f_b = engine.hf_model.model.layers[FB_LAYER].self_attn.forget_gate.f_b_proj
    f_b.register_forward_hook(lambda module, args, out: out * 2)
    return engine


class _Untraced:
    def __init__(self, model, bend: float = 0.0):
        self.model, self.bend = model, bend

    def _bent(self, logits):
        logits = np.array(logits)
        logits[..., ::7] += self.bend
        return logits

    def prefill(self, token_ids):
        logits, cache = self.model.prefill(token_ids)
        return self._bent(logits), cache

    def decode(self, token_id, cache):
        logits, cache = self.model.decode(token_id, cache)
        return self._bent(logits), cache


def untraced(checkpoint, *, dtype, device):
    import reference

    return _Untraced(reference.load(_source(checkpoint)))


def bent_logits(checkpoint, *, dtype, device):
    import reference

    return _Untraced(reference.load(_source(checkpoint)), bend=1e-3)


class _HalfTraced:
    def __init__(self, model):
        self.model = model

    def prefill(self, token_ids, *, trace=None):
        logits, cache = self.model.prefill(token_ids, trace=trace)
        for key in [k for k in trace if k.startswith("layers.3.")]:
            del trace[key]
        return logits, cache

    def decode(self, token_id, cache, *, trace=None):
        return self.model.decode(token_id, cache, trace=trace)


def half_traced(checkpoint, *, dtype, device):
    import reference

    return _HalfTraced(reference.load(_source(checkpoint)))


def raises(checkpoint, *, dtype, device):
    raise RuntimeError("no GPU driver found")


class _Shapes:
    def __init__(self, vocab, rows):
        self.vocab, self.rows = vocab, rows

    def prefill(self, token_ids, *, trace=None):
        return np.zeros((self.rows or len(token_ids), self.vocab), np.float32), None

    def decode(self, token_id, cache, *, trace=None):
        return np.zeros(self.vocab, np.float32), None


class _OneRowBatches(_Untraced):
    def decode_batch(self, token_ids, caches):
        logits, cache = self.model.decode(token_ids[0], caches[0])
        return np.asarray(logits)[None], [cache] * len(caches)


def one_row_batches(checkpoint, *, dtype, device):
    """The NumPy model whose ``decode_batch`` returns one row whatever the batch."""
    import reference

    return _OneRowBatches(reference.load(_source(checkpoint)))


def wrong_vocab(checkpoint, *, dtype, device):
    return _Shapes(_source(checkpoint).config.vocab_size + 1, None)


def two_rows(checkpoint, *, dtype, device):
    return _Shapes(_source(checkpoint).config.vocab_size, 2)


def not_an_engine(checkpoint, *, dtype, device):
    return object()


class _Bf16State:
    """Our optimized model holding its KDA recurrent state in bf16 between calls (a shipped precision
    option: vLLM's ``mamba_ssm_cache_dtype``): the kernels still run the recurrence in fp32, the
    state pool is rounded to bf16 after every call."""

    def __init__(self, model):
        self.model, self.variants = model, model.variants

    def _round(self, cache) -> None:
        for st in cache.pool.kda.values():
            st.state[cache.slot] = st.state[cache.slot].bfloat16().to(st.state.dtype)

    def prefill(self, ids, *, trace=None):
        logits, cache = self.model.prefill(ids, trace=trace)
        self._round(cache)
        return logits, cache

    def decode(self, token, cache, *, trace=None):
        logits, cache = self.model.decode(token, cache, trace=trace)
        self._round(cache)
        return logits, cache


def bf16_state(checkpoint, *, dtype, device):
    """Our optimized model at ``dtype`` with its KDA recurrent state held in bf16 (a correct engine)."""
    import optimized

    return _Bf16State(optimized.load(_source(checkpoint), dtype=dtype, device=device))


def nan_state(checkpoint, *, dtype, device):
    """Our optimized model with NaN written into layer 0's KDA state after two decode steps."""
    import optimized
    from tests.parity.diff.planted_model import Planted

    return Planted(optimized.load(_source(checkpoint), dtype=dtype, device=device), "nan_state", 0)


GPU_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
           "1.10 GiB is free. Including non-PyTorch memory, this process has 78.0 GiB memory in use.\n"
           "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF")


class _FailsIn:
    """The NumPy model, except that its ``phase`` call (prefill or decode) calls ``fail()``."""

    def __init__(self, model, phase: str, fail):
        self.model, self.phase, self.fail = model, phase, fail

    def prefill(self, token_ids, *, trace=None):
        if self.phase == "prefill":
            self.fail()
        return self.model.prefill(token_ids, trace=trace)

    def decode(self, token_id, cache, *, trace=None):
        if self.phase == "decode":
            self.fail()
        return self.model.decode(token_id, cache, trace=trace)


def _fails_in(checkpoint, phase, fail):
    import reference

    return _FailsIn(reference.load(_source(checkpoint)), phase, fail)


def _raise(exc):
    def fail():
        raise exc

    return fail


def prefill_raises(checkpoint, *, dtype, device):
    return _fails_in(checkpoint, "prefill", _raise(KeyError("query")))


def decode_raises(checkpoint, *, dtype, device):
    return _fails_in(checkpoint, "decode", _raise(RuntimeError(
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported")))


def prefill_out_of_gpu_memory(checkpoint, *, dtype, device):
    import torch

    return _fails_in(checkpoint, "prefill", _raise(torch.OutOfMemoryError(GPU_OOM)))


def decode_out_of_host_memory(checkpoint, *, dtype, device):
    return _fails_in(checkpoint, "decode", lambda: np.empty(1 << 47))  # 1 PiB: refused by NumPy at once


def factory_out_of_memory(checkpoint, *, dtype, device):
    import torch

    raise torch.OutOfMemoryError(GPU_OOM)


def transformers_raises(checkpoint, *, dtype, device):
    """transformers' own model whose first decoder layer raises in its forward (a kernel the
    installed stack cannot launch); where transformers itself cannot load, that failure instead."""
    from parity.diff.engines import load_engine

    engine = load_engine("transformers", checkpoint, dtype=dtype, device=device)

    def fail(module, args):
        raise RuntimeError("no kernel image is available for execution on the device")

    engine.hf_model.model.layers[0].register_forward_pre_hook(fail)
    return engine
