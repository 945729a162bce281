"""Bounds of the elementwise ops (docs/error-bounds.md, section 1).

Each op reads its inputs once (exact: the reference sees the same rounded values), computes in
``ua`` and rounds once to the output dtype. An exp costs (2 + |arg|) ua relatively (the argument is
scaled by log2 e before ex2), a divide, add or multiply one ua each.
"""
from __future__ import annotations

import numpy as np

from parity.bounds.core import exp_rel


def sigmoid(x, kw, ref, p):
    # z = exp(-|x|) -> 1/(1+z) or z/(1+z): exp, add, divide (and a multiply for x < 0)
    y = ref["y"]
    return {"y": (p.ua * (exp_rel(x["x"]) + 3.0) + p.uo("y")) * np.abs(y)}


def silu(x, kw, ref, p):
    y = ref["y"]
    return {"y": (p.ua * (exp_rel(x["x"]) + 4.0) + p.uo("y")) * np.abs(y)}


def softplus(x, kw, ref, p):
    # max(x,0) + log1p(exp(-|x|)): the exp's relative error enters log1p damped by z/(1+z) <= 1,
    # log1p and the add cost a few ua of |y| (a relative-accuracy form is assumed: log(1+exp(x))
    # loses every digit below x ~ -17 in fp32 and is rejected by this model on purpose).
    xx = x["x"]
    y = ref["y"]
    z = np.exp(-np.abs(xx))
    return {"y": p.ua * (exp_rel(xx) * z / (1.0 + z) + 4.0 * np.abs(y)) + p.uo("y") * np.abs(y)}
