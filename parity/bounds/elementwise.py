"""Bounds of the elementwise ops and the norms (docs/error-bounds.md, sections 1-2).

Each op reads its inputs once (exact: the reference sees the same rounded values), computes in
``ua`` and rounds once to the output dtype. An exp costs (2 + |arg|) ua relatively (the argument is
scaled by log2 e before ex2), a divide, add or multiply one ua each.
"""
from __future__ import annotations

import numpy as np

from .core import exp_rel, gamma


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


def _rms_rel(D, p):
    # sum of D squares (gamma_D, all terms positive so relative), /D, +eps, sqrt (halves it), 1/.
    return gamma(D, p.ua) / 2 + 4 * p.ua


def rms_norm(x, kw, ref, p):
    # y = (x * r) * w; HF rounds x*r to the run dtype before the weight: one storage rounding u.
    D = x["x"].shape[-1]
    y = ref["y"]
    return {"y": (_rms_rel(D, p) + 2 * p.ua + p.u + p.uo("y")) * np.abs(y)}


def gated_rms_norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    rel = _rms_rel(D, p) + 3 * p.ua + p.ua * (exp_rel(x["gate"]) + 3.0)
    return {"y": (rel + p.uo("y")) * np.abs(y)}


def l2norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    return {"y": (_rms_rel(D, p) + p.ua + p.uo("y")) * np.abs(y)}
