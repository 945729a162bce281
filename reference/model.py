"""The float64 Kimi-Linear model (spec b.10-b.17), built from the reference ops, streaming its weights.

``load(path_or_source, *, moe_combine="unbiased", kv_norm_eps=1e-6)`` returns a ``Model`` with
``forward`` (full recompute), ``prefill`` and ``decode``; one sequence, 1-D token ids. Weights are
fetched from the ``WeightSource`` layer by layer through a small LRU (``WEIGHT_CACHE_BYTES``), routed
experts one at a time for the ids the router picked, embedding rows by id and the lm_head in row
blocks, so memory stays about one layer even for kimi-linear-48b.

Which form of each op runs where (both forms of KDA and MLA are exact in float64, so prefill
followed by decode equals one longer prefill to ~1e-15):

- ``forward`` / ``prefill``: KDA ``fused_chunked`` (chunk 64), MLA ``naive``;
- ``decode``: conv ``short_conv_step``, KDA ``fused_recurrent``, MLA ``absorbed``.

The reference is functional: ``decode`` never mutates its input cache (its arrays are read-only)
and returns a new one. ``trace`` (a dict) receives float64 arrays, ``[T, ...]`` also in decode
(T = 1): ``layers.{i}.mixer`` / ``.ffn`` (the branch outputs added to the residual),
``layers.{i}.hidden`` (residual stream after layer i), ``layers.{i}.router.scores`` (sigmoid scores
``[T, E]``), ``layers.{i}.router.selection`` (scores + bias ``[T, E]``), ``layers.{i}.router.ids``
(``[T, k_e]``) and ``final_norm``. With ``model.trace_kda_core = True`` it also receives, per KDA
layer, the core's inputs ``layers.{i}.kda.{q,k,v,g,beta}`` (after the fused prologue), the state
it started from ``.initial_state`` ``[HV, K, V]`` and the gated norm's output ``.normed``
``[T, HV, V]``: the localization's bound replays the recurrence on them.

Semantic variants (spec §(e)), reported in ``model.variants``: ``moe_combine`` ("unbiased": combine
weights from the sigmoid scores, as vLLM; "biased": from scores + correction bias, as the HF remote
code) and ``kv_norm_eps`` (``kv_a_layernorm`` eps: 1e-6 HF, 1e-5 vLLM).
"""
from __future__ import annotations

import math
import numbers
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import conv, embed, kda, mla, moe, norm
from .checkpoint import WeightSource, open_source
from .config import KimiConfig
from .elementwise import sigmoid
from .tensors import expert_name, layer_prefix

MOE_COMBINES = ("unbiased", "biased")
WEIGHT_CACHE_BYTES = 64 << 20  # LRU of float64 weights: all of tiny/small, a few tensors of 48b
LM_HEAD_BLOCK_ROWS = 4096  # a large lm_head is read in blocks of rows (75 MB float64 at 48b)


# -- caches ------------------------------------------------------------------------------------------

def _frozen(a) -> np.ndarray:
    a = np.array(a, dtype=np.float64)  # a private copy: the cache owns its arrays
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class KDACache:
    """State of one KDA layer: conv states ``[C, W-1]`` (the last W-1 pre-conv q/k/v projections,
    oldest first) and the recurrent state ``[H, K, V]`` (K-first)."""
    conv_q: np.ndarray
    conv_k: np.ndarray
    conv_v: np.ndarray
    state: np.ndarray

    def __post_init__(self):
        for f in ("conv_q", "conv_k", "conv_v", "state"):
            object.__setattr__(self, f, _frozen(getattr(self, f)))


@dataclass(frozen=True)
class MLACache:
    """State of one MLA layer: the normed latents ``[S, L]`` and un-rotated key-pe ``[S, R]``."""
    latent: np.ndarray
    k_pe: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "latent", _frozen(self.latent))
        object.__setattr__(self, "k_pe", _frozen(self.k_pe))


@dataclass(frozen=True)
class ModelCache:
    """Per-layer caches (``KDACache`` or ``MLACache`` in layer order) and the number of tokens seen."""
    layers: tuple
    length: int

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))


# -- weights -----------------------------------------------------------------------------------------

class _Weights:
    """float64 weights from a source through a byte-bounded LRU (arrays handed out read-only)."""

    def __init__(self, source: WeightSource, budget: int):
        self.source, self.budget = source, budget
        self._lru: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0

    def __call__(self, name: str) -> np.ndarray:
        a = self._lru.get(name)
        if a is not None:
            self._lru.move_to_end(name)
            return a
        a = self.source.get(name)
        a.setflags(write=False)
        if a.nbytes <= self.budget // 4:
            self._lru[name] = a
            self._bytes += a.nbytes
            while self._bytes > self.budget:
                _, old = self._lru.popitem(last=False)
                self._bytes -= old.nbytes
        return a

    def small(self, name: str) -> bool:
        return math.prod(self.source.shape(name)) * 8 <= self.budget // 4


class _Experts(Sequence):
    """``w[e]`` loads expert ``e``'s matrix on demand (what ``moe.experts`` indexes)."""

    def __init__(self, weights: _Weights, layer: int, which: str, count: int):
        self._w, self._layer, self._which, self._count = weights, layer, which, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, e):
        e = int(e)
        if not 0 <= e < self._count:
            raise IndexError(f"expert {e} out of range [0, {self._count})")
        return self._w(expert_name(self._layer, e, self._which))


def check_variants(*, moe_combine, kv_norm_eps) -> None:
    """``ValueError`` for an unknown ``moe_combine`` or a non-positive / non-finite ``kv_norm_eps``."""
    if moe_combine not in MOE_COMBINES:
        raise ValueError(f"moe_combine: expected one of {MOE_COMBINES}, got {moe_combine!r}")
    if (not isinstance(kv_norm_eps, numbers.Real) or isinstance(kv_norm_eps, bool)
            or not math.isfinite(kv_norm_eps) or kv_norm_eps <= 0):
        raise ValueError(f"kv_norm_eps: expected a positive finite number, got {kv_norm_eps!r}")


# -- the model ---------------------------------------------------------------------------------------

class Model:
    """Float64 Kimi-Linear over a ``WeightSource`` (see the module docstring)."""

    def __init__(self, source: WeightSource, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6):
        check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps)
        self.source = source
        self.config: KimiConfig = source.config
        self.variants = {"moe_combine": moe_combine, "kv_norm_eps": float(kv_norm_eps)}
        self._w = _Weights(source, WEIGHT_CACHE_BYTES)
        self.trace_kda_core = False  # traces also carry layers.{i}.kda.* (the localization sets it)

    def __repr__(self) -> str:
        return f"reference.Model({self.source.describe()}, variants={self.variants})"

    # -- public API ------------------------------------------------------------------------------
    def forward(self, token_ids, *, trace: dict | None = None, routing: dict | None = None) -> np.ndarray:
        """Logits ``[T, vocab]`` of the whole sequence, recomputed from scratch.

        ``routing`` ``{layer: ids [T, k_e]}``: replay these expert choices in those MoE layers
        instead of the reference's own top-k (the combine weights are still the reference's scores at
        those ids, by the same rule). For judging a run whose router split a near-tie the other way:
        with its choices replayed, what is left between the two is smooth arithmetic error.
        """
        ids = self._check_ids(token_ids)
        return self._run(ids, None, trace, self._check_routing(routing, len(ids)))[0]

    def prefill(self, token_ids, *, trace: dict | None = None) -> tuple[np.ndarray, ModelCache]:
        """``(logits [T, vocab], cache)`` for a fresh sequence."""
        ids = self._check_ids(token_ids)
        return self._run(ids, None, trace)

    def decode(self, token_id, cache: ModelCache, *, trace: dict | None = None) -> tuple[np.ndarray, ModelCache]:
        """``(logits [vocab], new cache)`` for one more token; ``cache`` is left untouched."""
        if np.ndim(token_id) != 0:
            raise ValueError(f"token_id: expected one integer token id, got shape {np.shape(token_id)}")
        ids = self._check_ids(np.reshape(token_id, (1,)), what="token_id")
        self._check_cache(cache)
        logits, new = self._run(ids, cache, trace)
        return logits[0], new

    def empty_cache(self) -> ModelCache:
        """The cache of an empty sequence (zero conv/KDA states, empty MLA caches): decoding from it
        token by token equals a prefill."""
        c = self.config
        layers = []
        for i in range(c.num_hidden_layers):
            if c.is_kda_layer(i):
                C, Wm1 = c.kda_dim, c.short_conv_kernel_size - 1
                z = np.zeros((C, Wm1))
                layers.append(KDACache(z, z, z, np.zeros((c.kda_num_heads, c.kda_head_dim, c.kda_head_dim))))
            else:
                layers.append(MLACache(np.zeros((0, c.kv_lora_rank)), np.zeros((0, c.qk_rope_head_dim))))
        return ModelCache(layers, 0)

    # -- validation ------------------------------------------------------------------------------
    def _check_routing(self, routing, T: int) -> dict:
        c = self.config
        if routing is None:
            return {}
        if not isinstance(routing, dict):
            raise ValueError(f"routing: expected a dict {{layer: ids [T, k_e]}}, got {type(routing).__name__}")
        checked = {}
        for layer, ids in routing.items():
            if not (isinstance(layer, numbers.Integral) and 0 <= layer < c.num_hidden_layers
                    and c.is_moe_layer(int(layer))):
                raise ValueError(f"routing: {layer!r} is not a MoE layer index")
            ids = np.asarray(ids)
            want = (T, c.num_experts_per_token)
            if ids.shape != want or ids.dtype.kind not in "iu":
                raise ValueError(f"routing[{layer}]: expected integer ids of shape {want}, got {ids.dtype} {ids.shape}")
            if ids.size and (ids.min() < 0 or ids.max() >= c.num_experts):
                raise ValueError(f"routing[{layer}]: expert ids must be in [0, {c.num_experts}), got "
                                 f"{ids.min()}..{ids.max()}")
            if any(len(set(row)) != len(row) for row in ids.tolist()):
                raise ValueError(f"routing[{layer}]: a token names the same expert twice")
            checked[int(layer)] = ids.astype(np.int64)
        return checked

    def _check_ids(self, token_ids, what: str = "token_ids") -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"{what}: expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{what}: expected integer token ids, got dtype {ids.dtype}")
        V = self.config.vocab_size
        bad = np.flatnonzero((ids < 0) | (ids >= V))
        if bad.size:
            pos = int(bad[0])
            raise ValueError(f"{what}: token id {int(ids[pos])} at position {pos} is outside the "
                             f"vocabulary [0, {V})")
        return ids.astype(np.int64)

    def _check_cache(self, cache) -> None:
        c = self.config
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache: expected a reference ModelCache, got {type(cache).__name__}")
        if len(cache.layers) != c.num_hidden_layers:
            raise ValueError(f"cache: {len(cache.layers)} layers, the model has {c.num_hidden_layers}")
        for i, lc in enumerate(cache.layers):
            if c.is_kda_layer(i):
                C, Wm1, H, K = c.kda_dim, c.short_conv_kernel_size - 1, c.kda_num_heads, c.kda_head_dim
                ok = (isinstance(lc, KDACache) and lc.conv_q.shape == lc.conv_k.shape == lc.conv_v.shape
                      == (C, Wm1) and lc.state.shape == (H, K, K))
                want = f"KDACache with conv states {(C, Wm1)} and state {(H, K, K)}"
            else:
                S, L, R = cache.length, c.kv_lora_rank, c.qk_rope_head_dim
                ok = isinstance(lc, MLACache) and lc.latent.shape == (S, L) and lc.k_pe.shape == (S, R)
                want = f"MLACache with latent {(S, L)} and k_pe {(S, R)} (length {S})"
            if not ok:
                raise ValueError(f"cache.layers[{i}]: expected a {want}, got {_describe_layer_cache(lc)}")

    # -- the stack -------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, cache: ModelCache | None, trace: dict | None, routing: dict | None = None):
        """Run ``ids`` after ``cache`` (None: a fresh sequence, chunked/naive forms; else the decode
        forms), replaying ``routing`` (checked) where given. Returns (logits [T, vocab], new cache)."""
        c, w = self.config, self._w
        eps = c.rms_norm_eps
        h = self._embed(ids)
        new_layers = []
        for i in range(c.num_hidden_layers):
            p = layer_prefix(i)
            prev = None if cache is None else cache.layers[i]
            x = norm.rms_norm(h, w(p + "input_layernorm.weight"), eps=eps)
            if c.is_kda_layer(i):
                a, lc = self._kda(i, x, prev, trace)
            else:
                a, lc = self._mla(i, x, prev)
            new_layers.append(lc)
            h = h + a
            x = norm.rms_norm(h, w(p + "post_attention_layernorm.weight"), eps=eps)
            f = self._moe(i, x, trace, (routing or {}).get(i)) if c.is_moe_layer(i) else self._dense(i, x)
            h = h + f
            if trace is not None:
                trace[f"layers.{i}.mixer"] = a
                trace[f"layers.{i}.ffn"] = f
                trace[f"layers.{i}.hidden"] = h
        h = norm.rms_norm(h, w("model.norm.weight"), eps=eps)
        if trace is not None:
            trace["final_norm"] = h
        logits = self._lm_head(h)
        length = len(ids) + (0 if cache is None else cache.length)
        return logits, ModelCache(new_layers, length)

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        name = "model.embed_tokens.weight"
        if self._w.small(name):
            return embed.embedding(ids, self._w(name))
        uniq, inverse = np.unique(ids, return_inverse=True)  # read only the rows of these ids
        return embed.embedding(inverse.reshape(-1), self.source.get_rows(name, uniq))

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if self._w.small(name):
            return embed.lm_head(h, self._w(name))
        V = self.config.vocab_size
        blocks = [embed.lm_head(h, self.source.get_rows(name, np.arange(lo, min(V, lo + LM_HEAD_BLOCK_ROWS))))
                  for lo in range(0, V, LM_HEAD_BLOCK_ROWS)]
        return np.concatenate(blocks, axis=-1)

    def _kda(self, i: int, x: np.ndarray, prev: KDACache | None, trace: dict | None = None):
        """KDA layer (b.10) on normed ``x [T, D]``; ``prev`` None = fresh sequence (chunked)."""
        c, w = self.config, self._w
        a = layer_prefix(i) + "self_attn."
        T = x.shape[0]
        H, K = c.kda_num_heads, c.kda_head_dim
        conv_out, conv_states = [], []
        for which in "qkv":
            proj = x @ w(a + f"{which}_proj.weight").T  # [T, H*K]
            cw = w(a + f"{which}_conv1d.weight")[:, 0, :]  # [C, W]
            if prev is None:
                y, st = conv.short_conv(proj[None], cw)
                y = y[0]
            else:
                state = getattr(prev, f"conv_{which}")[None]
                y, st = conv.short_conv_step(proj, cw, state)
            conv_out.append(y.reshape(1, T, H, K))
            conv_states.append(st[0])
        q, k, v = conv_out
        g_raw = ((x @ w(a + "f_a_proj.weight").T) @ w(a + "f_b_proj.weight").T).reshape(1, T, H, K)
        beta_logits = (x @ w(a + "b_proj.weight").T).reshape(1, T, H)
        A_log = w(a + "A_log").reshape(H)
        dt_bias = w(a + "dt_bias")
        if prev is None:
            o, S = kda.fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias)
        else:
            o, S = kda.fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias,
                                       initial_state=prev.state[None])
        gate = ((x @ w(a + "g_a_proj.weight").T) @ w(a + "g_b_proj.weight").T).reshape(T, H, K)
        o = norm.gated_rms_norm(o[0], gate, w(a + "o_norm.weight"), eps=c.rms_norm_eps)
        if trace is not None and self.trace_kda_core:
            _trace_kda(trace, i, (q, k, g_raw, beta_logits, A_log, dt_bias), v, prev, o)
        out = o.reshape(T, H * K) @ w(a + "o_proj.weight").T
        return out, KDACache(*conv_states, S[0])

    def _mla(self, i: int, x: np.ndarray, prev: MLACache | None):
        """MLA layer (b.11/b.12) on normed ``x [T, D]``; naive form for a fresh sequence, absorbed
        form over the cache in decode."""
        c, w = self.config, self._w
        a = layer_prefix(i) + "self_attn."
        T = x.shape[0]
        N, P, R, Vh, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                          c.v_head_dim, c.kv_lora_rank)
        q = (x @ w(a + "q_proj.weight").T).reshape(1, T, N, P + R)
        kv = x @ w(a + "kv_a_proj_with_mqa.weight").T  # [T, L+R]
        latent = norm.rms_norm(kv[:, :L], w(a + "kv_a_layernorm.weight"), eps=self.variants["kv_norm_eps"])
        k_pe = kv[:, L:]
        if prev is not None:
            latent = np.concatenate([prev.latent, latent], axis=0)
            k_pe = np.concatenate([prev.k_pe, k_pe], axis=0)
        attend = mla.naive if prev is None else mla.absorbed
        o = attend(q, latent[None], k_pe[None], w(a + "kv_b_proj.weight"))  # [1, T, N, Vh]
        out = o[0].reshape(T, N * Vh) @ w(a + "o_proj.weight").T
        return out, MLACache(latent, k_pe)

    def _dense(self, i: int, x: np.ndarray) -> np.ndarray:
        m, w = layer_prefix(i) + "mlp.", self._w
        return moe.swiglu(x, w(m + "gate_proj.weight"), w(m + "up_proj.weight"), w(m + "down_proj.weight"))

    def _moe(self, i: int, x: np.ndarray, trace: dict | None, forced: np.ndarray | None = None) -> np.ndarray:
        """Sigmoid-routed MoE (b.13/b.14): router logits ``x @ W.T`` in float64, routed experts
        loaded one by one for the selected ids (``forced``: these instead), plus the shared expert."""
        c, w = self.config, self._w
        m = layer_prefix(i) + "block_sparse_moe."
        logits = x @ w(m + "gate.weight").T  # [T, E]
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
        E = c.num_experts
        y = moe.experts(x, weights, ids, _Experts(w, i, "w1", E), _Experts(w, i, "w2", E),
                        _Experts(w, i, "w3", E))
        if c.num_shared_experts:
            s = m + "shared_experts."
            y = y + moe.swiglu(x, w(s + "gate_proj.weight"), w(s + "up_proj.weight"), w(s + "down_proj.weight"))
        return y


def _trace_kda(trace: dict, i: int, fused_args, v, prev: KDACache | None, normed) -> None:
    """The KDA core's own inputs (after the fused prologue: l2-normalized q, k, the log decay g,
    beta), the state it started from and the gated norm's output: the localization's bound replays
    the recurrence on them."""
    q, k, g, beta = kda._prologue(*fused_args)
    p = f"layers.{i}.kda."
    trace.update({p + "q": q[0], p + "k": k[0], p + "v": v[0], p + "g": g[0], p + "beta": beta[0],
                  p + "normed": normed})
    HV, K, V = g.shape[2], g.shape[3], v.shape[3]
    trace[p + "initial_state"] = np.zeros((HV, K, V)) if prev is None else prev.state


def _describe_layer_cache(lc) -> str:
    if isinstance(lc, KDACache):
        return f"KDACache(conv {lc.conv_q.shape}, state {lc.state.shape})"
    if isinstance(lc, MLACache):
        return f"MLACache(latent {lc.latent.shape}, k_pe {lc.k_pe.shape})"
    return type(lc).__name__


def load(path_or_source, *, moe_combine: str = "unbiased", kv_norm_eps: float = 1e-6) -> Model:
    """The float64 reference model of a checkpoint directory or a ``WeightSource``.

    ``moe_combine``: "unbiased" (vLLM, default) or "biased" (HF remote code); ``kv_norm_eps``: the
    ``kv_a_layernorm`` eps (1e-6 HF, default; 1e-5 vLLM). Raises ``ValueError`` for an unknown
    variant and ``CheckpointError`` for a broken checkpoint."""
    check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps)
    if isinstance(path_or_source, WeightSource):
        source = path_or_source
    elif isinstance(path_or_source, (str, os.PathLike)):
        source = open_source(path_or_source)
    else:
        raise TypeError(f"load: expected a checkpoint path or a WeightSource, got {type(path_or_source).__name__}")
    return Model(source, moe_combine=moe_combine, kv_norm_eps=kv_norm_eps)
