"""Records: elementwise.silu, elementwise.sigmoid, elementwise.softplus."""
from __future__ import annotations

from hypothesis import strategies as st

from reference import elementwise as ref

from ..bounds import elementwise as bounds
from ..emulate import elementwise as emu
from ..mutants import internal, wrap
from ..registry import Case, OpRecord, Ref
from ..strategies import bucket, elementwise_values, rng, seeds, wide_rows
from ._util import ROWS


@st.composite
def cases(draw):
    shape = draw(bucket([(2, 3, 33), (257,), (6, 50)]))
    r = rng(draw(seeds()))
    return Case({"x": elementwise_values(r, shape)}, label=f"x{list(shape)}")


@st.composite
def wide_cases(draw, space="full"):
    """Any row count and width (parity search)."""
    shape = draw(wide_rows(space))
    r = rng(draw(seeds()))
    return Case({"x": elementwise_values(r, shape)}, label=f"x{list(shape)}")


def _neg_in(d):
    d["x"] = -d["x"]
    return d


def _neg_out(out, inp):
    out["y"] = -out["y"]
    return out


def _half_in(d):
    d["x"] = d["x"] / 2
    return d


def _threshold_zero(kw):
    kw["threshold"] = 0.0
    return kw


DOC = "one ua per operation, exp (2 + |x|) ua, one rounding to the output dtype; relative to |y|"


SILU = OpRecord(
    name="elementwise.silu", reference=ref.silu, optimized=Ref("optimized.elementwise", "silu"),
    emulated=emu.silu, inputs=cases, wide=wide_cases,
    bound=bounds.silu,
    outputs=("y",), args=("x",), batch=ROWS, bound_doc="((6 + |x|) ua + uo) |y|  (" + DOC + ")",
    reductions="none",
    mutants=(
        wrap("sigmoid_arg_negated", "x * sigmoid(-x): the sign inside the sigmoid lost", inputs=_neg_in,
             outputs=_neg_out),
        internal("missing_x", "sigmoid(x) without the factor x", emu.silu),
        internal("relu", "ReLU in place of SiLU", emu.silu),
    ))

SIGMOID = OpRecord(
    name="elementwise.sigmoid", reference=ref.sigmoid, optimized=Ref("optimized.elementwise", "sigmoid"),
    emulated=emu.sigmoid, inputs=cases, wide=wide_cases,
    bound=bounds.sigmoid, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="((5 + |x|) ua + uo) |y|", reductions="none",
    mutants=(
        wrap("arg_negated", "sigmoid(-x) = 1 - sigmoid(x)", inputs=_neg_in),
        wrap("half_slope", "sigmoid(x / 2)", inputs=_half_in),
        internal("tanh", "tanh in place of the logistic function", emu.sigmoid),
    ))

SOFTPLUS = OpRecord(
    name="elementwise.softplus", reference=ref.softplus, optimized=Ref("optimized.elementwise", "softplus"),
    emulated=emu.softplus, inputs=cases, wide=wide_cases,
    bound=bounds.softplus, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="ua ((2 + |x|) z/(1+z) + 4 |y|) + uo |y|, z = exp(-|x|)", reductions="none",
    mutants=(
        wrap("arg_negated", "softplus(-x)", inputs=_neg_in),
        internal("relu", "max(x, 0): the log1p(exp(-|x|)) term dropped", emu.softplus),
        internal("beta_two", "softplus with beta = 2", emu.softplus),
        wrap("threshold_zero", "threshold 0 instead of 20: x returned for every x > 0", kwargs=_threshold_zero),
    ))


def records() -> list[OpRecord]:
    return [SILU, SIGMOID, SOFTPLUS]
