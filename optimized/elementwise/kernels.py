"""Triton device functions for the elementwise ops (spec b.1), reused by the other families.

All take and return the compute dtype (float32, or float64 for fp64 runs). Formulations keep relative
accuracy everywhere: ``exp`` is only taken of non-positive arguments, so nothing overflows, and
``sigmoid(-x)`` for large ``x`` is ``z / (1 + z)`` rather than ``1 - sigmoid(x)``.
"""
from __future__ import annotations

import triton.language as tl

from .._jit import jit


@jit
def sigmoid_f(x):
    """``1 / (1 + exp(-x))`` with ``z = exp(-|x|)``: ``1/(1+z)`` for x >= 0, ``z/(1+z)`` otherwise."""
    z = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + z)
    return tl.where(x >= 0, r, z * r)


@jit
def silu_f(x):
    """``x * sigmoid(x)``."""
    return x * sigmoid_f(x)


@jit
def log1p_f(z):
    """``log(1 + z)`` accurate for small ``z >= 0`` (Kahan's trick: ``log(w) * z / (w - 1)``, w = 1 + z;
    ``w - 1`` is exact, so the quotient corrects the rounding of ``w``). Portable: no libdevice."""
    w = 1.0 + z
    d = w - 1.0
    return tl.where(d == 0.0, z, tl.log(w) * (z / tl.where(d == 0.0, 1.0, d)))


@jit
def softplus_f(x, threshold):
    """``x`` where ``x > threshold`` else ``max(x, 0) + log1p(exp(-|x|))`` (= ``log(1 + exp(x))``)."""
    smooth = tl.maximum(x, 0.0) + log1p_f(tl.exp(-tl.abs(x)))
    return tl.where(x > threshold, x, smooth)


@jit
def _unary_kernel(x_ptr, y_ptr, n, threshold: tl.float64,
                  OP: tl.constexpr, CD: tl.constexpr, BLOCK: tl.constexpr):
    # OP: 0 silu, 1 sigmoid, 2 softplus. One program per BLOCK contiguous elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(CD)
    if OP == 0:
        y = silu_f(x)
    elif OP == 1:
        y = sigmoid_f(x)
    else:
        y = softplus_f(x, threshold)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
