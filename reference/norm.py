"""Normalizations over the last dim (spec b.2-b.4), float64, on any array API executor.

Conventions: ``x [..., D]``; ``weight [D]``; statistics over the last axis only. No intermediate
cast (the bf16 round trips of the torch implementations are the optimized side's business).
"""
from __future__ import annotations

from .elementwise import sigmoid
from .executor import namespace


def _check_weight(fn, x, weight):
    if x.ndim < 1:
        raise ValueError(f"{fn}: x: expected [..., D], got a scalar")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{fn}: weight: expected [D] = ({x.shape[-1]},), got {tuple(weight.shape)}")


def _rms_norm(fn, x, weight, eps):
    xp = namespace(x, weight)
    x = xp.asarray(x, dtype=xp.float64)
    weight = xp.asarray(weight, dtype=xp.float64)
    _check_weight(fn, x, weight)
    inv_rms = xp.reciprocal(xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps))  # 1 / s: one kernel
    return x * inv_rms * weight


def rms_norm(x, weight, *, eps):
    """T5-style RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``.

    x: [..., D]; weight: [D]; eps: required (1e-5 for the residual norms, 1e-6 or 1e-5 for MLA's
    ``kv_a_layernorm``, spec b.2). Returns [..., D] float64.
    """
    return _rms_norm("rms_norm", x, weight, eps)


def gated_rms_norm(x, gate, weight, *, eps):
    """Gated RMSNorm with a sigmoid gate (KDA ``o_norm``, spec b.3):
    ``rms_norm(x, weight, eps=eps) * sigmoid(gate)``.

    x, gate: [..., V] (same shape); weight: [V] (shared by all heads); eps required (1e-5 in
    the model). Returns [..., V] float64.
    """
    xp = namespace(x, gate, weight)
    x = xp.asarray(x, dtype=xp.float64)
    gate = xp.asarray(gate, dtype=xp.float64)
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate: expected the shape of x {tuple(x.shape)}, "
                         f"got {tuple(gate.shape)}")
    return _rms_norm("gated_rms_norm", x, weight, eps) * sigmoid(gate)


def l2norm(x, *, eps=1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (KDA q/k normalization, spec b.4).

    x: [..., K]. The ``+eps`` form is the kernels' (not ``F.normalize``'s max-with-eps), so a zero
    vector maps to zero. Returns [..., K] float64.
    """
    xp = namespace(x)
    x = xp.asarray(x, dtype=xp.float64)
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + eps)


def add_rms_norm(x, residual, weight, *, eps):
    """The residual add and the norm after it (spec b.2): ``h = x + residual``,
    ``y = rms_norm(h, weight, eps=eps)``; returns ``(y, h)``.

    x, residual: [..., D] (same shape); weight: [D]. Returns two [..., D] float64 arrays. (The
    optimized op rounds h to x's dtype before the norm, as a separate add would.)
    """
    xp = namespace(x, residual, weight)
    x = xp.asarray(x, dtype=xp.float64)
    residual = xp.asarray(residual, dtype=xp.float64)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual: expected the shape of x {tuple(x.shape)}, "
                         f"got {tuple(residual.shape)}")
    h = x + residual
    return _rms_norm("add_rms_norm", h, weight, eps), h
