"""Row normalization kernel shared by ``rms_norm``, ``gated_rms_norm``, ``l2norm`` and
``add_rms_norm`` (the residual add fused in front: ``h = x + r`` rounded to the dtype and stored,
then normalized, the bits of a torch add followed by ``rms_norm``).

One program normalizes ``ROWS`` rows. When a row fits one ``BLOCK_D`` tile (every norm of the model:
D = 2304, 512, 128) it is loaded once and kept in registers; longer rows take two passes over
``BLOCK_D`` slices (sum of squares, then scale). The sum of squares is a ``tl.sum`` tree within a
tile and a sequential sum across tiles: fixed order, so results are run-to-run bitwise identical.
"""
from __future__ import annotations

import triton.language as tl

from .._jit import jit
from .._pdl import pdl_wait
from ..elementwise.kernels import sigmoid_f


@jit
def _finish_tile(x, rstd, g_ptr, w_ptr, y_ptr, rows64, cols, m, D, stride_g, stride_y,
                 HAS_W: tl.constexpr, HAS_GATE: tl.constexpr, CD: tl.constexpr):
    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(CD)
        y = y * w[None, :]
    if HAS_GATE:
        g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(CD)
        y = y * sigmoid_f(g)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@jit
def _load_tile(x_ptr, r_ptr, h_ptr, rows64, cols, m, stride_x, stride_r, stride_h,
               HAS_RES: tl.constexpr, STORE_H: tl.constexpr, CD: tl.constexpr):
    """A ``[ROWS, BLOCK_D]`` tile of x in CD; with HAS_RES, of ``h = x + r`` rounded to h's dtype
    first (as torch adds two tensors: in fp32, one rounding), stored when STORE_H."""
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=m, other=0.0)
        x = (x.to(CD) + r.to(CD)).to(h_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], x, mask=m)
    return x.to(CD)


@jit
def _row_norm_kernel(x_ptr, r_ptr, h_ptr, g_ptr, w_ptr, y_ptr, n_rows, D, stride_x, stride_r, stride_h,
                     stride_g, stride_y, eps: tl.float64, MEAN: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, CD: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE: tl.constexpr,
                     PDL: tl.constexpr = False):
    # y = x * rsqrt(sum(x^2) [/ D] + eps) [* w] [* sigmoid(g)], statistics in CD (fp32 or fp64);
    # with HAS_RES, x is h = x + r (stored to h_ptr).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols0 = tl.arange(0, BLOCK_D)
    eps_c = tl.full([ROWS], eps, CD)
    pdl_wait(PDL)
    if SINGLE:
        m = rmask[:, None] & (cols0[None, :] < D)
        x = _load_tile(x_ptr, r_ptr, h_ptr, rows64, cols0, m, stride_x, stride_r, stride_h,
                       HAS_RES, True, CD)
        ss = tl.sum(x * x, axis=1)
    else:
        ss = tl.zeros([ROWS], CD)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + cols0
            m = rmask[:, None] & (cols[None, :] < D)
            xt = _load_tile(x_ptr, r_ptr, h_ptr, rows64, cols, m, stride_x, stride_r, stride_h,
                            HAS_RES, True, CD)
            ss += tl.sum(xt * xt, axis=1)
    if MEAN:
        ss = ss / D
    rstd = 1.0 / tl.sqrt(ss + eps_c)
    if SINGLE:
        _finish_tile(x, rstd, g_ptr, w_ptr, y_ptr, rows64, cols0, m, D, stride_g, stride_y,
                     HAS_W, HAS_GATE, CD)
    else:
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + cols0
            m = rmask[:, None] & (cols[None, :] < D)
            # h recomputed, not re-read: the same bits, and no ordering against the first pass's stores
            xt = _load_tile(x_ptr, r_ptr, h_ptr, rows64, cols, m, stride_x, stride_r, stride_h,
                            HAS_RES, False, CD)
            _finish_tile(xt, rstd, g_ptr, w_ptr, y_ptr, rows64, cols, m, D, stride_g, stride_y,
                         HAS_W, HAS_GATE, CD)
