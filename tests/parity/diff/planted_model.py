"""Model-level bugs that shipped in other engines, planted in our optimized model (real Triton
kernels, bf16 or fp32) at one layer, and the checks of the diff's teeth that use them
(``test_diff_matrix.py``, parametrized by op family, and ``test_diff_matrix_head.py``):

- ``fb_doubled``: a KDA layer's ``f_b_proj`` output doubled (llama.cpp's Kimi-Linear port);
- ``state_transposed``: a KDA layer's recurrent state stored transposed after prefill (vLLM's
  chunk_kda read its state with the wrong layout, pull 40956);
- ``raw_routing``: a MoE router ranking raw logits + bias instead of sigmoid scores + bias;
- ``bias_dropped``: a MoE router without its ``e_score_correction_bias``;
- ``bias_bf16``: the bias held in bf16 (vLLM pull 50761);
- ``nan_state``: NaN in a layer's carried state (KDA state or MLA latent) after a few steps: what
  uninitialized or poisoned memory does;
- ``mla_stale``: an MLA layer's cached latent of the last prompt position replaced by a stale row
  (a cache tail read from the wrong slot).

Bugs between the ops (``layer`` is ignored where the bug lives in the head):

- ``norm_one_plus_w``: the final norm with the zero-centred gamma convention, ``x / rms (1 + w)``
  applied to a checkpoint whose ``w`` is the gamma itself (the logits come out about 2x);
- ``wrong_row``: step 0's logits taken from the second-to-last prompt position;
- ``double_residual``: an MoE layer's shared expert output added to the stream twice (once in
  the FFN output it traces, once more on its own: SGLang's shared-expert fusion class of bug);
- ``lm_head_scaled``: the lm_head weight scaled by 2 (every logit doubled; the top token never moves).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

import optimized
import reference
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from parity.diff import run_diff
from parity.diff.engines import CheckedEngine, load_engine, router_bias
from parity.diff.engines.dump import _host, record
from parity.diff.engines.dump_writer import write_dump
from parity.platform import store_rounding
from tests.parity.diff_helpers import Override

BUGS = ("fb_doubled", "state_transposed", "raw_routing", "bias_dropped", "bias_bf16", "nan_state", "mla_stale",
        "norm_one_plus_w", "wrong_row", "double_residual", "lm_head_scaled")
OP = {"fb_doubled": "mixer", "state_transposed": "mixer", "raw_routing": "router", "bias_dropped": "router",
      "bias_bf16": "router", "nan_state": "mixer", "mla_stale": "mixer", "double_residual": "residual"}
HEAD = {"norm_one_plus_w": "final_norm", "wrong_row": "lm_head", "lm_head_scaled": "lm_head"}  # no layer


def _bias(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"


def base_source(source, bug: str, layer: int):
    """The weights both paths run for ``bug``: raw-logit ranking differs from sigmoid ranking only
    where the correction bias matters, so that layer's bias is scaled to a spread of 1 (Kimi's are
    of that order; the generator draws 0.1)."""
    if bug != "raw_routing":
        return source
    b = source.get(_bias(layer))
    return Override(source, {_bias(layer): b / b.std()})


def planted_source(source, bug: str, layer: int):
    """The weights of a bug that lives in them (None for the others)."""
    if bug == "fb_doubled":
        name = f"model.layers.{layer}.self_attn.f_b_proj.weight"
        return Override(source, {name: source.get(name) * 2.0})
    if bug == "bias_dropped":
        return Override(source, {_bias(layer): np.zeros(source.shape(_bias(layer)))})
    if bug == "bias_bf16":
        b = torch.tensor(source.get(_bias(layer))).bfloat16().double().numpy()
        return Override(source, {_bias(layer): b})
    if bug == "norm_one_plus_w":
        return Override(source, {"model.norm.weight": 1.0 + source.get("model.norm.weight")})
    if bug == "lm_head_scaled":
        name = "model.embed_tokens.weight" if source.config.tie_word_embeddings else "lm_head.weight"
        return Override(source, {name: source.get(name) * 2.0})
    return None


class _RawRouterOps:
    """The model's ops with a router that ranks raw logits + bias (combine weights still from the
    sigmoid scores at the chosen experts)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def router(self, logits, bias, *, top_k, num_groups=1, topk_groups=1, renormalize=True, scaling=1.0,
               combine="unbiased"):
        ids = torch.topk(logits.float() + bias.float(), top_k, dim=-1).indices
        w = torch.sigmoid(logits.float()).gather(-1, ids)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w * scaling, ids


class _DoubleAddOps:
    """The model's ops, the residual add after the FFN of one layer adding ``pending`` (that layer's
    shared expert output) once more than the FFN output it traces."""

    def __init__(self, ops, pending: list):
        self._ops, self.pending = ops, pending

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def add_rms_norm(self, x, residual, weight, *, eps):
        if self.pending:
            residual = residual + self.pending.pop()
        return self._ops.add_rms_norm(x, residual, weight, eps=eps)


class Planted:
    """Our optimized model with a bug at ``layer`` that its weights cannot carry."""

    def __init__(self, model, bug: str, layer: int, *, after_steps: int = 2):
        self.model, self.bug, self.layer, self.after = model, bug, layer, after_steps
        self.variants = model.variants
        self.steps = 0
        if bug == "double_residual":
            pending, real, moe = [], model.ops, model._moe
            model.ops = _DoubleAddOps(real, pending)

            def planted_moe(i, x, *, rows, trace):
                f = moe(i, x, rows=rows, trace=trace)
                if i == layer:
                    sh = model.weights.layers[i].ffn.shared
                    s = real.swiglu(x, sh.gate, sh.up, sh.down)
                    if rows is not None:
                        s[rows:] = 0  # the padding rows of a decode tile
                    pending.append(s)
                return f

            model._moe = planted_moe
        if bug == "raw_routing":
            real, raw, moe = model.ops, _RawRouterOps(model.ops), model._moe

            def planted_moe(i, x, **kw):
                model.ops = raw if i == layer else real
                try:
                    return moe(i, x, **kw)
                finally:
                    model.ops = real

            model._moe = planted_moe

    def prefill(self, ids, *, trace=None):
        logits, cache = self.model.prefill(ids, trace=trace)
        if self.bug == "wrong_row" and len(ids) > 1:
            logits = torch.cat([logits[:-1], logits[-2:-1]])
        pool, slot = cache.pool, cache.slot
        if self.bug == "state_transposed":
            s = pool.kda[self.layer].state
            s[slot] = s[slot].transpose(-1, -2).clone()
        elif self.bug == "mla_stale":
            kv, bs = pool.mla[self.layer].kv, pool.block_size
            last = cache.length - 1
            kv[cache.blocks[last // bs], last % bs] = kv[cache.blocks[0], 0]
        return logits, cache

    def decode(self, token, cache, *, trace=None):
        self.steps += 1
        if self.bug == "nan_state" and self.steps == self.after:
            pool = cache.pool
            if self.layer in pool.kda:
                pool.kda[self.layer].state[cache.slot, 0, 0, 0] = float("nan")
            else:
                pool.mla[self.layer].kv[cache.blocks[0], 0, 0] = float("nan")
        return self.model.decode(token, cache, trace=trace)


def planted_engine(source, bug: str, layer: int, *, dtype: str):
    """Our optimized model at ``dtype`` with ``bug`` at ``layer``, on the device the suite runs on."""
    weights = planted_source(source, bug, layer)   # ``source``: from ``base_source``
    model = optimized.load(weights if weights is not None else source, dtype=dtype)
    return model if weights is not None else Planted(model, bug, layer)


# the tiny preset with MLA at layers 1 and 3 (KDA at 0 and 2): an early and a deep MLA layer
TINY_MLA = dataclasses.replace(KimiConfig.from_name("tiny"), kda_layers=(1, 3), full_attn_layers=(2, 4))
PROMPT = [75, 107, 104, 117, 35, 108, 104, 111]
STEPS = 4   # the prefill and three decode steps: the state bugs act from the first decode on
# a clean control's prompt: 52 tokens and 16 decode steps cross the 64th position (an MLA page, a KDA
# chunk) in decode, at a quarter of the decode steps of a short prompt's run past it
LONG_PROMPT = (PROMPT * 7)[:52]
CLEAN_STEPS = 16


def mla_source():
    return SyntheticSource(TINY_MLA, 0)


def diff(source, engine, dtype, *, steps=STEPS, mode="forced", tokens=None, prompt=PROMPT):
    """``run_diff`` of ``engine`` against the reference on ``source``, as ``parity diff`` runs it."""
    # the engines here run where optimized.load puts them by default: the suite's device
    return run_diff(reference.load(source), engine, prompt, config=source.config, steps=steps, mode=mode,
                    dtype=dtype, rounding=store_rounding(dtype), tokens=tokens)


def through_dump(source, engine, dtype, path):
    """``engine``'s free-mode run written to a dump at ``path``, then diffed from the file alone;
    the same dump without its traces is diffed too, and its verdict is never more severe (traces
    never weaken a verdict: ``assert_traces_never_weaken``)."""
    record(engine, path, config=source.config, dtype=dtype, prompt_ids=PROMPT, steps=STEPS)
    traced = diff_dump(source, path, dtype)
    assert_traces_never_weaken(traced, diff_dump(source, bare_copy(path), dtype))
    return traced


def diff_dump(source, path, dtype):
    """The dump at ``path`` diffed from the file alone (free mode: the reference follows its tokens)."""
    dump = CheckedEngine(load_engine(f"dump:{path}", source, dtype=None, device=None), source.config,
                         name="dump", bias=router_bias(source))
    mode = dump.engine.mode
    return diff(source, dump, dtype, mode=mode, tokens=dump.engine.tokens if mode == "free" else None,
                prompt=dump.engine.prompt_ids, steps=dump.engine.steps)


def bare_copy(path):
    """The dump at ``path`` without its traces, written beside it (``*.bare.safetensors``)."""
    from safetensors.numpy import load_file

    from parity.diff.engines.dump import read_header

    head, t = read_header(path), load_file(str(path))
    out = path.with_suffix(".bare.safetensors")
    write_dump(out, config=head["config"], prompt_ids=head["prompt_ids"], tokens=t["tokens"], logits=t["logits"],
               dtype=head["dtype"], mode=head["mode"], engine=head.get("engine", ""))
    return out


SEVERITY = {"match": 0, "near-tie": 1, "past-bound": 2, "diverged": 3}


def assert_traces_never_weaken(traced, untraced) -> None:
    """The verdict with traces at least as severe as without (traces buy evidence, never leniency)."""
    assert SEVERITY[traced.verdict] >= SEVERITY[untraced.verdict], (traced.summary()["line"],
                                                                     untraced.summary()["line"])


class Recording:
    """An engine that keeps what it returned (each call's last logit row, its traces on the host,
    the tokens it consumed), so the run just diffed is written as a forced dump (``write``)
    without running the engine again."""

    def __init__(self, engine):
        self.engine, self.rows, self.traces, self.fed, self.prompt = engine, [], {}, [], None

    def _keep(self, logits, trace: dict) -> None:
        rows = _host(logits)
        self.rows.append(rows.reshape(-1, rows.shape[-1])[-1])
        for k, v in trace.items():
            v = _host(v)
            self.traces.setdefault(k, []).append(v.reshape(-1, v.shape[-1]))

    def prefill(self, ids, *, trace=None):
        trace = {} if trace is None else trace
        logits, cache = self.engine.prefill(ids, trace=trace)
        self.prompt, self.fed = list(ids), [int(ids[-1])]
        self._keep(logits, trace)
        return logits, cache

    def decode(self, token, cache, *, trace=None):
        trace = {} if trace is None else trace
        logits, cache = self.engine.decode(token, cache, trace=trace)
        self.fed.append(int(token))
        self._keep(logits, trace)
        return logits, cache

    def write(self, path, config, dtype: str, *, traced: bool = True):
        """The recorded run as a forced dump at ``path`` (with its traces, or without)."""
        traces = {k: np.concatenate(v) for k, v in self.traces.items()} if traced else None
        return write_dump(path, config=config.to_hub_dict(), prompt_ids=self.prompt, tokens=self.fed,
                          logits=np.stack(self.rows), dtype=dtype, mode="forced", engine="recorded", traces=traces)


def assert_caught(result, bug: str, layer: int) -> None:
    """Exit 1 (``diverged`` or ``past-bound``) and the planted layer and op named."""
    assert result.verdict in ("diverged", "past-bound"), result.summary()["line"]
    loc = result.localization
    assert loc is not None, result.summary()["line"]
    if bug == "nan_state":
        assert loc.nonfinite is not None and loc.nonfinite["name"] == f"layers.{layer}.mixer", loc.describe()
    else:
        assert loc.first is not None and loc.first.name == f"layers.{layer}.{OP[bug]}", loc.describe()


def assert_clean(result) -> None:
    """Matches and near-ties only, every replayed op within its bound."""
    assert result.verdict in ("match", "near-tie"), result.summary()["line"]
    worst = max(result.final.entries, key=lambda e: max(e.units, e.spike_units))
    assert max(worst.units, worst.spike_units) < 1, result.final.describe()
