"""Elementwise ops in torch at float32 arithmetic (see parity.emulate)."""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def _evaluate(op: str, x, mutation, forms: dict):
    """``forms[mutation]`` of ``x`` in the arithmetic dtype (``forms[None]``: the op itself), rounded
    back to x's dtype."""
    check_mutation(op, mutation, tuple(m for m in forms if m is not None))
    return forms[mutation](x.to(cdt(x.dtype))).to(x.dtype)


def sigmoid(x, *, mutation=None):
    return _evaluate("sigmoid", x, mutation, {None: torch.sigmoid, "tanh": torch.tanh,
                                              "half_slope": lambda xc: torch.sigmoid(xc / 2)})


def silu(x, *, mutation=None):
    return _evaluate("silu", x, mutation, {None: lambda xc: xc * torch.sigmoid(xc), "missing_x": torch.sigmoid,
                                           "relu": torch.relu})


def softplus(x, *, threshold=20.0, mutation=None):
    def smooth(xc):
        return torch.where(xc > threshold, xc, torch.clamp(xc, min=0) + torch.log1p(torch.exp(-xc.abs())))

    return _evaluate("softplus", x, mutation, {
        None: smooth, "relu": torch.relu,
        "beta_two": lambda xc: torch.nn.functional.softplus(xc, beta=2.0, threshold=threshold)})
