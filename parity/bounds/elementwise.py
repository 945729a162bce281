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


def add_rms_norm(x, kw, ref, p):
    # h = x + residual: one add in ua, one rounding to the run dtype: |dh_i| <= u_h |h_i|. That moves
    # each h_i by at most u_h relatively and the rms by at most u_h (eps >= 0 only damps it), so the
    # exact norm of the rounded h is within 2 u_h / (1 - u_h) of y, and at most (1 + u_h) / (1 - u_h)
    # as large; the kernel's norm of it errs by rms_norm's relative bound c.
    D = x["x"].shape[-1]
    uh = p.ua + p.uo("h")
    c = _rms_rel(D, p) + 2 * p.ua + p.u + p.uo("y")
    return {"y": (c * (1 + uh) + 2 * uh) / (1 - uh) * np.abs(ref["y"]), "h": uh * np.abs(ref["h"])}


def gated_rms_norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    rel = _rms_rel(D, p) + 3 * p.ua + p.ua * (exp_rel(x["gate"]) + 3.0)
    return {"y": (rel + p.uo("y")) * np.abs(y)}


def l2norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    return {"y": (_rms_rel(D, p) + p.ua + p.uo("y")) * np.abs(y)}
