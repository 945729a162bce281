"""Elementwise ops (spec b.1): ``silu``, ``sigmoid``, ``softplus`` as Triton kernels.

Any shape; output has the input's shape and dtype; math in float32 (float64 for fp64 inputs), one
rounding to the output dtype at the end. The device functions in :mod:`.kernels` are what the other
families fuse (gated norm, conv, router, SwiGLU).
"""
from __future__ import annotations

import torch
import triton

from .. import _counters
from .._checks import check_float
from ._precision import tl_compute_dtype
from .kernels import _unary_kernel


__all__ = ["silu", "sigmoid", "softplus"]

_BLOCK = 1024


def _unary(op: str, code: int, x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    check_float(op, "x", x)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _unary_kernel[(triton.cdiv(n, _BLOCK),)](
            xc, y, n, float(threshold), OP=code, CD=tl_compute_dtype(x.dtype), BLOCK=_BLOCK,
            num_warps=4)
    return y


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``; x: any shape, float dtype. Returns x's shape and dtype."""
    _counters.record("elementwise.silu")
    return _unary("elementwise.silu", 0, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` (overflow-free form); x: any shape. Returns x's shape and dtype."""
    _counters.record("elementwise.sigmoid")
    return _unary("elementwise.sigmoid", 1, x)


def softplus(x: torch.Tensor, *, threshold: float = 20.0) -> torch.Tensor:
    """``log(1 + exp(x))`` for ``x <= threshold``, else ``x`` (torch's rule, beta 1).

    x: any shape. Returns x's shape and dtype. Computed as ``max(x,0) + log1p(exp(-|x|))``, so it
    keeps relative accuracy for very negative ``x`` (where ``log(1 + exp(x))`` would round to 0).
    """
    _counters.record("elementwise.softplus")
    return _unary("elementwise.softplus", 2, x, threshold)
