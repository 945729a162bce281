"""The float64 Kimi-Linear model (spec b.10-b.17), built from the reference ops, streaming its weights.

``load(path_or_source, *, moe_combine="unbiased", kv_norm_eps=1e-6, device="cpu", executor=None,
shared_weights=None, weight_cache_bytes=None)`` returns a ``Model`` with ``forward`` (full recompute),
``prefill`` and ``decode``; one sequence, 1-D token ids. The model runs on an executor
(``reference.executor``): NumPy on the CPU by default, torch float64 on ``device="cuda"`` (or on the
CPU with ``executor="torch"``); its arrays (logits, caches, traces) are that library's.

This module is the math; beside it live the weights (``reference.weights``: fetched layer by layer
as they are used, converted from their storage bits to float64 on the executor's device through a
byte-bounded LRU, ``weight_cache_bytes``, or applied straight from the bits, ``reference.streamed``),
the caches (``reference.cache``), the memory guard (``reference.memory``) and the progress and
trace hooks (``reference.hooks``). With ``shared_weights`` (``{name: tensor}`` on the device, e.g.
the optimized model's bf16 weights) those tensors are read instead of the source: 98 GB of bf16
weights once on one GPU for both models.

Which form of each op runs where (both forms of KDA and MLA are exact in float64, so prefill
followed by decode equals one longer prefill to ~1e-15):

- ``forward`` / ``prefill``: KDA ``fused_chunked`` (chunk 64), MLA ``naive``;
- ``decode``: conv ``short_conv_step``, KDA ``fused_recurrent``, MLA ``absorbed``.

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
code) and ``kv_norm_eps`` (``kv_a_layernorm`` eps: 1e-6 HF, 1e-5 vLLM).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np

from . import conv, embed, kda, mla, moe, norm
from .cache import KDACache, MLACache, ModelCache, check_cache, empty_cache
from .checkpoint import WeightSource, open_source
from .checks import check_routing, check_token_id, check_token_ids, check_variants
from .config import KimiConfig
from .elementwise import sigmoid
from .executor import NUMPY, Executor, get_executor, to_numpy
from .hooks import LayerProgress, trace_kda_core
from .memory import SEGMENT, DoesNotFit, call_bytes, check_fits, out_of_memory
from .tensors import layer_prefix
from .weights import STREAM_TOKENS, WEIGHT_CACHE_BYTES, Weights

__all__ = ["load", "Model", "ModelCache", "KDACache", "MLACache", "DoesNotFit", "LOGITS", "SEGMENT"]

LOGITS = ("all", "last")
LM_HEAD_BLOCK_ROWS = 4096  # a large lm_head is read in blocks of rows (75 MB float64 at 48b)


class Model:
    """Float64 Kimi-Linear over a ``WeightSource`` on an executor (see the module docstring)."""

    def __init__(self, source: WeightSource, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6,
                 executor: Executor = NUMPY, shared_weights: Mapping | None = None,
                 weight_cache_bytes: int | None = None, segment: int = SEGMENT):
        check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps)
        budget = WEIGHT_CACHE_BYTES if weight_cache_bytes is None else int(weight_cache_bytes)
        if budget < 0:
            raise ValueError(f"weight_cache_bytes: expected a non-negative size, got {weight_cache_bytes!r}")
        self.source = source
        self.config: KimiConfig = source.config
        self.variants = {"moe_combine": moe_combine, "kv_norm_eps": float(kv_norm_eps)}
        self.executor = executor
        self._w = Weights(source, executor, budget, shared_weights)
        self.progress: Callable[[dict], None] | None = None
        self.trace_kda_core = False  # traces also carry layers.{i}.kda.* (the localization sets it)
        if segment < 64 or segment % 64:
            raise ValueError(f"segment: expected a positive multiple of the KDA chunk 64, got {segment!r}")
        self.segment = int(segment)

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
        those ids, by the same rule). For judging a run whose router split a near-tie the other way:
        with its choices replayed, what is left between the two is smooth arithmetic error.
        """
        ids = self._check_ids(token_ids)
        return self._run(ids, None, trace, self._check_routing(routing, len(ids)), logits=logits,
                         call="forward")[0]

    def prefill(self, token_ids, *, trace: dict | None = None, logits: str = "all"):
        """``(logits [T, vocab], cache)`` for a fresh sequence (``logits="last"``: ``[1, vocab]``)."""
        ids = self._check_ids(token_ids)
        return self._run(ids, None, trace, logits=logits, call="prefill")

    def decode(self, token_id, cache: ModelCache, *, trace: dict | None = None):
        """``(logits [vocab], new cache)`` for one more token; ``cache`` is left untouched."""
        if hasattr(token_id, "shape") and not isinstance(token_id, np.ndarray):
            token_id = to_numpy(token_id)  # a torch scalar from a GPU engine
        ids = np.array([check_token_id(token_id, self.config.vocab_size)], dtype=np.int64)
        check_cache(cache, self.config)
        logits, new = self._run(ids, cache, trace, call="decode")
        return logits[0], new

    def empty_cache(self) -> ModelCache:
        """The cache of an empty sequence (zero conv/KDA states, empty MLA caches): decoding from it
        token by token equals a prefill."""
        return empty_cache(self.config, self.executor.xp, self.executor.device)

    def memory_estimate(self, T: int, *, cached: int = 0, trace: bool = False, logits: str = "all") -> int:
        """Bytes a call on ``T`` new tokens after ``cached`` ones may hold at its peak on the
        executor's device, beyond the weights' LRU: see ``reference.memory``."""
        return call_bytes(self.config, T, cached=cached, trace=trace, logits=logits,
                          lm_head_rows=LM_HEAD_BLOCK_ROWS, weight_bytes=self._w.budget, segment=self.segment,
                          trace_kda_core=self.trace_kda_core)

    def _check_ids(self, token_ids) -> np.ndarray:
        ids = to_numpy(token_ids) if hasattr(token_ids, "shape") else token_ids
        return check_token_ids(ids, self.config.vocab_size)

    def _check_routing(self, routing, T: int) -> dict:
        return {layer: self.executor.ints(ids) for layer, ids in check_routing(routing, T, self.config).items()}

    # -- the stack -------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, cache: ModelCache | None, trace: dict | None, routing: dict | None = None,
             *, logits: str = "all", call: str = "forward"):
        """Run ``ids`` after ``cache`` (None: a fresh sequence, chunked/naive forms; else the decode
        forms), replaying ``routing`` (checked) where given. Returns (logits [T or 1, vocab], new cache).
        Refuses a call that cannot fit before it allocates; running out anyway is ``DoesNotFit`` too."""
        if logits not in LOGITS:
            raise ValueError(f"logits: expected one of {LOGITS}, got {logits!r}")
        cached = 0 if cache is None else cache.length
        need = self.memory_estimate(len(ids), cached=cached, trace=trace is not None, logits=logits)
        check_fits(need, self.executor, call, len(ids), cached)
        self._w.verify()  # what an interrupted call fetched and did not check
        with out_of_memory(self.executor, call, len(ids), cached):
            out = self._stack(ids, cache, trace, routing or {}, logits, call)
            self._w.verify()
            return out

    def _stack(self, ids, cache, trace, routing, logits, call):
        c = self.config
        progress = LayerProgress(self.progress, call, c.num_hidden_layers, len(ids))
        h = self._embed(ids)
        new_layers = []
        for i in range(c.num_hidden_layers):
            a, lc = self.mixer(i, h, None if cache is None else cache.layers[i], trace=trace)
            new_layers.append(lc)
            h = h + a
            f = self.ffn(i, h, trace=trace, routing=routing.get(i))
            h = h + f
            if trace is not None:
                trace[f"layers.{i}.mixer"] = a
                trace[f"layers.{i}.ffn"] = f
                trace[f"layers.{i}.hidden"] = h
            progress.done(i)
        h = self.final_norm(h)
        if trace is not None:
            trace["final_norm"] = h
        out = self._lm_head(h if logits == "all" else h[-1:, ...])
        return out, ModelCache(new_layers, len(ids) + (0 if cache is None else cache.length))

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
        x = norm.rms_norm(h, self._w(layer_prefix(i) + "input_layernorm.weight"), eps=self.config.rms_norm_eps)
        return self._kda(i, x, prev, trace) if self.config.is_kda_layer(i) else self._mla(i, x, prev)

    def ffn(self, i: int, mid, *, trace: dict | None = None, routing=None):
        """Layer ``i``'s dense MLP or MoE on ``mid [T, D]`` (the stream after the mixer; its
        post-attention norm included): ``[T, D]``. ``routing``: expert ids ``[T, k_e]`` to use
        instead of the router's own top-k (checked by the caller)."""
        x = norm.rms_norm(mid, self._w(layer_prefix(i) + "post_attention_layernorm.weight"),
                          eps=self.config.rms_norm_eps)
        return self._moe(i, x, trace, routing) if self.config.is_moe_layer(i) else self._dense(i, x)

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
        if self._w.small(name):
            return embed.lm_head(h, self._w(name))
        if self._w.streams and h.shape[0] <= STREAM_TOKENS:
            return embed.lm_head(h, self.source.streamed(name))
        V = self.config.vocab_size
        blocks = [embed.lm_head(h, self._w.rows(name, np.arange(lo, min(V, lo + LM_HEAD_BLOCK_ROWS))))
                  for lo in range(0, V, LM_HEAD_BLOCK_ROWS)]
        return self.executor.xp.concat(blocks, axis=-1)

    def _kda(self, i: int, x, prev: KDACache | None, trace: dict | None = None):
        """KDA layer (spec b.10) on normed ``x [T, D]``; ``prev`` None = fresh sequence (chunked), run
        ``SEGMENT`` tokens at a time with the conv and recurrent states carried between them."""
        T = x.shape[0]
        n = self.segment
        core = [] if trace is not None and self.trace_kda_core else None
        if prev is not None or T <= n:
            out, lc = self._kda_part(i, x, prev, fresh=prev is None, core=core)
        else:
            outs, lc = [], None
            for s in range(0, T, n):
                part, lc = self._kda_part(i, x[s:s + n, ...], lc, fresh=True, core=core)
                outs.append(part)
            out = self.executor.xp.concat(outs, axis=0)
        if core is not None:
            trace_kda_core(trace, i, core, None if prev is None else prev.state, self.executor.xp)
        return out, lc

    def _kda_part(self, i: int, x, prev: KDACache | None, *, fresh: bool, core: list | None = None):
        """The KDA layer on ``x [T, D]`` after ``prev`` (None: zero states); ``fresh``: the chunked
        prefill forms (else the decode forms: conv step and recurrence, T = 1). ``core``: a list
        that receives the KDA core's arguments and the gated norm's output (for the trace)."""
        c, w, xp = self.config, self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        T = x.shape[0]
        H, K = c.kda_num_heads, c.kda_head_dim
        conv_out, conv_states = [], []
        for which in "qkv":
            proj = w.linear(a + f"{which}_proj.weight", x)  # [T, H*K]
            cw = w(a + f"{which}_conv1d.weight")[:, 0, :]  # [C, W]
            if fresh:
                init = None if prev is None else getattr(prev, f"conv_{which}")[None]
                y, st = conv.short_conv(proj[None], cw, initial_state=init)
                y = y[0]
            else:
                state = getattr(prev, f"conv_{which}")[None]
                y, st = conv.short_conv_step(proj, cw, state)
            conv_out.append(xp.reshape(y, (1, T, H, K)))
            conv_states.append(st[0])
        q, k, v = conv_out
        g_raw = xp.reshape(w.linear(a + "f_b_proj.weight", w.linear(a + "f_a_proj.weight", x)), (1, T, H, K))
        beta_logits = xp.reshape(w.linear(a + "b_proj.weight", x), (1, T, H))
        A_log = xp.reshape(w(a + "A_log"), (H,))
        dt_bias = w(a + "dt_bias")
        if fresh:
            o, S = kda.fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias,
                                     initial_state=None if prev is None else prev.state[None])
        else:
            o, S = kda.fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias,
                                       initial_state=prev.state[None])
        gate = xp.reshape(w.linear(a + "g_b_proj.weight", w.linear(a + "g_a_proj.weight", x)), (T, H, K))
        o = norm.gated_rms_norm(o[0], gate, w(a + "o_norm.weight"), eps=c.rms_norm_eps)
        if core is not None:
            core.append(((q, k, g_raw, beta_logits, A_log, dt_bias), v, o))
        out = w.linear(a + "o_proj.weight", xp.reshape(o, (T, H * K)))
        return out, KDACache(*conv_states, S[0])

    def _mla(self, i: int, x, prev: MLACache | None):
        """MLA layer (spec b.11/b.12) on normed ``x [T, D]``; naive form for a fresh sequence, absorbed
        form over the cache in decode."""
        c, w, xp = self.config, self._w, self.executor.xp
        a = layer_prefix(i) + "self_attn."
        T = x.shape[0]
        N, P, R, Vh, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                          c.v_head_dim, c.kv_lora_rank)
        q = xp.reshape(w.linear(a + "q_proj.weight", x), (1, T, N, P + R))
        kv = w.linear(a + "kv_a_proj_with_mqa.weight", x)  # [T, L+R]
        latent = norm.rms_norm(kv[:, :L], w(a + "kv_a_layernorm.weight"), eps=self.variants["kv_norm_eps"])
        k_pe = kv[:, L:]
        if prev is not None:
            latent = xp.concat([prev.latent, latent], axis=0)
            k_pe = xp.concat([prev.k_pe, k_pe], axis=0)
        attend = mla.naive if prev is None else mla.absorbed
        o = attend(q, latent[None], k_pe[None], w(a + "kv_b_proj.weight"))  # [1, T, N, Vh]
        out = w.linear(a + "o_proj.weight", xp.reshape(o[0], (T, N * Vh)))
        return out, MLACache(latent, k_pe)

    def _dense(self, i: int, x):
        m, w = layer_prefix(i) + "mlp.", self._w
        return moe.swiglu(x, *(w.operand(m + f"{p}_proj.weight") for p in ("gate", "up", "down")))

    def _moe(self, i: int, x, trace: dict | None, forced=None):
        """Sigmoid-routed MoE (spec b.13/b.14): router logits ``x @ W.T`` in float64, routed experts
        loaded one by one for the selected ids (``forced``: these instead), plus the shared expert."""
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
            weights = moe.route_weights(sigmoid(logits), bias, ids, **rule)
        if trace is not None:
            scores = sigmoid(logits)
            trace[f"layers.{i}.router.scores"] = scores
            trace[f"layers.{i}.router.selection"] = scores + bias
            trace[f"layers.{i}.router.ids"] = ids
        E, n = c.num_experts, self.segment
        w1, w2, w3 = (w.experts(i, which, E) for which in ("w1", "w2", "w3"))
        parts = [moe.experts(x[s:s + n, ...], weights[s:s + n, ...], ids[s:s + n, ...], w1, w2, w3)
                 for s in range(0, x.shape[0], n)]
        y = parts[0] if len(parts) == 1 else self.executor.xp.concat(parts, axis=0)
        if c.num_shared_experts:
            s = m + "shared_experts."
            y = y + moe.swiglu(x, *(w.operand(s + f"{p}_proj.weight") for p in ("gate", "up", "down")))
        return y


def load(path_or_source, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6,
         device: str | None = None, executor: str | None = None, shared_weights: Mapping | None = None,
         weight_cache_bytes: int | None = None) -> Model:
    """The float64 reference model of a checkpoint directory or a ``WeightSource``.

    ``moe_combine``: "unbiased" (vLLM, default) or "biased" (HF remote code); ``kv_norm_eps``: the
    ``kv_a_layernorm`` eps (1e-6 HF, default; 1e-5 vLLM). ``device``: "cpu" (default), "cuda" or
    "cuda:N"; ``executor``: "numpy" (default on cpu), "torch" (default on cuda; also runs on cpu),
    "array-api-strict" (tests). ``shared_weights``: ``{name: tensor}`` already on the device in the
    storage dtype or wider (the optimized model's, ``optimized.weights.named_views``), read instead
    of the source. ``weight_cache_bytes``: the float64 weight LRU (default 64 MiB). Raises
    ``ValueError`` for an unknown variant, device or executor and ``CheckpointError`` for a broken
    checkpoint."""
    check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps)
    ex = get_executor(device, executor)
    if shared_weights is not None and ex.name != "torch":
        raise ValueError(f"shared_weights: needs the torch executor, not {ex.name}")
    if isinstance(path_or_source, WeightSource):
        source = path_or_source
    elif isinstance(path_or_source, (str, os.PathLike)):
        source = open_source(path_or_source)
    else:
        raise TypeError(f"load: expected a checkpoint path or a WeightSource, got {type(path_or_source).__name__}")
    return Model(source, moe_combine=moe_combine, kv_norm_eps=kv_norm_eps, executor=ex,
                 shared_weights=shared_weights, weight_cache_bytes=weight_cache_bytes)
