"""Elementwise functions (spec b.1), float64, any shape, on any array API executor.

Every function is written so that no intermediate overflows for any finite input: ``exp`` is only
ever taken of a non-positive argument.
"""
from __future__ import annotations

from .executor import namespace


def sigmoid(x):
    """``1 / (1 + exp(-x))`` elementwise; float64, shape of ``x``.

    Evaluated as ``1/(1+z)`` for ``x >= 0`` and ``z/(1+z)`` for ``x < 0`` with ``z = exp(-|x|)``,
    so large ``|x|`` neither overflows nor loses relative accuracy (``sigmoid(-700)`` is exact to a
    few ulp, not rounded to 0 via ``1 - 1``).
    """
    xp = namespace(x)
    x = xp.asarray(x, dtype=xp.float64)
    z = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0, z) / (1.0 + z)  # one division for both branches: 7 kernels, not 9


def silu(x):
    """``x * sigmoid(x)`` elementwise; float64, shape of ``x``."""
    xp = namespace(x)
    x = xp.asarray(x, dtype=xp.float64)
    return x * sigmoid(x)


def softplus(x, *, threshold=20.0):
    """``log(1 + exp(x))`` for ``x <= threshold``, else ``x`` (torch's rule, beta 1); float64.

    The threshold is kept for faithfulness to the torch/Triton gate kernels (spec b.1); it changes
    float64 results by < 2e-9 at ``x = 20``. Below it the value is computed as
    ``max(x, 0) + log1p(exp(-|x|))``, which equals ``log1p(exp(x))`` and never overflows, so
    ``threshold=inf`` gives the exact softplus everywhere.
    """
    xp = namespace(x)
    x = xp.asarray(x, dtype=xp.float64)
    # max(x, 0) as a clip: torch's maximum takes the 0 as a host tensor, a wait on the device
    smooth = xp.clip(x, min=0.0) + xp.log1p(xp.exp(-xp.abs(x)))
    return xp.where(x > threshold, x, smooth)
