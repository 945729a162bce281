"""Replay: the float64 reference recomputes every layer from the engine's own input to that layer.

Each call of the engine (a prefill, or one decode step) comes with its trace (``parity.engines.
trace``): per layer ``i`` the mixer and FFN outputs and the stream after the layer. From it the
replay recovers what the engine handed each op:

* ``layers.i.mixer`` reads the stream before the layer: the engine's ``layers.{i-1}.hidden`` rows
  (layer 0: the embedding of the call's tokens, exact in any dtype), at this and every earlier
  position; the replay carries its own KDA/MLA cache, built from the engine's inputs, from call to
  call;
* ``layers.i.router`` and ``layers.i.ffn`` read ``mid``, that stream plus the engine's mixer
  output (as the engine added them, one rounding to its storage dtype at most); the replayed router is judged by ``router.judge_router``, and the replayed FFN runs the experts the
  engine chose (its router is judged on its own), so a benign router flip never fails an FFN.

Per op and position the replay's error is ``e[p] = ||engine - replay|| / max(||replay[p]||,
median_q ||replay[q]||)`` and its bound ``amp[p] * (A * e_in[p] + fresh)``: ``e_in`` only the
rounding between what the trace holds and what the engine held (a trace stored coarser than the
run's dtype: that dtype's ``u``; for the FFN also the engine's rounding of ``mid``: ``u``), never an
error propagated from upstream. ``fresh``, ``A`` and the KDA read-out amplification ``amp`` are those of
``localize.py``. So a wrong op is past its bound whatever happened before it, and a benign flip
upstream loosens nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from parity.bounds.core import UNIT_ROUNDOFF
from parity.metrics import dtype_of, to_numpy
from parity.ops.kda.bounds import readout_condition
from reference import moe, norm
from reference.tensors import layer_prefix

from .router import RouterFlip, judge_router, score_noise


def _rows(x) -> np.ndarray:
    x = to_numpy(x)
    return x.astype(np.float64).reshape(-1, x.shape[-1])


def _lossy(x, u: float) -> float:
    """The relative rounding a trace entry's storage adds to what the engine held: its dtype's unit
    roundoff when coarser than the run's storage ``u`` (an engine that holds its stream at the run
    dtype traces it exactly), else 0."""
    ut = UNIT_ROUNDOFF.get(dtype_of(x) or "float64", UNIT_ROUNDOFF["float64"])
    return ut if ut > u else 0.0


@dataclass
class OpError:
    """One replayed op over one call's positions."""
    name: str              # "layers.2.mixer", "layers.2.router", "layers.2.ffn"
    layer: int
    op: str                # kda | mla | router | mlp | moe
    err: np.ndarray        # [T] relative error (router: units of its derived bound)
    err_in: np.ndarray     # [T] relative storage error of the input (router: 0)
    amp: np.ndarray        # [T] the op's own amplification (KDA read-out; 1 elsewhere)


@dataclass
class ReplayCall:
    ops: list[OpError]
    flips: list[RouterFlip] = field(default_factory=list)


class Replay:
    """Replays one sequence's calls on the float64 ``model`` (a ``reference.Model``). ``u``: the
    unit roundoff of the engine's storage dtype, ``ua`` of its arithmetic (``Precision``)."""

    def __init__(self, model, config, *, u: float, ua: float):
        self.model, self.config, self.u, self.ua = model, config, u, ua
        self.caches = [None] * config.num_hidden_layers
        self.position = 0

    def add(self, ids, trace: dict) -> ReplayCall:
        """Replay one call over ``ids`` (the tokens it consumed) from the engine's ``trace``."""
        core, self.model.trace_kda_core = self.model.trace_kda_core, True  # the read-out's amplification
        try:
            return self._add(ids, trace)
        finally:
            self.model.trace_kda_core = core

    def _add(self, ids, trace: dict) -> ReplayCall:
        c, m, ex = self.config, self.model, self.model.executor
        on = lambda a: ex.asarray(np.ascontiguousarray(a))  # noqa: E731
        T = len(ids)
        out = ReplayCall(ops=[])
        h_e = m.embed(np.asarray(ids, dtype=np.int64))  # exact in any dtype: the stored table's rows
        h_in, lossy = h_e, 0.0
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            a_e, f_e = _rows(trace[p + "mixer"]), _rows(trace[p + "ffn"])
            rt: dict = {}
            a_r, self.caches[i] = m.mixer(i, h_in, self.caches[i], trace=rt)
            kind = "kda" if c.is_kda_layer(i) else "mla"
            amp = readout_amplification(rt, i) if kind == "kda" else np.ones(T)
            out.ops.append(OpError(p + "mixer", i, kind, _rel(a_e, to_numpy(a_r)), np.full(T, lossy), amp))
            # the FFN's input: the stream before the layer plus the mixer's output, as the engine
            # added them (one rounding to its storage dtype at most)
            mid = to_numpy(h_in).reshape(a_e.shape) + a_e
            e_mid = self.u + max(lossy, _lossy(trace[p + "mixer"], self.u))
            routing = None
            if c.is_moe_layer(i):
                routing = to_numpy(trace[p + "router.ids"]).astype(np.int64).reshape(T, -1)
                judged = self._router(i, mid, e_mid, trace, routing)
                out.ops.append(OpError(p + "router", i, "router", judged.units, np.zeros(T), np.ones(T)))
                out.flips += judged.flips
                routing = ex.ints(routing)
            f_r = m.ffn(i, on(mid), routing=routing)
            out.ops.append(OpError(p + "ffn", i, "moe" if c.is_moe_layer(i) else "mlp",
                                   _rel(f_e, to_numpy(f_r)), np.full(T, e_mid), np.ones(T)))
            h_in, lossy = on(_rows(trace[p + "hidden"])), _lossy(trace[p + "hidden"], self.u)
        self.position += T
        return out

    def _router(self, i, mid, e_mid, trace, opt_ids):
        c, m = self.config, self.model
        p = layer_prefix(i)
        b = p + "block_sparse_moe.gate."
        W = to_numpy(m.weight(b + "weight"))
        bias = to_numpy(m.weight(b + "e_score_correction_bias")).reshape(-1)
        x = norm.rms_norm(mid, to_numpy(m.weight(p + "post_attention_layernorm.weight")), eps=c.rms_norm_eps)
        s, eps = score_noise(x, W, u=self.u, e_mid=e_mid, ua=self.ua)
        _, ref_ids = moe.router(x @ W.T, bias, top_k=c.num_experts_per_token, num_groups=c.num_expert_group,
                                topk_groups=c.topk_group, renormalize=c.moe_renormalize,
                                scaling=c.routed_scaling_factor)
        t = f"layers.{i}.router."
        return judge_router(i, self.position, s=s, eps=eps, bias=bias, ref_ids=ref_ids, opt_ids=opt_ids,
                            opt_scores=trace.get(t + "scores"), opt_sel=trace.get(t + "selection"),
                            ua=self.ua, num_groups=c.num_expert_group, topk_groups=c.topk_group)


def _rel(engine: np.ndarray, replay: np.ndarray) -> np.ndarray:
    """``||engine - replay|| / max(||replay[p]||, median ||replay||)`` per row (NaN/Inf: inf)."""
    replay = replay.reshape(engine.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.linalg.norm(engine - replay, axis=-1)
        n = np.linalg.norm(replay, axis=-1)
        floor = np.median(n)
        e = d / np.maximum(n, floor if floor > 0 else 1.0)
    return np.where(np.isfinite(e), e, np.inf)


KDA_CORE = ("q", "k", "v", "g", "beta", "initial_state", "normed")


def readout_amplification(ref_trace: dict, i: int) -> np.ndarray:
    """``[T]``: how much KDA layer ``i``'s read-out amplifies, at each position, the relative error
    its operands carry, seen at the mixer's output (docs/error-bounds.md, "Model level"): with
    ``kappa_h`` the read-out's condition number of value head ``h``
    (``parity.ops.kda.bounds.readout_condition``) and ``y_h`` the head's gated-norm output,
    ``sqrt(sum_h |y_h|^2 max(1, kappa_h)^2 / sum_h |y_h|^2)``. The gated RMSNorm is scale invariant:
    it hands on the relative error of each head's read-out, whatever that head's magnitude, so a
    read-out that cancels (``kappa >> 1``) reaches the output at full weight."""
    p = f"layers.{i}.kda."
    missing = [n for n in KDA_CORE if p + n not in ref_trace]
    if missing:
        raise ValueError(f"the reference trace has no {p}{missing[0]}: the localization's bound needs the "
                         "KDA core's values (load the reference with trace_kda_core = True)")
    q, k, v, g, beta, s0, y = (to_numpy(ref_trace[p + n]).astype(np.float64) for n in KDA_CORE)
    kappa, _ = readout_condition(q, k, v, g, beta, s0)
    ny2 = np.sum(y * y, axis=-1)                                   # [T, HV]
    total = np.sum(ny2, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        amp = np.sqrt(np.sum(ny2 * np.maximum(1.0, kappa) ** 2, axis=-1) / total)
    return np.where(total > 0, amp, 1.0)
