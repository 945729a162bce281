"""Records: elementwise.silu, elementwise.sigmoid, elementwise.softplus."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import bounds
from ..emulate import elementwise as emu
from ..mutants import internal, wrap
from ..registry import Case, OpRecord, register
from ..strategies import bucket, elementwise_values, rng, seeds
from ._util import ROWS, lazy


@st.composite
def cases(draw):
    shape = draw(bucket([(6, 50), (257,), (2, 3, 33)]))
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


DOC = "one ua per operation, exp (2 + |x|) ua, one rounding to the output dtype; relative to |y|"

register(OpRecord(
    name="elementwise.silu", reference=lazy("reference.elementwise:silu"),
    optimized="optimized.elementwise:silu", emulated=emu.silu, inputs=cases, bound=bounds.elementwise.silu,
    outputs=("y",), args=("x",), batch=ROWS, bound_doc="((6 + |x|) ua + uo) |y|  (" + DOC + ")",
    reductions="none",
    mutants=(
        wrap("sigmoid_arg_negated", "x * sigmoid(-x): the sign inside the sigmoid lost", inputs=_neg_in,
             outputs=_neg_out),
        internal("missing_x", "sigmoid(x) without the factor x", emu.silu),
        internal("relu", "ReLU in place of SiLU", emu.silu),
    )))

register(OpRecord(
    name="elementwise.sigmoid", reference=lazy("reference.elementwise:sigmoid"),
    optimized="optimized.elementwise:sigmoid", emulated=emu.sigmoid, inputs=cases,
    bound=bounds.elementwise.sigmoid, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="((5 + |x|) ua + uo) |y|", reductions="none",
    mutants=(
        wrap("arg_negated", "sigmoid(-x) = 1 - sigmoid(x)", inputs=_neg_in),
        wrap("half_slope", "sigmoid(x / 2)", inputs=_half_in),
        internal("tanh", "tanh in place of the logistic function", emu.sigmoid),
    )))

register(OpRecord(
    name="elementwise.softplus", reference=lazy("reference.elementwise:softplus"),
    optimized="optimized.elementwise:softplus", emulated=emu.softplus, inputs=cases,
    bound=bounds.elementwise.softplus, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="ua ((2 + |x|) z/(1+z) + 4 |y|) + uo |y|, z = exp(-|x|)", reductions="none",
    mutants=(
        wrap("arg_negated", "softplus(-x)", inputs=_neg_in),
        internal("relu", "max(x, 0): the log1p(exp(-|x|)) term dropped", emu.softplus),
        internal("beta_two", "softplus with beta = 2", emu.softplus),
    )))
