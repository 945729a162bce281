"""Norms in torch at float32 arithmetic (see parity.emulate)."""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def rms_norm(x, weight, *, eps, mutation=None):
    check_mutation("rms_norm", mutation, ("sum_not_mean",))
    xc = x.to(cdt(x.dtype))
    ms = (xc * xc).sum(-1, keepdim=True) if mutation == "sum_not_mean" else (xc * xc).mean(-1, keepdim=True)
    return (xc * torch.rsqrt(ms + eps) * weight.to(xc.dtype)).to(x.dtype)


def gated_rms_norm(x, gate, weight, *, eps, mutation=None):
    check_mutation("gated_rms_norm", mutation, ("silu_gate", "norm_after_gate"))
    xc, gc = x.to(cdt(x.dtype)), gate.to(cdt(x.dtype))
    act = gc * torch.sigmoid(gc) if mutation == "silu_gate" else torch.sigmoid(gc)
    if mutation == "norm_after_gate":
        xc = xc * act
        act = torch.ones_like(act)
    y = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps) * weight.to(xc.dtype) * act
    return y.to(x.dtype)


def l2norm(x, *, eps=1e-6, mutation=None):
    check_mutation("l2norm", mutation, ("no_sqrt", "mean_not_sum"))
    xc = x.to(cdt(x.dtype))
    ss = (xc * xc).mean(-1, keepdim=True) if mutation == "mean_not_sum" else (xc * xc).sum(-1, keepdim=True)
    den = (ss + eps) if mutation == "no_sqrt" else torch.sqrt(ss + eps)
    return (xc / den).to(x.dtype)


def add_rms_norm(x, residual, weight, *, eps, mutation=None):
    """``(rms_norm(h), h)`` with ``h = x + residual`` rounded to x's dtype (as a separate torch add)."""
    check_mutation("add_rms_norm", mutation, ())
    h = (x.to(cdt(x.dtype)) + residual.to(cdt(x.dtype))).to(x.dtype)
    return rms_norm(h, weight, eps=eps), h
