"""Router decisions that differ between the two paths, and whether noise explains them.

The MoE router picks the top-``k_e`` experts by selection score ``sel = s + bias``, ``s =
sigmoid(logit)``. Where two experts' selection scores are closer than the optimized path's noise,
rounding can swap them: a *router flip*. A flip changes the layer's FFN output by a whole expert, so
it can move the logits far more than the noise that caused it; the diff must tell such a flip
(benign, a near-tie one level down) from a router that is wrong.

Per flipped pair (expert ``out`` chosen by the reference only, ``in`` by the optimized path only):

* ``margin`` = the reference's preference for ``out``: ``sel_ref[out] - sel_ref[in]`` (>= 0). With
  grouped routing, when ``in``'s group was not kept by the reference, the flip needed a group flip
  and the margin is the group-score gap instead (group score = sum of the group's top-2 scores).
* ``bound`` = the noise the pair can see. The noise lives in the router logits (``x @ W_r.T`` of a
  bf16 hidden state) and reaches a selection score through the sigmoid's slope ``s (1 - s)``. The
  logit errors ``d = logit(s_opt) - logit(s_ref)`` scatter by ``sigma``, the larger of two
  estimates: the RMS of ``d`` over the token's *other* experts (the flipped two are left out: a
  flip always has a margin below its own two errors, so measuring them would excuse any flip), and
  the RMS of ``d`` over every expert and position of that layer so far in the run, flipped pairs
  left out again (six or so other experts of one token are too few to see the tails). Then

      bound = LAMBDA * sigma * sqrt(slope_in^2 + slope_out^2) + u_sel * (|sel_out| + |sel_in|)

  with ``LAMBDA = 4`` (``parity.bounds.core``: a benign pair exceeds it with probability ~1e-4)
  and ``u_sel`` the unit roundoff of the dtype the selection scores came back in (fp32 routers:
  negligible). Doubled for group margins (a group score sums two selection scores). Without traced
  scores the same is done on the selection scores themselves (slope 1, ``sqrt 2``).

``within_noise`` is ``margin <= bound``. Several swapped pairs are reported with the largest margin
over bound (every pair had to flip). Measured on benign bf16 runs (bundled fixture, tiny seeds 2, 5,
11, 12; 60 positions): margins reach at most 0.56 of their bound.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parity.bounds.core import LAMBDA, UNIT_ROUNDOFF
from parity.metrics import dtype_of, to_numpy


@dataclass
class RouterFlip:
    layer: int
    position: int           # index of the token in the sequence (prompt positions included)
    swapped_in: list[int]   # experts only the optimized path chose
    swapped_out: list[int]  # experts only the reference chose
    margin: float           # the reference's selection-score margin of the flip
    bound: float            # its noise bound
    within_noise: bool
    grouped: bool = False   # the margin is a group-score margin

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        pairs = ",".join(map(str, self.swapped_out)) + "->" + ",".join(map(str, self.swapped_in))
        rel = "<=" if self.within_noise else ">"
        return (f"layers.{self.layer} pos {self.position} experts {pairs}, "
                f"margin {self.margin:.3g} {rel} bound {self.bound:.3g}")


class NoiseHistory:
    """Running sum of squared router-logit errors per layer, over the calls of one run."""

    def __init__(self):
        self.sum_sq: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def add(self, layer: int, d: np.ndarray) -> float:
        """Fold in ``d`` (any shape) and return the layer's RMS so far."""
        self.sum_sq[layer] = self.sum_sq.get(layer, 0.0) + float(np.sum(d * d))
        self.count[layer] = self.count.get(layer, 0) + d.size
        return float(np.sqrt(self.sum_sq[layer] / max(self.count[layer], 1)))


def _group_scores(sel: np.ndarray, groups: int) -> np.ndarray:
    """[E] -> [groups]: the sum of the top-2 selection scores of each group (top-1 for 1-wide groups)."""
    g = sel.reshape(groups, -1)
    top = np.sort(g, axis=1)[:, ::-1][:, : min(2, g.shape[1])]
    return top.sum(axis=1)


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0 - 1e-16)
    return np.log(p) - np.log1p(-p)


def router_flips(layer: int, first_position: int, ref_sel, opt_sel, ref_ids, opt_ids, *,
                 ref_scores=None, opt_scores=None, num_groups: int = 1, topk_groups: int = 1,
                 history: NoiseHistory | None = None) -> list[RouterFlip]:
    """Compare one layer's router decisions over ``T`` tokens. ``*_sel``: ``[T, E]`` selection
    scores, ``*_scores``: ``[T, E]`` sigmoid scores (optional, see the module docstring), ``*_ids``:
    ``[T, k_e]`` chosen experts; reference float64, optimized any dtype. ``first_position``:
    sequence index of row 0; ``history``: the run's running noise per layer (updated here)."""
    u_sel = UNIT_ROUNDOFF[dtype_of(opt_sel) or "float64"]
    ref_sel, opt_sel = to_numpy(ref_sel), to_numpy(opt_sel)
    E = ref_sel.shape[-1]
    ref_sel, opt_sel = ref_sel.reshape(-1, E), opt_sel.reshape(-1, E)
    T = ref_sel.shape[0]
    ref_ids = to_numpy(ref_ids).astype(np.int64).reshape(T, -1)
    opt_ids = to_numpy(opt_ids).astype(np.int64).reshape(T, -1)
    if ref_scores is not None and opt_scores is not None:
        s_ref = to_numpy(ref_scores).reshape(T, E)
        d = _logit(to_numpy(opt_scores).reshape(T, E)) - _logit(s_ref)
        slope, pair = s_ref * (1.0 - s_ref), None
    else:  # no scores traced: the selection-score errors themselves, slope 1
        d, slope, pair = opt_sel - ref_sel, None, np.sqrt(2.0)
    flipped = np.zeros((T, E), dtype=bool)  # the experts of flipped pairs: never their own noise
    for t in range(T):
        flipped[t, list(set(ref_ids[t].tolist()) ^ set(opt_ids[t].tolist()))] = True
    d = np.where(np.isfinite(d), d, np.inf)
    layer_rms = (history or NoiseHistory()).add(layer, d[~flipped & np.isfinite(d)])
    flips = []
    for t in range(T):
        r, o = set(ref_ids[t].tolist()), set(opt_ids[t].tolist())
        if r == o:
            continue
        out = sorted(r - o, key=lambda e: ref_sel[t, e])              # weakest chosen first
        inn = sorted(o - r, key=lambda e: -ref_sel[t, e])             # strongest passed-over first
        pool = d[t, ~flipped[t]]
        sigma = max(float(np.sqrt(np.mean(pool * pool))), layer_rms)
        kept = None
        if num_groups > 1:
            gs = _group_scores(ref_sel[t], num_groups)
            kept = set(np.argsort(-gs, kind="stable")[:topk_groups].tolist())
        worst = None
        for e_out, e_in in zip(out, inn):
            noise = LAMBDA * sigma * (pair if slope is None else np.hypot(slope[t, e_in], slope[t, e_out]))
            rounding = u_sel * (abs(ref_sel[t, e_out]) + abs(ref_sel[t, e_in]))
            g_in = e_in // (E // num_groups)
            if kept is not None and g_in not in kept:
                # the reference dropped e_in's whole group: the flip needed a group flip
                weakest = min(kept, key=lambda g: gs[g])
                cand = (gs[weakest] - gs[g_in], 2 * (noise + rounding), True)
            else:
                cand = (ref_sel[t, e_out] - ref_sel[t, e_in], noise + rounding, False)
            if worst is None or cand[0] - cand[1] > worst[0] - worst[1]:
                worst = cand
        margin, bound, grouped = worst
        flips.append(RouterFlip(layer=layer, position=first_position + t, swapped_in=sorted(inn),
                                swapped_out=sorted(out), margin=float(margin), bound=float(bound),
                                within_noise=bool(margin <= bound), grouped=grouped))
    return flips


def trace_router_flips(ref_trace: dict, opt_trace: dict, config, first_position: int, *,
                       history: NoiseHistory | None = None) -> list[RouterFlip]:
    """Every router flip of one forward/prefill/decode call, from both paths' trace dicts."""
    flips = []
    for i in range(config.num_hidden_layers):
        key = f"layers.{i}.router"
        if f"{key}.ids" not in ref_trace or f"{key}.ids" not in opt_trace:
            continue
        flips += router_flips(i, first_position, ref_trace[f"{key}.selection"], opt_trace[f"{key}.selection"],
                              ref_trace[f"{key}.ids"], opt_trace[f"{key}.ids"],
                              ref_scores=ref_trace.get(f"{key}.scores"), opt_scores=opt_trace.get(f"{key}.scores"),
                              num_groups=config.num_expert_group, topk_groups=config.topk_group,
                              history=history)
    return flips
