"""Bounds of the norms (docs/error-bounds.md, section 2).

Each op reads its inputs once (exact: the reference sees the same rounded values), computes in
``ua`` and rounds once to the output dtype; the D-long sum of squares is the one reduction.
"""
from __future__ import annotations

import numpy as np

from parity.bounds.core import exp_rel, gamma


def rms_rel(D, p):
    """Relative error of ``1 / rms`` over ``D`` values (the fused l2norm of the KDA ops too): the sum of
    D squares (gamma_D, all terms positive so relative), /D, +eps, sqrt (halves it), 1/."""
    return gamma(D, p.ua) / 2 + 4 * p.ua


def rms_norm(x, kw, ref, p):
    # y = (x * r) * w; HF rounds x*r to the run dtype before the weight: one storage rounding u.
    D = x["x"].shape[-1]
    y = ref["y"]
    return {"y": (rms_rel(D, p) + 2 * p.ua + p.u + p.uo("y")) * np.abs(y)}


def add_rms_norm(x, kw, ref, p):
    # h = x + residual: one add in ua, one rounding to the run dtype: |dh_i| <= u_h |h_i|. That moves
    # each h_i by at most u_h relatively and the rms by at most u_h (eps >= 0 only damps it), so the
    # exact norm of the rounded h is within 2 u_h / (1 - u_h) of y, and at most (1 + u_h) / (1 - u_h)
    # as large; the kernel's norm of it errs by rms_norm's relative bound c.
    D = x["x"].shape[-1]
    uh = p.ua + p.uo("h")
    c = rms_rel(D, p) + 2 * p.ua + p.u + p.uo("y")
    return {"y": (c * (1 + uh) + 2 * uh) / (1 - uh) * np.abs(ref["y"]), "h": uh * np.abs(ref["h"])}


def gated_rms_norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    rel = rms_rel(D, p) + 3 * p.ua + p.ua * (exp_rel(x["gate"]) + 3.0)
    return {"y": (rel + p.uo("y")) * np.abs(y)}


def l2norm(x, kw, ref, p):
    D = x["x"].shape[-1]
    y = ref["y"]
    return {"y": (rms_rel(D, p) + p.ua + p.uo("y")) * np.abs(y)}
