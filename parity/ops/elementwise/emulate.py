"""Elementwise ops in torch at float32 arithmetic (see parity.emulate)."""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def sigmoid(x, *, mutation=None):
    check_mutation("sigmoid", mutation, ("tanh", "half_slope"))
    xc = x.to(cdt(x.dtype))
    if mutation == "tanh":
        y = torch.tanh(xc)
    elif mutation == "half_slope":
        y = torch.sigmoid(xc / 2)
    else:
        y = torch.sigmoid(xc)
    return y.to(x.dtype)


def silu(x, *, mutation=None):
    check_mutation("silu", mutation, ("missing_x", "relu"))
    xc = x.to(cdt(x.dtype))
    if mutation == "missing_x":
        y = torch.sigmoid(xc)
    elif mutation == "relu":
        y = torch.relu(xc)
    else:
        y = xc * torch.sigmoid(xc)
    return y.to(x.dtype)


def softplus(x, *, threshold=20.0, mutation=None):
    check_mutation("softplus", mutation, ("relu", "beta_two"))
    xc = x.to(cdt(x.dtype))
    if mutation == "relu":
        y = torch.relu(xc)
    elif mutation == "beta_two":
        y = torch.nn.functional.softplus(xc, beta=2.0, threshold=threshold)
    else:
        smooth = torch.clamp(xc, min=0) + torch.log1p(torch.exp(-xc.abs()))
        y = torch.where(xc > threshold, xc, smooth)
    return y.to(x.dtype)
