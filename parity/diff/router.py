"""Router decisions that differ between the two paths, and whether noise explains them.

The MoE router picks the top-``k_e`` experts by selection score (``sigmoid(logit) + bias``). Where
two experts' selection scores are closer than the optimized path's noise, bf16 rounding can swap
them: a *router flip*. A flip changes the layer's FFN output by a whole expert, so it can move the
logits far more than the noise that caused it; the diff must tell such a flip (benign, a near-tie
one level down) from a router that is wrong.

Per flipped pair (expert ``out`` chosen by the reference only, ``in`` by the optimized path only):

* ``margin`` = the reference's preference for ``out``: ``sel_ref[out] - sel_ref[in]`` (>= 0). With
  grouped routing, when ``in``'s group was not kept by the reference, the flip needed a group flip
  and the margin is the group-score gap instead (group score = sum of the group's top-2 scores).
* ``bound`` = the noise the pair can see: twice the largest deviation of the selection-score error
  ``sel_opt - sel_ref`` from its median over the *other* experts of the same token (a common shift
  reorders nothing, hence the median; the flipped experts are left out, because a flip always has a
  margin below its own two errors and measuring them would excuse any flip), plus the rounding of the
  two scores at the compute dtype, ``u * (|sel_out| + |sel_in|)``. Doubled again for group margins
  (a group score sums two selection scores).

``within_noise`` is ``margin <= bound``. Several swapped pairs are reported with the largest margin
(every pair had to flip).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .numerics import to_f64


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


def _group_scores(sel: np.ndarray, groups: int) -> np.ndarray:
    """[E] -> [groups]: the sum of the top-2 selection scores of each group (top-1 for 1-wide groups)."""
    g = sel.reshape(groups, -1)
    top = np.sort(g, axis=1)[:, ::-1][:, : min(2, g.shape[1])]
    return top.sum(axis=1)


def _noise_spread(delta: np.ndarray, exclude: set[int]) -> float:
    med = np.median(delta)
    others = [e for e in range(delta.shape[0]) if e not in exclude]
    pool = delta[others] if len(others) >= 2 else delta
    return float(np.max(np.abs(pool - med)))


def router_flips(layer: int, first_position: int, ref_sel, opt_sel, ref_ids, opt_ids, *,
                 num_groups: int = 1, topk_groups: int = 1, unit_roundoff: float) -> list[RouterFlip]:
    """Compare one layer's router decisions over ``T`` tokens. ``*_sel``: ``[T, E]`` selection
    scores, ``*_ids``: ``[T, k_e]`` chosen experts (reference float64 / optimized any dtype);
    ``first_position``: sequence index of row 0. Returns the flips, one per token that differs."""
    ref_sel, opt_sel = to_f64(ref_sel), to_f64(opt_sel)
    E = ref_sel.shape[-1]
    ref_sel, opt_sel = ref_sel.reshape(-1, E), opt_sel.reshape(-1, E)
    ref_ids = to_f64(ref_ids).astype(np.int64).reshape(ref_sel.shape[0], -1)
    opt_ids = to_f64(opt_ids).astype(np.int64).reshape(opt_sel.shape[0], -1)
    flips = []
    for t in range(ref_ids.shape[0]):
        r, o = set(ref_ids[t].tolist()), set(opt_ids[t].tolist())
        if r == o:
            continue
        out = sorted(r - o, key=lambda e: ref_sel[t, e])              # weakest chosen first
        inn = sorted(o - r, key=lambda e: -ref_sel[t, e])             # strongest passed-over first
        delta = opt_sel[t] - ref_sel[t]
        spread = _noise_spread(delta, set(out) | set(inn))
        kept = None
        if num_groups > 1:
            gs = _group_scores(ref_sel[t], num_groups)
            kept = set(np.argsort(-gs, kind="stable")[:topk_groups].tolist())
        worst_margin, worst_bound, grouped = -np.inf, 0.0, False
        for e_out, e_in in zip(out, inn):
            rounding = unit_roundoff * (abs(ref_sel[t, e_out]) + abs(ref_sel[t, e_in]))
            g_in = e_in // (E // num_groups)
            if kept is not None and g_in not in kept:
                # the reference dropped e_in's whole group: the flip needed a group flip
                weakest = min(kept, key=lambda g: gs[g])
                margin, bound, is_group = gs[weakest] - gs[g_in], 2 * (2 * spread + rounding), True
            else:
                margin, bound, is_group = ref_sel[t, e_out] - ref_sel[t, e_in], 2 * spread + rounding, False
            if margin - bound > worst_margin - worst_bound:
                worst_margin, worst_bound, grouped = margin, bound, is_group
        flips.append(RouterFlip(layer=layer, position=first_position + t, swapped_in=sorted(inn),
                                swapped_out=sorted(out), margin=float(worst_margin),
                                bound=float(worst_bound), within_noise=bool(worst_margin <= worst_bound),
                                grouped=grouped))
    return flips


def trace_router_flips(ref_trace: dict, opt_trace: dict, config, first_position: int, *,
                       unit_roundoff: float) -> list[RouterFlip]:
    """Every router flip of one forward/prefill/decode call, from both paths' trace dicts."""
    flips = []
    for i in range(config.num_hidden_layers):
        key = f"layers.{i}.router"
        if f"{key}.ids" not in ref_trace or f"{key}.ids" not in opt_trace:
            continue
        flips += router_flips(i, first_position, ref_trace[f"{key}.selection"], opt_trace[f"{key}.selection"],
                              ref_trace[f"{key}.ids"], opt_trace[f"{key}.ids"],
                              num_groups=config.num_expert_group, topk_groups=config.topk_group,
                              unit_roundoff=unit_roundoff)
    return flips
