"""Normalizations over the last dim (spec b.2-b.4) as Triton kernels.

``rms_norm``, ``gated_rms_norm``, ``l2norm`` and ``add_rms_norm`` share one row kernel (:mod:`.kernels`). Statistics and
the products are computed in float32 (float64 for fp64 inputs) and rounded once to the input dtype.
Note HF's ``KimiRMSNorm`` rounds the normalized ``x`` to bf16 *before* multiplying by the bf16 weight
(two roundings); rounding once is closer to the float64 reference and within the same bound.
"""
from __future__ import annotations

import torch
import triton

from .. import _counters, _pdl
from .._checks import check_float, check_same_device, check_shape
from ..elementwise._precision import tl_compute_dtype
from .kernels import _row_norm_kernel


__all__ = ["rms_norm", "gated_rms_norm", "l2norm", "add_rms_norm"]

_MAX_SINGLE_TILE = 8192  # longest row kept in registers in one tile
_TILE_ELEMS = 4096  # rows per program = _TILE_ELEMS // BLOCK_D (at least 1)


def _rows(op: str, name: str, t: torch.Tensor, D: int) -> torch.Tensor:
    """``t [..., D]`` as a 2-D ``[rows, D]`` view (copying only if the last dim is strided)."""
    t2 = t.reshape(-1, D)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _launch(op: str, x: torch.Tensor, *, weight=None, gate=None, residual=None, eps: float,
            mean: bool):
    """y (and, with ``residual``, ``(y, h)``: h = x + residual in x's dtype, y its norm)."""
    check_float(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x: expected [..., D], got a scalar")
    D = x.shape[-1]
    if weight is not None:
        check_float(op, "weight", weight)
        check_shape(op, "weight", weight, (D,), "[D]")
        weight = weight.contiguous()
    if gate is not None:
        check_float(op, "gate", gate)
        check_shape(op, "gate", gate, tuple(x.shape), "the shape of x")
    if residual is not None:
        check_float(op, "residual", residual)
        check_shape(op, "residual", residual, tuple(x.shape), "the shape of x")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual: dtype {residual.dtype} differs from x's {x.dtype}")
    check_same_device(op, x=x, weight=weight, gate=gate, residual=residual)
    x2 = _rows(op, "x", x, D)
    g2 = _rows(op, "gate", gate, D) if gate is not None else x2
    r2 = _rows(op, "residual", residual, D) if residual is not None else x2
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, D)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    h2 = h.view(-1, D)
    n_rows = x2.shape[0]
    if n_rows == 0 or D == 0:
        return y if residual is None else (y, h)
    single = triton.next_power_of_2(D) <= _MAX_SINGLE_TILE
    block_d = triton.next_power_of_2(D) if single else 4096
    # rows per program fixed by D alone (never by n_rows): the reduction tree of a row, and so its
    # bytes, must not depend on how many rows come with it (batch invariance)
    rows = max(1, min(64, _TILE_ELEMS // block_d))
    pdl = _pdl.enabled(x.device)
    _row_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, r2, h2, g2, weight if weight is not None else x2, y2, n_rows, D,
        x2.stride(0), r2.stride(0), h2.stride(0), g2.stride(0), y2.stride(0), float(eps),
        MEAN=mean, HAS_W=weight is not None, HAS_GATE=gate is not None,
        HAS_RES=residual is not None, CD=tl_compute_dtype(x.dtype), ROWS=rows, BLOCK_D=block_d,
        SINGLE=single, PDL=pdl, launch_pdl=pdl, num_warps=4 if block_d <= 1024 else 8)
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """T5-style RMSNorm ``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    x: [..., D] (bf16, fp16, fp32 or fp64); weight: [D] (any float dtype, read in the compute dtype).
    Returns [..., D] in x's dtype. eps: required (1e-5 residual norms; 1e-6 or 1e-5 kv_a_layernorm).
    """
    _counters.record("norm.rms_norm")
    return _launch("norm.rms_norm", x, weight=weight, eps=eps, mean=True)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: ``h = x + residual`` (rounded to x's
    dtype, as torch adds them), ``y = rms_norm(h, weight, eps=eps)``. Returns ``(y, h)``, both
    [..., D] in x's dtype, bitwise those of ``h = x + residual; rms_norm(h, ...)``.

    x, residual: [..., D], same shape and dtype; weight: [D].
    """
    _counters.record("norm.add_rms_norm")
    return _launch("norm.add_rms_norm", x, weight=weight, residual=residual, eps=eps, mean=True)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Gated RMSNorm (KDA ``o_norm``): ``x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate)``.

    x, gate: [..., V] (same shape; per head, statistics over the last dim); weight: [V] shared by all
    heads. Returns [..., V] in x's dtype; all math in fp32 (fp64 for fp64 inputs).
    """
    _counters.record("norm.gated_rms_norm")
    return _launch("norm.gated_rms_norm", x, weight=weight, gate=gate, eps=eps, mean=True)


def l2norm(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (KDA q/k normalization); x: [..., K].

    Returns [..., K] in x's dtype (a zero vector maps to zero).
    """
    _counters.record("norm.l2norm")
    return _launch("norm.l2norm", x, eps=eps, mean=False)
