"""Records: norm.rms_norm, norm.gated_rms_norm, norm.l2norm."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import bounds
from ..emulate import norm as emu
from ..mutants import internal, wrap
from ..registry import Case, OpRecord, register
from ..strategies import bucket, mixed_magnitudes, normal, rng, seeds
from ._util import ROWS, lazy

SHAPES = [(5, 3, 100), (7, 64), (2, 2, 3, 32)]


@st.composite
def rms_cases(draw, gated=False):
    shape = draw(bucket(SHAPES))
    eps = draw(bucket([1e-5, 1e-6]))
    r = rng(draw(seeds()))
    D = shape[-1]
    arrays = {"x": mixed_magnitudes(r, shape)}
    if gated:
        arrays["gate"] = normal(r, shape, 2.0)
    arrays["weight"] = 1.0 + 0.3 * normal(r, (D,))
    return Case(arrays, {"eps": eps}, label=f"x{list(shape)} eps={eps:g}")


@st.composite
def l2_cases(draw):
    shape = draw(bucket([(3, 5, 2, 16), (6, 4, 100), (2, 3, 3, 64)]))
    r = rng(draw(seeds()))
    return Case({"x": mixed_magnitudes(r, shape)}, label=f"x{list(shape)}")


def _w_plus_one(d):
    d["weight"] = d["weight"] + 1
    return d


def _no_eps(kw):
    kw["eps"] = 0.0
    return kw


REL = "rms of D squares: gamma_D(ua)/2 + 4 ua"

register(OpRecord(
    name="norm.rms_norm", reference=lazy("reference.norm:rms_norm"), optimized="optimized.norm:rms_norm",
    emulated=emu.rms_norm, inputs=rms_cases, bound=bounds.elementwise.rms_norm, outputs=("y",),
    args=("x", "weight"), batch=ROWS, reductions="D",
    bound_doc="(gamma_D(ua)/2 + 6 ua + u + uo) |y|  (u: HF rounds x/rms to the run dtype before the weight)",
    mutants=(
        wrap("weight_plus_one", "(1 + w) weight convention (Gemma) applied to a plain weight", inputs=_w_plus_one),
        internal("sum_not_mean", "sum of squares instead of their mean", emu.rms_norm),
        wrap("eps_dropped", "eps left out of the rms (visible in the small rows)", kwargs=_no_eps),
    )))

register(OpRecord(
    name="norm.gated_rms_norm", reference=lazy("reference.norm:gated_rms_norm"),
    optimized="optimized.norm:gated_rms_norm", emulated=emu.gated_rms_norm,
    inputs=lambda: rms_cases(gated=True), bound=bounds.elementwise.gated_rms_norm, outputs=("y",),
    args=("x", "gate", "weight"), reductions="V",
    batch={"inputs": {"x": 0, "gate": 0}, "outputs": {"y": 0}},
    bound_doc="(gamma_V(ua)/2 + 7 ua + (5 + |gate|) ua + uo) |y|",
    mutants=(
        internal("silu_gate", "SiLU gate instead of sigmoid (an early transformers port)", emu.gated_rms_norm),
        internal("norm_after_gate", "normalizes x * sigmoid(gate) instead of gating the normalized x",
                 emu.gated_rms_norm),
        wrap("weight_plus_one", "(1 + w) weight convention", inputs=_w_plus_one),
    )))


def _swap_last(d):
    d["x"] = d["x"].transpose(-1, -2).contiguous()
    return d


def _swap_back(out, inp):
    out["y"] = out["y"].transpose(-1, -2).contiguous()
    return out


register(OpRecord(
    name="norm.l2norm", reference=lazy("reference.norm:l2norm"), optimized="optimized.norm:l2norm",
    emulated=emu.l2norm, inputs=l2_cases, bound=bounds.elementwise.l2norm, outputs=("y",), args=("x",),
    batch=ROWS, reductions="K", bound_doc="(gamma_K(ua)/2 + 5 ua + uo) |y|",
    mutants=(
        internal("no_sqrt", "divides by sum(x^2) + eps, not its square root", emu.l2norm),
        internal("mean_not_sum", "normalizes by the rms (mean of squares) instead of the 2-norm", emu.l2norm),
        wrap("wrong_axis", "normalizes over the second-to-last axis", inputs=_swap_last, outputs=_swap_back),
    )))
