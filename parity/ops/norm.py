"""Records: norm.rms_norm, norm.add_rms_norm, norm.gated_rms_norm, norm.l2norm."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference import norm as ref

from ..bounds import elementwise as bounds
from ..emulate import norm as emu
from ..mutants import internal, wrap
from ..registry import Case, Mutant, OpRecord, Ref
from ..strategies import bucket, mixed_magnitudes, normal, rng, seeds, wide_rows
from ._util import ROWS

SHAPES = [(2, 2, 3, 32), (7, 64), (5, 3, 100)]


def rms_case(shape, eps, seed, *, gated=False) -> Case:
    """An input of the rms norms: rows over four decades of magnitude (x), a gate, a weight near 1.
    Kernel tests call it with the shapes that reach their launch paths (D past one tile)."""
    r = rng(seed)
    D = shape[-1]
    arrays = {"x": mixed_magnitudes(r, shape)}
    if gated:
        arrays["gate"] = normal(r, shape, 2.0)
    arrays["weight"] = 1.0 + 0.3 * normal(r, (D,))
    return Case(arrays, {"eps": eps}, label=f"x{list(shape)} eps={eps:g}")


def add_case(shape, eps, seed) -> Case:
    """x (a branch output, four decades of row magnitude) and the residual stream it is added to."""
    r = rng(seed)
    D = shape[-1]
    arrays = {"x": mixed_magnitudes(r, shape), "residual": normal(r, shape, 3.0),
              "weight": 1.0 + 0.3 * normal(r, (D,))}
    return Case(arrays, {"eps": eps}, label=f"x{list(shape)} eps={eps:g}")


@st.composite
def rms_cases(draw, gated=False):
    shape = draw(bucket(SHAPES))
    eps = draw(bucket([1e-5, 1e-6]))
    return rms_case(shape, eps, draw(seeds()), gated=gated)


@st.composite
def add_cases(draw):
    shape = draw(bucket(SHAPES))
    eps = draw(bucket([1e-5, 1e-6]))
    return add_case(shape, eps, draw(seeds()))


@st.composite
def wide_norm_cases(draw, space="full", kind="rms"):
    """Any row count and width (parity search); ``kind``: rms, gated or add."""
    shape, eps = draw(wide_rows(space)), draw(bucket([1e-5, 1e-6]))
    seed = draw(seeds())
    return add_case(shape, eps, seed) if kind == "add" else rms_case(shape, eps, seed, gated=kind == "gated")


@st.composite
def wide_l2_cases(draw, space="full"):
    shape = draw(wide_rows(space, dims=(1, 7, 16, 60, 64, 100, 128)))
    r = rng(draw(seeds()))
    return Case({"x": mixed_magnitudes(r, shape)}, label=f"x{list(shape)}")


@st.composite
def l2_cases(draw):
    shape = draw(bucket([(3, 5, 2, 16), (2, 3, 3, 64), (6, 4, 100)]))
    r = rng(draw(seeds()))
    return Case({"x": mixed_magnitudes(r, shape)}, label=f"x{list(shape)}")


def _w_plus_one(d):
    d["weight"] = d["weight"] + 1
    return d


def _no_eps(kw):
    kw["eps"] = 0.0
    return kw


def _eps_tenth(kw):
    kw["eps"] = kw["eps"] / 10
    return kw


def _gate_open(d):
    d["gate"] = torch.full_like(d["gate"], 30.0)   # sigmoid(30) rounds to 1 in float32
    return d


def _no_residual(d):
    d["residual"] = torch.zeros_like(d["residual"])
    return d


def _h_not_written(out, inp):
    out["h"] = inp["residual"].clone()
    return out


class _NormOfBranch:
    """Wrap mutant: h is right, but y normalizes the branch output x instead of the sum."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            out = dict(cand(inp, kw))
            out["y"] = cand(dict(inp, residual=torch.zeros_like(inp["residual"])), kw)["y"]
            return out

        return mutated


RMS_DOC = "(gamma_D(ua)/2 + 6 ua + u + uo) |y|  (u: HF rounds x/rms to the run dtype before the weight)"

RMS_NORM = OpRecord(
    name="norm.rms_norm", reference=ref.rms_norm, optimized=Ref("optimized.norm", "rms_norm"),
    emulated=emu.rms_norm, inputs=rms_cases, wide=lambda space: wide_norm_cases(space), bound=bounds.rms_norm,
    outputs=("y",),
    args=("x", "weight"), batch=ROWS, reductions="D", bound_doc=RMS_DOC,
    mutants=(
        wrap("weight_plus_one", "(1 + w) weight convention (Gemma) applied to a plain weight", inputs=_w_plus_one),
        internal("sum_not_mean", "sum of squares instead of their mean", emu.rms_norm),
        wrap("eps_dropped", "eps left out of the rms (visible in the small rows)", kwargs=_no_eps),
        wrap("eps_one_tenth", "eps / 10 (kv_a_layernorm's 1e-6 where 1e-5 is asked)", kwargs=_eps_tenth),
    ))

ADD_RMS_NORM = OpRecord(
    name="norm.add_rms_norm", reference=ref.add_rms_norm, optimized=Ref("optimized.norm", "add_rms_norm"),
    emulated=emu.add_rms_norm, inputs=add_cases, wide=lambda space: wide_norm_cases(space, "add"),
    bound=bounds.add_rms_norm, outputs=("y", "h"),
    args=("x", "residual", "weight"), reductions="D",
    batch={"inputs": {"x": 0, "residual": 0}, "outputs": {"y": 0, "h": 0}},
    bound_doc="h: u_h |h|, u_h = ua + uo (one add, one rounding); y: (c (1 + u_h) + 2 u_h) / (1 - u_h) |y|, "
              "c = rms_norm's relative bound",
    mutants=(
        wrap("residual_dropped", "the residual not added (the norm of the branch output alone)",
             inputs=_no_residual),
        wrap("h_not_written", "the sum never stored: the residual stream comes back unchanged",
             outputs=_h_not_written),
        wrap("weight_plus_one", "(1 + w) weight convention", inputs=_w_plus_one),
        Mutant("norm_of_branch", "y normalizes the branch output x, not the sum h", "wrap", _NormOfBranch()),
    ))

GATED_RMS_NORM = OpRecord(
    name="norm.gated_rms_norm", reference=ref.gated_rms_norm, optimized=Ref("optimized.norm", "gated_rms_norm"),
    emulated=emu.gated_rms_norm, inputs=lambda: rms_cases(gated=True),
    wide=lambda space: wide_norm_cases(space, "gated"), bound=bounds.gated_rms_norm,
    outputs=("y",), args=("x", "gate", "weight"), reductions="V",
    batch={"inputs": {"x": 0, "gate": 0}, "outputs": {"y": 0}},
    bound_doc="(gamma_V(ua)/2 + 7 ua + (5 + |gate|) ua + uo) |y|",
    mutants=(
        internal("silu_gate", "SiLU gate instead of sigmoid (an early transformers port)", emu.gated_rms_norm),
        internal("norm_after_gate", "normalizes x * sigmoid(gate) instead of gating the normalized x",
                 emu.gated_rms_norm),
        wrap("weight_plus_one", "(1 + w) weight convention", inputs=_w_plus_one),
        wrap("gate_dropped", "the sigmoid gate left out (a plain rms_norm)", inputs=_gate_open),
    ))


def _swap_last(d):
    d["x"] = d["x"].transpose(-1, -2).contiguous()
    return d


def _swap_back(out, inp):
    out["y"] = out["y"].transpose(-1, -2).contiguous()
    return out


L2NORM = OpRecord(
    name="norm.l2norm", reference=ref.l2norm, optimized=Ref("optimized.norm", "l2norm"),
    emulated=emu.l2norm, inputs=l2_cases, wide=wide_l2_cases, bound=bounds.l2norm, outputs=("y",), args=("x",),
    batch=ROWS, reductions="K", bound_doc="(gamma_K(ua)/2 + 5 ua + uo) |y|",
    mutants=(
        internal("no_sqrt", "divides by sum(x^2) + eps, not its square root", emu.l2norm),
        internal("mean_not_sum", "normalizes by the rms (mean of squares) instead of the 2-norm", emu.l2norm),
        wrap("wrong_axis", "normalizes over the second-to-last axis", inputs=_swap_last, outputs=_swap_back),
    ))


def records() -> list[OpRecord]:
    return [RMS_NORM, ADD_RMS_NORM, GATED_RMS_NORM, L2NORM]
