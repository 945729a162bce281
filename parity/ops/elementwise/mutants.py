"""Named semantic bugs of the elementwise ops, per op: the wrap mutants' transformations of the
real candidate's inputs, keyword arguments and outputs, and the internal ones evaluated by the
emulation (parity/mutants.py)."""
from __future__ import annotations

from parity.mutants import internal, wrap

from . import emulate


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


SILU = (
    wrap("sigmoid_arg_negated", "x * sigmoid(-x): the sign inside the sigmoid lost", inputs=_neg_in,
         outputs=_neg_out),
    internal("missing_x", "sigmoid(x) without the factor x", emulate.silu),
    internal("relu", "ReLU in place of SiLU", emulate.silu),
)

SIGMOID = (
    wrap("arg_negated", "sigmoid(-x) = 1 - sigmoid(x)", inputs=_neg_in),
    wrap("half_slope", "sigmoid(x / 2)", inputs=_half_in),
    internal("tanh", "tanh in place of the logistic function", emulate.sigmoid),
)

SOFTPLUS = (
    wrap("arg_negated", "softplus(-x)", inputs=_neg_in),
    internal("relu", "max(x, 0): the log1p(exp(-|x|)) term dropped", emulate.softplus),
    internal("beta_two", "softplus with beta = 2", emulate.softplus),
    wrap("threshold_zero", "threshold 0 instead of 20: x returned for every x > 0", kwargs=_threshold_zero),
)
