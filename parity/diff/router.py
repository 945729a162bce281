"""The MoE router replayed on an engine's own input: which experts it should have picked, how much
rounding may move its scores, and whether a different choice is noise or a bug.

The router picks the top-``k_e`` experts by selection score ``sel = s + bias``, ``s =
sigmoid(logit)``, ``logit = x @ W_r.T`` computed in fp32 (spec b.13) from ``x``, the normed stream
the engine handed its MoE. The replay (``replay.py``) recovers that stream from the engine's trace
and runs the float64 router on it, so nothing upstream of the router enters its bound: an earlier
benign flip, or an earlier bug, changes ``x`` for both.

The noise bound is derived from the arithmetic, per token and expert (never measured on the engine
under test, which would widen its own bound):

* ``x`` as the engine held it differs from the float64 one by ``dx_d <= |x_d| (u + 2 e_mid)``: its
  own storage rounding at the run's ``u``, and the rounding ``e_mid`` (relative) of the stream
  ``mid`` it was normed from (the engine's sum of the stream and the mixer's output, recovered from
  the trace), which reaches ``x`` through ``mid_d`` and through the norm's scale;
* ``|d logit_e| <= sum_d |W_ed| dx_d + gamma_D(ua) sum_d |x_d W_ed|`` (fp32 accumulation);
* ``|d s_e| <= slope_e |d logit_e|`` with ``slope_e = min(1/4, s_e (1 - s_e) exp|d logit_e|)`` (the
  sigmoid's largest slope over the interval), plus a few fp32 ulps of the sigmoid and the sum:
  ``eps_e = slope_e |d logit_e| + ua (4 |s_e| + |sel_e|)``.

A *router flip* (expert ``out`` in the reference's top-k only, ``in`` in the engine's only) is within
noise when the reference's margin ``sel[out] - sel[in] <= eps_out + eps_in`` (a group-score margin
with grouped routing, against twice that). A flip past it is the router's bug. The engine's traced
scores are held to ``eps`` too (plus their own storage rounding), and its traced selection to
``scores + bias``: a bias dropped, or held in a coarser dtype than the fp32 checkpoint tensor (vLLM
pull 50761), is past that however few tokens it flips.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parity.bounds.core import UNIT_ROUNDOFF
from parity.metrics import dtype_of, to_numpy


@dataclass
class RouterFlip:
    layer: int
    position: int           # index of the token in the sequence (prompt positions included)
    swapped_in: list[int]   # experts only the engine chose
    swapped_out: list[int]  # experts only the reference chose (on the engine's input)
    margin: float           # the reference's selection-score margin of the flip
    bound: float            # its noise bound (derived, module docstring)
    within_noise: bool
    grouped: bool = False   # the margin is a group-score margin

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        pairs = ",".join(map(str, self.swapped_out)) + "->" + ",".join(map(str, self.swapped_in))
        rel = "<=" if self.within_noise else ">"
        return (f"layers.{self.layer} pos {self.position} experts {pairs}, "
                f"margin {self.margin:.3g} {rel} bound {self.bound:.3g}")


@dataclass
class RouterJudgement:
    """One call's router of one layer, replayed: per position the worst units of its checks (flip
    margins, scores, selection; 1 = at the bound) and the flips."""
    units: np.ndarray          # [T]
    flips: list[RouterFlip]
    what: list[str]            # [T]: which check gave the worst units ("flip", "scores", "selection")
    rows: list[int]            # the row of each flip


def gamma(n: int, ua: float) -> float:
    return n * ua / (1.0 - n * ua)


def score_noise(x, W, *, u: float, e_mid, ua: float, absW=None, calls: list[slice] | None = None):
    """``(s [T, E], eps [T, E], logit [T, E])``: the float64 router logits and sigmoid scores on
    ``x [T, D]`` (the normed stream) and the scores' noise bound (module docstring). ``u``: the
    run's storage roundoff (the engine's rounding of ``x``); ``e_mid``: the relative rounding of the
    stream ``x`` was normed from, one for every row or one a row ``[T]``. ``absW``: ``|W|`` when the
    caller keeps it (None: taken here). ``calls``: row ranges that are separate calls, each taken as
    its own product (so each call's rows have the bits of its own replay; None: one call)."""
    D = x.shape[-1]
    absW = np.abs(W) if absW is None else absW
    calls = [slice(0, x.shape[0])] if calls is None else calls
    ax = np.abs(x)
    spread = np.concatenate([ax[c] @ absW.T for c in calls])
    e_mid = np.asarray(e_mid, dtype=np.float64)
    e_mid = e_mid[:, None] if e_mid.ndim else e_mid
    dlogit = (u + 2.0 * e_mid) * spread + gamma(D, ua) * spread
    logit = np.concatenate([x[c] @ W.T for c in calls])
    s = 1.0 / (1.0 + np.exp(-logit))
    with np.errstate(over="ignore"):
        slope = np.minimum(0.25, s * (1.0 - s) * np.exp(np.minimum(dlogit, 700.0)))
    return s, slope * dlogit + ua * 4.0 * np.abs(s), logit


def _group_scores(sel: np.ndarray, groups: int) -> np.ndarray:
    """[E] -> [groups]: the sum of the top-2 selection scores of each group (top-1 for 1-wide groups)."""
    g = sel.reshape(groups, -1)
    top = np.sort(g, axis=1)[:, ::-1][:, : min(2, g.shape[1])]
    return top.sum(axis=1)


def judge_router(layer: int, positions, *, s, eps, bias, ref_ids, opt_ids, opt_scores=None,
                 opt_sel=None, ua: float, num_groups: int = 1, topk_groups: int = 1) -> RouterJudgement:
    """Judge one layer's router over ``T`` tokens: ``positions`` the sequence position of the
    first (the others follow it) or of each ``[T]`` (rows of several sequences); ``s``, ``eps``
    ``[T, E]`` from ``score_noise``, ``bias [E]`` the checkpoint's correction bias (float64),
    ``ref_ids`` the float64 router's top-k on the engine's input, ``opt_ids`` the engine's ``[T,
    k_e]``, ``opt_scores`` / ``opt_sel`` its traced scores and selection (any dtype; None: not
    checked)."""
    T, E = s.shape
    positions = np.asarray(positions, dtype=np.int64)
    positions = positions + np.arange(T) if positions.ndim == 0 else positions
    sel = s + bias
    eps_sel = eps + ua * np.abs(sel)
    ref_ids = to_numpy(ref_ids).astype(np.int64).reshape(T, -1)
    opt_ids = to_numpy(opt_ids).astype(np.int64).reshape(T, -1)
    units = np.zeros(T)
    what = ["flip"] * T
    if opt_scores is not None:
        so = to_numpy(opt_scores).astype(np.float64).reshape(T, E)
        u_s = UNIT_ROUNDOFF[dtype_of(opt_scores) or "float64"]
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.abs(so - s) / (eps + u_s * np.abs(so))
        r = np.where(np.isfinite(r), r, np.inf).max(axis=-1)
        what = ["scores" if r[t] > units[t] else what[t] for t in range(T)]
        units = np.maximum(units, r)
        if opt_sel is not None:
            sl = to_numpy(opt_sel).astype(np.float64).reshape(T, E)
            u_sel = UNIT_ROUNDOFF[dtype_of(opt_sel) or "float64"]
            # the bias the engine applied: sel - s, against the checkpoint's (fp32) values
            with np.errstate(invalid="ignore", divide="ignore"):
                rb = np.abs((sl - so) - bias) / (u_sel * np.abs(sl) + u_s * np.abs(so)
                                                  + ua * (np.abs(sl) + np.abs(so)) + 1e-300)
            rb = np.where(np.isfinite(rb), rb, np.inf).max(axis=-1)
            what = ["selection" if rb[t] > units[t] else what[t] for t in range(T)]
            units = np.maximum(units, rb)
    flips, rows = [], []
    for t in range(T):
        r, o = set(ref_ids[t].tolist()), set(opt_ids[t].tolist())
        if r == o:
            continue
        out = sorted(r - o, key=lambda e: sel[t, e])              # weakest chosen first
        inn = sorted(o - r, key=lambda e: -sel[t, e])             # strongest passed-over first
        kept = None
        if num_groups > 1:
            gs = _group_scores(sel[t], num_groups)
            kept = set(np.argsort(-gs, kind="stable")[:topk_groups].tolist())
        worst = None
        for e_out, e_in in zip(out, inn):
            noise = eps_sel[t, e_out] + eps_sel[t, e_in]
            g_in = e_in // (E // num_groups)
            if kept is not None and g_in not in kept:
                # the reference dropped e_in's whole group: the flip needed a group flip
                weakest = min(kept, key=lambda g: gs[g])
                cand = (gs[weakest] - gs[g_in], 2 * noise, True)
            else:
                cand = (sel[t, e_out] - sel[t, e_in], noise, False)
            if worst is None or cand[0] / max(cand[1], 1e-300) > worst[0] / max(worst[1], 1e-300):
                worst = cand
        margin, bound, grouped = worst
        flip = RouterFlip(layer=layer, position=int(positions[t]), swapped_in=sorted(inn),
                          swapped_out=sorted(out), margin=float(margin), bound=float(bound),
                          within_noise=bool(margin <= bound), grouped=grouped)
        flips.append(flip)
        rows.append(t)
        ratio = margin / bound if bound > 0 else np.inf
        if ratio > units[t]:
            units[t], what[t] = ratio, "flip"
    return RouterJudgement(units=units, flips=flips, what=what, rows=rows)
