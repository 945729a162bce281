"""The float64 Kimi-Linear model (spec b.10-b.17), built from the reference ops, streaming its weights.

``load(path_or_source, *, moe_combine="unbiased", kv_norm_eps=1e-6, device="cpu", executor=None,
shared_weights=None, weight_cache_bytes=None)`` returns a ``Model`` with ``forward`` (full recompute),
``prefill`` and ``decode`` (one sequence, 1-D token ids), and ``decode_batch`` (one token for each
of B sequences of any lengths, each row bitwise its own ``decode`` on the CPU executors, within
1e-12 of it on a GPU, where the rows run as one batch). The model runs on an executor
(``reference.executor``): NumPy on the CPU by default, torch float64 on ``device="cuda"`` (or on the
CPU with ``executor="torch"``); its arrays (logits, caches, traces) are that library's.

This module is the math; beside it live the weights (``reference.weights``: fetched layer by layer
as they are used, converted from their storage bits to float64 on the executor's device through a
byte-bounded LRU, ``weight_cache_bytes``, or applied straight from the bits, ``reference.streamed``),
the caches (``reference.cache``), a batch's arguments and trace (``reference.batch``), the memory
guard (``reference.memory``) and the progress and trace hooks (``reference.hooks``). With ``shared_weights`` (``{name: tensor}`` on the device, e.g.
the optimized model's bf16 weights) those tensors are read instead of the source: 98 GB of bf16
weights once on one GPU for both models.

Which form of each op runs where (both forms of KDA and MLA are exact in float64, so prefill
followed by decode equals one longer prefill to ~1e-15):

- ``forward`` / ``prefill``: KDA ``fused_chunked`` (chunk 64), MLA ``naive``;
- ``decode`` / ``decode_batch``: conv ``short_conv_step``, KDA ``fused_recurrent``, MLA ``absorbed``,
  each sequence on its own cache; the token-wise work on the B rows at once, every product row by
  row (``Weights.row_by_row``) where ``bitwise_rows`` (the CPU executors), else the B sequences'
  states stacked and their MLA caches padded into one call each.
- the torch executor runs the routed experts in gathered groups (``moe.experts(group=)``) and a
  layer's input projections as one product (``Weights.linears``): fewer launches on a GPU.
- a one-token decode step on a GPU whose weights are all shared replays CUDA graphs of its
  fixed-shape parts (``reference.graphs``; ``model.graphs = None`` turns them off): the eager
  step's kernels, and its bits, at a fraction of the host time.

Memory: before a call allocates anything, ``memory_estimate`` bounds its peak (weights in flight,
activations, MLA attention blocks, trace, logits, cache) and a call that cannot fit in the device's
free memory raises ``DoesNotFit`` (a ``MemoryError``, ``reference.memory``) with one line saying
what and how much.

The reference is functional: ``decode`` never mutates its input cache (no op writes an array; NumPy
cache arrays are read-only too) and returns a new one. ``trace`` (a dict) receives float64 arrays,
``[T, ...]`` also in decode (T = 1): ``layers.{i}.mixer`` / ``.ffn`` (the branch outputs added to the
residual), ``layers.{i}.hidden`` (residual stream after layer i), ``layers.{i}.router.scores``
(sigmoid scores ``[T, E]``), ``layers.{i}.router.selection`` (scores + bias ``[T, E]``),
``layers.{i}.router.ids`` (``[T, k_e]``) and ``final_norm``. With ``model.trace_kda_core = True`` it
also receives, per KDA layer, the core's inputs ``layers.{i}.kda.{q,k,v,g,beta}`` (after the fused
prologue), the state it started from ``.initial_state`` ``[HV, K, V]`` and the gated norm's output
``.normed`` ``[T, HV, V]``: the localization's bound replays the recurrence on them.
``model.progress``, when set, is called after every layer with ``{"call", "layer", "layers",
"tokens", "elapsed_s"}``.

Semantic variants (spec §(e)), reported in ``model.variants``: ``moe_combine`` ("unbiased": combine
weights from the sigmoid scores, as vLLM; "biased": from scores + correction bias, as the HF remote
code), ``kv_norm_eps`` (``kv_a_layernorm`` eps: 1e-6 HF, 1e-5 vLLM) and ``kda_gate`` ("softplus":
Kimi-Linear-48B's gate; "lower_bound:<b>": the bounded gate ``b sigmoid(exp(A_log) (g_raw +
dt_bias))`` of Kimi-K3 and GLM-5.3; default: what the checkpoint's config says).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import partial

import numpy as np

from kimi.checkpoint import WeightSource, open_source
from kimi.config import KimiConfig
from kimi.tensors import layer_prefix

from . import conv, embed, kda, mla, moe, norm
from .batch import Rider, check_batch, check_riders
from .cache import KDACache, MLACache, ModelCache, check_cache, empty_cache
from .checks import (OWN, check_routing, check_token_id, check_token_ids, check_variants, kda_gate_bound,
                     resolve_kda_gate)
from .elementwise import sigmoid
from .executor import NUMPY, Executor, device_of, get_executor, to_numpy
from .graphs import StepGraphs
from .hooks import LayerProgress, trace_kda_core
from .memory import SEGMENT, DoesNotFit, call_bytes, check_fits, out_of_memory, step_bytes
from .weights import STREAM_TOKENS, WEIGHT_CACHE_BYTES, Weights

__all__ = ["load", "Model", "ModelCache", "KDACache", "MLACache", "DoesNotFit", "LOGITS", "SEGMENT"]

LOGITS = ("all", "last")
LM_HEAD_BLOCK_ROWS = 4096  # a large lm_head is read in blocks of rows (75 MB float64 at 48b); a GPU
# takes 8 times as many (600 MB) per block: a fifth of the launches, a sliver of its memory
EXPERT_GROUP_BYTES = 1 << 30  # torch runs routed experts as batched products over this many bytes of
# float64 expert weights at a time (18 experts at 48b): an expert's three products alone are too
# small for a GPU, and each launch costs more host time than its arithmetic


class Model:
    """Float64 Kimi-Linear over a ``WeightSource`` on an executor (see the module docstring)."""

    def __init__(self, source: WeightSource, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6,
                 kda_gate: str | None = None, executor: Executor = NUMPY, shared_weights: Mapping | None = None,
                 weight_cache_bytes: int | None = None, segment: int = SEGMENT):
        check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps, kda_gate=kda_gate)
        budget = WEIGHT_CACHE_BYTES if weight_cache_bytes is None else int(weight_cache_bytes)
        if budget < 0:
            raise ValueError(f"weight_cache_bytes: expected a non-negative size, got {weight_cache_bytes!r}")
        self.source = source
        self.config: KimiConfig = source.config
        gate = resolve_kda_gate(kda_gate, self.config)
        self.variants = {"moe_combine": moe_combine, "kv_norm_eps": float(kv_norm_eps), "kda_gate": gate}
        self.lower_bound = kda_gate_bound(gate)   # the KDA gate's b (None: softplus)
        self.executor = executor
        self._w = Weights(source, executor, budget, shared_weights)
        self.progress: Callable[[dict], None] | None = None
        self.trace_kda_core = False  # traces also carry layers.{i}.kda.* (the localization sets it)
        if segment < 64 or segment % 64:
            raise ValueError(f"segment: expected a positive multiple of the KDA chunk 64, got {segment!r}")
        self.segment = int(segment)
        # decode_batch gives each row the bits of its own decode on the CPU executors (products row
        # by row, each sequence's mixer on its own); a GPU runs the B rows as one batch instead,
        # where a row's bits depend on the batch anyway (cuBLAS and torch pick kernels by shape)
        self.bitwise_rows = executor.device == "cpu"
        self.lm_head_rows = LM_HEAD_BLOCK_ROWS * (1 if executor.device == "cpu" else 8)
        c = self.config
        per_expert = 3 * c.moe_intermediate_size * c.hidden_size * 8
        self.expert_group = max(1, EXPERT_GROUP_BYTES // per_expert) if executor.name == "torch" else None
        # a one-token decode step on a GPU runs as CUDA graphs (``reference.graphs``) where every
        # weight is a shared device tensor (a source's would be copied from the host inside the
        # graph); None: eager, as every other call
        self.graphs = (StepGraphs(self._w) if executor.name == "torch" and executor.device.startswith("cuda")
                       and self._w.all_shared() else None)

    @property
    def shares_weights(self) -> bool:
        """Whether tensors given as ``shared_weights`` are read instead of the source."""
        return bool(self._w.shared)

    def __repr__(self) -> str:
        return (f"reference.Model({self.source.describe()}, variants={self.variants}, "
                f"executor={self.executor.describe()})")

    # -- public API ------------------------------------------------------------------------------
    def forward(self, token_ids, *, trace: dict | None = None, routing: dict | None = None,
                logits: str = "all"):
        """Logits ``[T, vocab]`` of the whole sequence, recomputed from scratch (``logits="last"``:
        ``[1, vocab]``, the last position's only: a long prompt's ``[T, vocab]`` need not fit).

        ``routing`` ``{layer: ids [T, k_e]}``: replay these expert choices in those MoE layers
        instead of the reference's own top-k (the combine weights are still the reference's scores at
        those ids, by the same rule); a row of ``-1`` keeps that token's own top-k, so one choice can
        be forced alone. For judging a run whose router split a near-tie the other way: with its
        choices replayed, what is left between the two is smooth arithmetic error.
        """
        ids = self._check_ids(token_ids)
        return self._run(ids, trace, self._check_routing(routing, len(ids)), logits=logits,
                         call="forward")[0]

    def prefill(self, token_ids, *, trace: dict | None = None, logits: str = "all",
                riders: dict[int, Rider] | None = None):
        """``(logits [T, vocab], cache)`` for a fresh sequence (``logits="last"``: ``[1, vocab]``).
        ``riders``: as ``decode_batch``'s; where ``bitwise_rows`` (a prefill's products are whole
        GEMMs there, whose bits depend on their rows) each rider runs as a call of its own."""
        ids = self._check_ids(token_ids)
        return self._run(ids, trace, logits=logits, call="prefill", riders=check_riders(riders, self.config))

    def decode(self, token_id, cache: ModelCache, *, trace: dict | None = None):
        """``(logits [vocab], new cache)`` for one more token; ``cache`` is left untouched. The
        one-sequence ``decode_batch``: a sequence decoded alone or in a batch has the same bits."""
        if hasattr(token_id, "shape") and not isinstance(token_id, np.ndarray):
            token_id = to_numpy(token_id)  # a torch scalar from a GPU engine
        ids = np.array([check_token_id(token_id, self.config.vocab_size)], dtype=np.int64)
        check_cache(cache, self.config)
        logits, new = self._step(ids, [cache], trace, call="decode")
        return logits[0], new[0]

    def decode_batch(self, token_ids, caches, *, trace: dict | None = None, riders: dict[int, Rider] | None = None):
        """One more token for each of B sequences: ``token_ids [B]``, ``caches`` B ``ModelCache``s
        of any lengths (left untouched). Returns ``(logits [B, vocab], new caches [B])``.

        Row ``b`` is bit for bit ``decode(token_ids[b], caches[b])``: the token-wise work
        (embedding, norms, projections, router, experts, lm_head) runs on the B rows at once, every
        product row by row (``Weights.row_by_row``: each weight read once for the batch, no row's
        bits depending on another's), and each sequence's KDA recurrence and MLA attention run on
        its own cache. ``trace`` receives ``decode``'s keys, the B sequences' values concatenated
        along axis 0 (``[B, ...]``; ``reference.batch.split_trace`` gives each its own).

        ``riders``: ``{layer: Rider}``, rows run through that layer's FFN in the same call as the
        batch's (``Rider.out`` receives theirs); where ``bitwise_rows``, no row's bits change."""
        ids, caches = check_batch(token_ids, caches, self.config)
        return self._step(ids, caches, trace, call="decode_batch", riders=check_riders(riders, self.config))

    def empty_cache(self) -> ModelCache:
        """The cache of an empty sequence (zero conv/KDA states, empty MLA caches): decoding from it
        token by token equals a prefill."""
        return empty_cache(self.config, self.executor.xp, self.executor.device)

    def memory_estimate(self, T: int, *, cached: int = 0, trace: bool = False, logits: str = "all") -> int:
        """Bytes a call on ``T`` new tokens after ``cached`` ones may hold at its peak on the
        executor's device, beyond the weights' LRU: see ``reference.memory``."""
        return call_bytes(self.config, T, cached=cached, trace=trace, logits=logits,
                          lm_head_rows=self.lm_head_rows, weight_bytes=self._w.budget, segment=self.segment,
                          trace_kda_core=self.trace_kda_core, expert_group=self.expert_group)

    def _check_ids(self, token_ids) -> np.ndarray:
        ids = to_numpy(token_ids) if hasattr(token_ids, "shape") else token_ids
        return check_token_ids(ids, self.config.vocab_size)

    def _check_routing(self, routing, T: int) -> dict:
        return {layer: self.executor.ints(ids) for layer, ids in check_routing(routing, T, self.config).items()}

    # -- the stack -------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, trace: dict | None, routing: dict | None = None, *, logits: str = "all",
             call: str = "forward", riders: dict[int, Rider] | None = None):
        """A fresh sequence ``ids`` (chunked/naive forms), replaying ``routing`` (checked) where
        given, ``riders`` (checked) riding along with its FFNs: ``(logits [T or 1, vocab], cache)``."""
        if logits not in LOGITS:
            raise ValueError(f"logits: expected one of {LOGITS}, got {logits!r}")
        riders = riders or {}
        riding = max((int(r.mid.shape[0]) for r in riders.values()), default=0)
        need = self.memory_estimate(len(ids) + riding, trace=trace is not None, logits=logits)
        return self._guarded(need, call, len(ids), 0,
                             lambda: self._stack(ids, trace, routing or {}, logits, call, riders))

    def _step(self, ids: np.ndarray, caches: list[ModelCache], trace: dict | None, *, call: str,
              riders: dict[int, Rider] | None = None):
        """One token ``ids[b]`` after each ``caches[b]`` (the decode forms): ``(logits [B, vocab],
        new caches [B])``; ``riders`` (checked): rows riding along with a layer's FFN."""
        riders = riders or {}
        lengths = [cc.length for cc in caches]
        need = step_bytes(self.config, lengths, trace=trace is not None, lm_head_rows=self.lm_head_rows,
                          weight_bytes=self._w.budget, segment=self.segment, trace_kda_core=self.trace_kda_core,
                          expert_group=self.expert_group,
                          riding=max((int(r.mid.shape[0]) for r in riders.values()), default=0))
        return self._guarded(need, call, len(ids), max(lengths),
                             lambda: self._step_stack(ids, caches, trace, call, riders))

    def _guarded(self, need: int, call: str, T: int, cached: int, run: Callable):
        """``run()``, refused before it allocates when ``need`` bytes cannot fit; running out
        anyway is ``DoesNotFit`` too. Weights fetched and not yet checked are checked around it."""
        check_fits(need, self.executor, call, T, cached)
        self._w.verify()  # what an interrupted call fetched and did not check
        with out_of_memory(self.executor, call, T, cached):
            out = run()
            self._w.verify()
            return out

    def _stack(self, ids, trace, routing, logits, call, riders):
        c = self.config
        progress = LayerProgress(self.progress, call, c.num_hidden_layers, len(ids))
        h = self._embed(ids)
        new_layers = []
        for i in range(c.num_hidden_layers):
            a, lc = self.mixer(i, h, None, trace=trace)
            new_layers.append(lc)
            h = self._layer_rest(i, h, a, trace, routing.get(i), riders.get(i), together=not self.bitwise_rows)
            progress.done(i)
        out = self._head(h, trace, last=logits == "last")
        return out, ModelCache(new_layers, len(ids))

    def _step_stack(self, ids, caches, trace, call, riders):
        """Every layer on the B sequences' new tokens ``ids [B]``: token-wise work on the B rows
        (products row by row), each sequence's mixer state its own."""
        c = self.config
        progress = LayerProgress(self.progress, call, c.num_hidden_layers, len(ids))
        if self.graphs is not None and len(ids) == 1 and trace is None and not riders and not self.bitwise_rows:
            return self._step_graphed(ids, caches[0], progress)
        new_layers = []  # per layer, the B sequences' new caches
        with self.row_by_row():
            h = self._embed(ids)  # [B, D]
            for i in range(c.num_hidden_layers):
                a, lcs = self.mixer_step(i, h, [cc.layers[i] for cc in caches], trace=trace)
                new_layers.append(lcs)
                h = self._layer_rest(i, h, a, trace, None, riders.get(i))
                progress.done(i)
            out = self._head(h, trace)
        return out, [ModelCache([lcs[b] for lcs in new_layers], cc.length + 1) for b, cc in enumerate(caches)]

    def _step_graphed(self, ids, cache: ModelCache, progress: LayerProgress):
        """``_step_stack`` for one sequence, its parts replayed as CUDA graphs (``self.graphs``):
        each KDA layer whole, an MLA layer's token-wise halves around its attention over the
        cache, the head. The same ops in the same order: ``(logits [1, vocab], [new cache])``."""
        run = self.graphs.run
        h = self._embed(ids)
        new_layers = []
        for i, prev in enumerate(cache.layers):
            if self.config.is_kda_layer(i):
                h, *states = run(("kda", i), partial(self._kda_layer, i), h, *(getattr(prev, f) for f in KDA_FIELDS))
                new_layers.append(KDACache(*states))
            else:
                q, latent, k_pe = run(("mla_in", i), partial(self._mla_layer_in, i), h)
                o, (lc,) = self._mla_attend(i, q, latent, k_pe, [prev])
                (h,) = run(("mla_out", i), partial(self._mla_layer_out, i), h, o)
                new_layers.append(lc)
            progress.done(i)
        (logits,) = run(("head",), lambda h: (self._head(h, None),), h)
        return logits, [ModelCache(new_layers, cache.length + 1)]

    def _kda_layer(self, i: int, h, *states):
        """KDA layer ``i`` on one token ``h [1, D]`` after its cache's arrays ``states``
        (``KDA_FIELDS``): the stream after the layer and the new cache's arrays."""
        a, (lc,) = self.mixer_step(i, h, [KDACache(*states)])
        return (self._layer_rest(i, h, a, None, None), *(getattr(lc, f) for f in KDA_FIELDS))

    def _mla_layer_in(self, i: int, h):
        return self._mla_in(i, self._input_norm(i, h))

    def _mla_layer_out(self, i: int, h, o):
        return (self._layer_rest(i, h, self._mla_out(i, o), None, None),)

    def _layer_rest(self, i: int, h, a, trace: dict | None, routing, rider: Rider | None = None, *,
                    together: bool = True):
        """Layer ``i`` after its mixer: the residual adds around the FFN; the stream after it.
        ``rider``: rows run through the FFN (their outputs to ``rider.out``), in the same call where
        ``together`` (else in a call of their own)."""
        mid = h + a
        together = together and routing is None  # forward's replayed routing takes no riders
        if rider is not None and not together:
            rider.out = self.ffn(i, self.executor.asarray(rider.mid),
                                 routing=None if rider.ids is None else self.executor.ints(to_numpy(rider.ids)))
        if rider is None or not together:
            f = self.ffn(i, mid, trace=trace, routing=routing)
        else:
            f = self._ffn_riding(i, mid, rider, trace)
        out = mid + f
        if trace is not None:
            trace[f"layers.{i}.mixer"] = a
            trace[f"layers.{i}.ffn"] = f
            trace[f"layers.{i}.hidden"] = out
        return out

    def _head(self, h, trace: dict | None, *, last: bool = False):
        """The final norm and the lm_head (``last``: the last row's logits only)."""
        h = self.final_norm(h)
        if trace is not None:
            trace["final_norm"] = h
        return self._lm_head(h[-1:, ...] if last else h)

    def row_by_row(self):
        """A context in which a call on B rows gives each row the bits of that row's call alone
        (every product one row at a time, ``Weights.row_by_row``), where ``bitwise_rows`` (the CPU
        executors); elsewhere nothing changes. ``decode_batch`` runs in it, the diff's batched
        replay too."""
        return self._w.row_by_row() if self.bitwise_rows else nullcontext()

    # -- one layer at a time (the diff's replay runs each layer on an engine's own inputs) --------
    def weight(self, name: str):
        """The float64 weight ``name`` (a checkpoint tensor name) on the executor."""
        return self._w(name)

    def embed(self, ids):
        """The residual stream's start ``[T, D]`` for token ids ``[T]`` (host integers)."""
        return self._embed(check_token_ids(np.asarray(ids), self.config.vocab_size))

    def mixer(self, i: int, h, prev, *, trace: dict | None = None):
        """Layer ``i``'s KDA or MLA block on the residual stream ``h [T, D]`` (its input norm
        included): ``(output [T, D], the layer's new cache)``. ``prev``: the layer's cache
        (``KDACache`` / ``MLACache``) of the positions before these, None for a fresh sequence
        (the prefill forms; else the decode forms, T = 1)."""
        if prev is not None:
            if h.shape[0] != 1:
                raise ValueError(f"mixer: after a cache, h is one token [1, D]; got {tuple(h.shape)}")
            out, (lc,) = self.mixer_step(i, h, [prev], trace=trace)
            return out, lc
        x = self._input_norm(i, h)
        return self._kda(i, x, trace) if self.config.is_kda_layer(i) else self._mla(i, x)

    def mixer_step(self, i: int, h, prevs: list, *, trace: dict | None = None):
        """Layer ``i``'s block on one new token of each of B sequences, ``h [B, D]`` after their
        caches ``prevs`` (the layer's ``KDACache`` / ``MLACache`` of each; the decode forms):
        ``(output [B, D], the B new caches)``. Inside ``row_by_row`` row ``b`` has the bits of
        ``mixer(i, h[b:b+1], prevs[b])`` on the CPU executors."""
        x = self._input_norm(i, h)
        return self._kda_step(i, x, prevs, trace) if self.config.is_kda_layer(i) else self._mla_step(i, x, prevs)

    def _input_norm(self, i: int, h):
        return norm.rms_norm(h, self._w(layer_prefix(i) + "input_layernorm.weight"), eps=self.config.rms_norm_eps)

    def ffn(self, i: int, mid, *, trace: dict | None = None, routing=None):
        """Layer ``i``'s dense MLP or MoE on ``mid [T, D]`` (the stream after the mixer; its
        post-attention norm included): ``[T, D]``. ``routing``: expert ids ``[T, k_e]`` to use
        instead of the router's own top-k (checked by the caller)."""
        x = norm.rms_norm(mid, self._w(layer_prefix(i) + "post_attention_layernorm.weight"),
                          eps=self.config.rms_norm_eps)
        return self._moe(i, x, trace, routing) if self.config.is_moe_layer(i) else self._dense(i, x)

    def _ffn_riding(self, i: int, mid, rider: Rider, trace: dict | None):
        """Layer ``i``'s FFN on ``mid [B, D]`` and the rider's rows in one call, the rider's on its
        own expert ids: ``[B, D]``; the rider's ``[N, D]`` to ``rider.out``."""
        B, ex = mid.shape[0], self.executor
        both = ex.xp.concat([mid, ex.asarray(rider.mid)], axis=0)
        if not self.config.is_moe_layer(i):
            f = self.ffn(i, both)
        else:
            x = norm.rms_norm(both, self._w(layer_prefix(i) + "post_attention_layernorm.weight"),
                              eps=self.config.rms_norm_eps)
            w_own, ids_own = self._route(i, x[:B, ...], trace)
            w_rider, ids_rider = self._route(i, x[B:, ...], None, ex.ints(to_numpy(rider.ids)))
            f = self._experts_out(i, x, ex.xp.concat([w_own, w_rider], axis=0),
                                  ex.xp.concat([ids_own, ids_rider], axis=0))
        rider.out = f[B:, ...]
        return f[:B, ...]

    def final_norm(self, h):
        """The final RMSNorm of the stream ``h [T, D]``: the lm_head's input."""
        return norm.rms_norm(h, self._w("model.norm.weight"), eps=self.config.rms_norm_eps)

    def lm_head(self, x):
        """Logits ``[T, vocab]`` of the final-normed ``x [T, D]``."""
        return self._lm_head(x)

    def _embed(self, ids: np.ndarray):
        name = "model.embed_tokens.weight"
        ex = self.executor
        if self._w.small(name):
            return embed.embedding(ex.ints(ids), self._w(name))
        uniq, inverse = np.unique(ids, return_inverse=True)  # read only the rows of these ids
        return embed.embedding(ex.ints(inverse.reshape(-1)), self._w.rows(name, uniq))

    def _lm_head(self, h):
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        w = self._w
        if w.small(name):
            return embed.lm_head(h, w.operand_of(w(name), name))
        if w.streams and (w.by_row or h.shape[0] <= STREAM_TOKENS):
            return embed.lm_head(h, w.streamed(name))
        V = self.config.vocab_size
        n = self.lm_head_rows
        blocks = [embed.lm_head(h, w.operand_of(w.rows(name, np.arange(lo, min(V, lo + n))), name))
                  for lo in range(0, V, n)]
        return self.executor.xp.concat(blocks, axis=-1)

    def _kda(self, i: int, x, trace: dict | None = None):
        """KDA layer (spec b.10) on normed ``x [T, D]`` of a fresh sequence (chunked), run
        ``SEGMENT`` tokens at a time with the conv and recurrent states carried between them."""
        T = x.shape[0]
        n = self.segment
        core = [] if trace is not None and self.trace_kda_core else None
        outs, lc = [], None
        for s in range(0, T, n):
            part, lc = self._kda_part(i, x[s:s + n, ...], lc, core=core)
            outs.append(part)
        out = outs[0] if len(outs) == 1 else self.executor.xp.concat(outs, axis=0)
        if core is not None:
            trace_kda_core(trace, i, core, None, self.executor.xp)
        return out, lc

    def _kda_in(self, i: int, x):
        """The KDA layer's token-wise projections of normed ``x [T, D]``: the pre-conv q, k, v
        ``[T, H*K]``, the raw gate ``g_raw [T, H, K]``, ``beta_logits [T, H]`` and the output gate
        ``[T, H, K]``."""
        c, w, xp = self.config, self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        T, H, K = x.shape[0], c.kda_num_heads, c.kda_head_dim
        *proj, f_a, g_a, b = w.linears([a + f"{n}_proj.weight" for n in ("q", "k", "v", "f_a", "g_a", "b")], x)
        g_raw = xp.reshape(w.linear(a + "f_b_proj.weight", f_a), (T, H, K))
        beta_logits = xp.reshape(b, (T, H))
        gate = xp.reshape(w.linear(a + "g_b_proj.weight", g_a), (T, H, K))
        return proj, g_raw, beta_logits, gate

    def _A_log(self, a: str, H: int):
        """The KDA layer's ``A_log`` as ``[H]`` (None: a bounded-gate checkpoint without it)."""
        if not self.config.kda_A_log:
            return None
        return self.executor.xp.reshape(self._w(a + "A_log"), (H,))

    def _kda_out(self, i: int, o, gate):
        """The gated norm of the core's output ``o [T, H, K]`` and the output projection: ``(out
        [T, D], normed [T, H, K])``."""
        c, w, xp = self.config, self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        T, H, K = o.shape
        o = norm.gated_rms_norm(o, gate, w(a + "o_norm.weight"), eps=c.rms_norm_eps)
        return w.linear(a + "o_proj.weight", xp.reshape(o, (T, H * K))), o

    def _kda_part(self, i: int, x, prev: KDACache | None, *, core: list | None = None):
        """The KDA layer on ``x [T, D]`` of a fresh sequence after ``prev`` (None: zero states; else
        the previous segment's), in the chunked prefill forms. ``core``: a list that receives the KDA
        core's arguments and the gated norm's output (for the trace)."""
        w, xp = self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        T, H, K = x.shape[0], self.config.kda_num_heads, self.config.kda_head_dim
        proj, g_raw, beta_logits, gate = self._kda_in(i, x)
        conv_out, conv_states = [], []
        for which, p in zip("qkv", proj):
            init = None if prev is None else getattr(prev, f"conv_{which}")[None]
            y, st = conv.short_conv(p[None], w(a + f"{which}_conv1d.weight")[:, 0, :], initial_state=init)
            conv_out.append(xp.reshape(y[0], (1, T, H, K)))
            conv_states.append(st[0])
        q, k, v = conv_out
        args = (q, k, g_raw[None], beta_logits[None], self._A_log(a, H), w(a + "dt_bias"), self.lower_bound)
        o, S = kda.fused_chunked(*args[:2], v, *args[2:6], lower_bound=args[6],
                                 initial_state=None if prev is None else prev.state[None])
        out, normed = self._kda_out(i, o[0], gate)
        if core is not None:
            core.append((args, v, normed))
        return out, KDACache(*conv_states, S[0])

    def _kda_step(self, i: int, x, prevs: list[KDACache], trace: dict | None):
        """The KDA layer on one new token of each of B sequences, normed ``x [B, D]`` after their
        caches ``prevs``: projections and the gated norm on the B rows, the conv step and the
        recurrence (``fused_recurrent``) on each sequence's own states: one sequence at a time
        where ``bitwise_rows``, else the B sequences' states stacked into one call.
        ``(out [B, D], B new KDACaches)``."""
        w, xp = self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        B, H, K = x.shape[0], self.config.kda_num_heads, self.config.kda_head_dim
        proj, g_raw, beta_logits, gate = self._kda_in(i, x)
        # q, k and v's depthwise convs as one over their channels side by side (a third of the calls)
        C = H * K
        taps = xp.concat([w(a + f"{which}_conv1d.weight")[:, 0, :] for which in "qkv"], axis=0)  # [3C, W]
        qkv = xp.concat(proj, axis=-1)  # [B, 3C]
        A_log, dt_bias = self._A_log(a, H), w(a + "dt_bias")
        runs = [(b, b + 1) for b in range(B)] if self.bitwise_rows else [(0, B)]
        outs, caches, core = [], [], []
        for lo, hi in runs:
            n, mine = hi - lo, prevs[lo:hi]
            state = xp.concat([_stacked(xp, [getattr(c, f"conv_{which}") for c in mine]) for which in "qkv"], axis=1)
            y, st = conv.short_conv_step(qkv[lo:hi, ...], taps, state)  # [n, 3C], [n, 3C, W-1]
            q, k, v = (xp.reshape(y[:, j * C:(j + 1) * C], (n, 1, H, K)) for j in range(3))
            conv_states = [st[:, j * C:(j + 1) * C, :] for j in range(3)]
            args = (q, k, xp.reshape(g_raw[lo:hi, ...], (n, 1, H, K)),
                    xp.reshape(beta_logits[lo:hi, ...], (n, 1, H)), A_log, dt_bias, self.lower_bound)
            o, S = kda.fused_recurrent(*args[:2], v, *args[2:6], lower_bound=args[6],
                                       initial_state=_stacked(xp, [c.state for c in mine]))
            outs.append(o[:, 0, ...])
            caches += [KDACache(*(st[j, ...] for st in conv_states), S[j, ...]) for j in range(n)]
            core.append((lo, hi, args, v))
        out, normed = self._kda_out(i, outs[0] if len(outs) == 1 else xp.concat(outs, axis=0), gate)
        if trace is not None and self.trace_kda_core:
            # each run as one sequence of n tokens: the trace's [B, ...] rows in sequence order
            seq = lambda t: xp.reshape(t, (1, t.shape[0] * t.shape[1], *t.shape[2:]))  # noqa: E731
            parts = [((*map(seq, args[:4]), *args[4:]), seq(v), normed[lo:hi, ...]) for lo, hi, args, v in core]
            trace_kda_core(trace, i, parts, xp.concat([p.state for p in prevs], axis=0), xp)
        return out, caches

    def _mla_in(self, i: int, x):
        """The MLA layer's token-wise part on normed ``x [T, D]``: queries ``[T, N, P+R]``, the
        normed latents ``[T, L]`` and key-pe ``[T, R]`` of these positions."""
        c, w, xp = self.config, self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        N, P, R, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q, kv = w.linears([a + "q_proj.weight", a + "kv_a_proj_with_mqa.weight"], x)  # kv: [T, L+R]
        q = xp.reshape(q, (x.shape[0], N, P + R))
        latent = norm.rms_norm(kv[:, :L], w(a + "kv_a_layernorm.weight"), eps=self.variants["kv_norm_eps"])
        return q, latent, kv[:, L:]

    def _mla_out(self, i: int, o):
        """The output projection of the attention ``o [T, N, Vh]``: ``[T, D]``."""
        xp = self.executor.xp
        T, N, Vh = o.shape
        return self._w.linear(layer_prefix(i) + "self_attn.o_proj.weight", xp.reshape(o, (T, N * Vh)))

    def _mla(self, i: int, x):
        """MLA layer (spec b.11/b.12) on normed ``x [T, D]`` of a fresh sequence: the naive form."""
        q, latent, k_pe = self._mla_in(i, x)
        o = mla.naive(q[None], latent[None], k_pe[None], self._w(layer_prefix(i) + "self_attn.kv_b_proj.weight"))
        return self._mla_out(i, o[0]), MLACache(latent, k_pe)

    def _mla_step(self, i: int, x, prevs: list[MLACache]):
        """The MLA layer on one new token of each of B sequences, normed ``x [B, D]`` after their
        caches ``prevs``: projections on the B rows, each sequence's absorbed attention over its own
        cache: one sequence at a time where ``bitwise_rows``, else the B caches padded to the
        longest and attended in one call (``mla.absorbed(lengths=)``). ``(out [B, D], B new
        MLACaches)``."""
        q, latent, k_pe = self._mla_in(i, x)
        o, caches = self._mla_attend(i, q, latent, k_pe, prevs)
        return self._mla_out(i, o), caches

    def _mla_attend(self, i: int, q, latent, k_pe, prevs: list[MLACache]):
        """``_mla_step``'s attention: each sequence's queries ``q [B, N, P+R]`` over its cache
        ``prevs[b]`` and its new latent and key-pe rows: ``(o [B, N, Vh], B new MLACaches)``."""
        xp = self.executor.xp
        kv_b = self._w(layer_prefix(i) + "self_attn.kv_b_proj.weight")
        lats = [xp.concat([prev.latent, latent[b:b + 1, ...]], axis=0) for b, prev in enumerate(prevs)]
        pes = [xp.concat([prev.k_pe, k_pe[b:b + 1, ...]], axis=0) for b, prev in enumerate(prevs)]
        caches = [MLACache(lat, pe) for lat, pe in zip(lats, pes)]
        if self.bitwise_rows:
            outs = [mla.absorbed(q[None, b:b + 1, ...], lat[None], pe[None], kv_b)[0]  # [1, N, Vh]
                    for b, (lat, pe) in enumerate(zip(lats, pes))]
            return xp.concat(outs, axis=0), caches
        lengths = [int(lat.shape[0]) for lat in lats]
        S = max(lengths)
        o = mla.absorbed(q[:, None, ...], _padded(xp, lats, S), _padded(xp, pes, S), kv_b, lengths=lengths)
        return o[:, 0, ...], caches

    def _dense(self, i: int, x):
        m, w = layer_prefix(i) + "mlp.", self._w
        return moe.swiglu(x, *(w.operand(m + f"{p}_proj.weight") for p in ("gate", "up", "down")))

    def _moe(self, i: int, x, trace: dict | None, forced=None):
        """Sigmoid-routed MoE (spec b.13/b.14): router logits ``x @ W.T`` in float64, routed experts
        loaded one by one for the selected ids (``forced``: these instead), plus the shared expert."""
        return self._experts_out(i, x, *self._route(i, x, trace, forced))

    def _route(self, i: int, x, trace: dict | None, forced=None):
        """MoE layer ``i``'s router on ``x [T, D]``: ``(weights, ids) [T, k_e]`` (``forced``: these
        ids, weighted by this router's scores)."""
        c, w = self.config, self._w
        m = layer_prefix(i) + "block_sparse_moe."
        logits = w.linear(m + "gate.weight", x)  # [T, E]
        bias = w(m + "gate.e_score_correction_bias")
        rule = dict(renormalize=c.moe_renormalize, scaling=c.routed_scaling_factor,
                    combine=self.variants["moe_combine"])
        if forced is None:
            weights, ids = moe.router(logits, bias, top_k=c.num_experts_per_token,
                                      num_groups=c.num_expert_group, topk_groups=c.topk_group, **rule)
        else:
            ids = forced
            own = to_numpy(forced)[:, 0] == OWN
            if own.any():  # these rows keep the router's own top-k
                _, mine = moe.router(logits, bias, top_k=c.num_experts_per_token, num_groups=c.num_expert_group,
                                     topk_groups=c.topk_group, **rule)
                ex = self.executor
                ids = ex.xp.where(ex.asarray(own, dtype=ex.xp.bool)[:, None], mine, forced)
            weights = moe.route_weights(sigmoid(logits), bias, ids, **rule)
        if trace is not None:
            scores = sigmoid(logits)
            trace[f"layers.{i}.router.scores"] = scores
            trace[f"layers.{i}.router.selection"] = scores + bias
            trace[f"layers.{i}.router.ids"] = ids
        return weights, ids

    def _experts_out(self, i: int, x, weights, ids):
        """MoE layer ``i``'s routed experts on ``x [T, D]`` with their ``weights``, ``ids [T, k_e]``,
        plus the shared expert: ``[T, D]``."""
        c, w = self.config, self._w
        m = layer_prefix(i) + "block_sparse_moe."
        E, n = c.num_experts, self.segment
        w1, w2, w3 = (w.experts(i, which, E) for which in ("w1", "w2", "w3"))
        group = None if w.by_row else self.expert_group  # row by row: one expert at a time
        parts = [moe.experts(x[s:s + n, ...], weights[s:s + n, ...], ids[s:s + n, ...], w1, w2, w3, group=group)
                 for s in range(0, x.shape[0], n)]
        y = parts[0] if len(parts) == 1 else self.executor.xp.concat(parts, axis=0)
        if c.num_shared_experts:
            s = m + "shared_experts."
            y = y + moe.swiglu(x, *(w.operand(s + f"{p}_proj.weight") for p in ("gate", "up", "down")))
        return y


KDA_FIELDS = ("conv_q", "conv_k", "conv_v", "state")  # a KDACache's arrays, in its order


def _padded(xp, arrays: list, S: int):
    """``arrays`` (``[S_b, W]`` each) zero-padded to ``S`` rows and stacked: ``[B, S, W]``, as one
    concatenation with slices of one zero block (two launches for any B)."""
    a0 = arrays[0]
    zeros = xp.zeros((S, a0.shape[1]), dtype=a0.dtype, device=device_of(a0))
    parts = [p for a in arrays for p in ((a,) if a.shape[0] == S else (a, zeros[:S - a.shape[0], ...]))]
    return xp.reshape(xp.concat(parts, axis=0), (len(arrays), S, a0.shape[1]))


def _stacked(xp, arrays: list):
    """``arrays`` (one shape) stacked along a new first axis (one array: a view, no copy)."""
    return arrays[0][None, ...] if len(arrays) == 1 else xp.stack(arrays, axis=0)


def load(path_or_source, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6,
         kda_gate: str | None = None, device: str | None = None, executor: str | None = None,
         shared_weights: Mapping | None = None, weight_cache_bytes: int | None = None) -> Model:
    """The float64 reference model of a checkpoint directory or a ``WeightSource``.

    ``moe_combine``: "unbiased" (vLLM, default) or "biased" (HF remote code); ``kv_norm_eps``: the
    ``kv_a_layernorm`` eps (1e-6 HF, default; 1e-5 vLLM); ``kda_gate``: "softplus" or
    "lower_bound:<b>" (b in [-5, 0)), default the checkpoint config's gate. ``device``: "cpu" (default), "cuda" or
    "cuda:N"; ``executor``: "numpy" (default on cpu), "torch" (default on cuda; also runs on cpu),
    "array-api-strict" (tests). ``shared_weights``: ``{name: tensor}`` already on the device in the
    storage dtype or wider (the optimized model's, ``optimized.weights.named_views``), read instead
    of the source. ``weight_cache_bytes``: the float64 weight LRU (default 64 MiB). Raises
    ``ValueError`` for an unknown variant, device or executor and ``CheckpointError`` for a broken
    checkpoint."""
    check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps, kda_gate=kda_gate)
    ex = get_executor(device, executor)
    if shared_weights is not None and ex.name != "torch":
        raise ValueError(f"shared_weights: needs the torch executor, not {ex.name}")
    if isinstance(path_or_source, WeightSource):
        source = path_or_source
    elif isinstance(path_or_source, (str, os.PathLike)):
        source = open_source(path_or_source)
    else:
        raise TypeError(f"load: expected a checkpoint path or a WeightSource, got {type(path_or_source).__name__}")
    return Model(source, moe_combine=moe_combine, kv_norm_eps=kv_norm_eps, kda_gate=kda_gate, executor=ex,
                 shared_weights=shared_weights, weight_cache_bytes=weight_cache_bytes)
