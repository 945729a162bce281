"""Causal depthwise short convolution + SiLU kernels (spec b.5).

Every output is ``silu(sum_{j=0}^{W-1} w[c, j] * xx[t - (W-1) + j, c])`` accumulated in the compute
dtype in the fixed order j = 0 .. W-1, where ``xx`` is the carried state (the W-1 previous inputs,
oldest first) followed by ``x``. The order and the operands do not depend on how a sequence is cut
into calls, so chunked prefill, whole prefill and token-by-token decode agree bit for bit.
"""
from __future__ import annotations

import triton.language as tl

from .._jit import jit
from .._pdl import pdl_wait
from ..elementwise.kernels import silu_f


@jit
def _short_conv_kernel(x_ptr, w_ptr, s0_ptr, y_ptr, sf_ptr, T, C,
                       sxb, sxt, syb, syt, s0b, s0c, sfb, sfc,
                       W: tl.constexpr, HAS_STATE: tl.constexpr, CD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid (B, cdiv(T, BLOCK_T), cdiv(C, BLOCK_C)); x, y [B, T, C] (C contiguous);
    # states [B, C, W-1] (last dim contiguous); w [C, W] contiguous.
    b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    xb = x_ptr + b * sxb
    acc = tl.zeros([BLOCK_T, BLOCK_C], CD)
    for j in tl.static_range(W):
        tau = t - (W - 1) + j  # input time of tap j; < 0 reads the state (column tau + W - 1)
        wj = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(CD)
        in_x = (tau >= 0) & (tau < T)
        xv = tl.load(xb + tau[:, None].to(tl.int64) * sxt + c[None, :],
                     mask=in_x[:, None] & cmask[None, :], other=0.0).to(CD)
        if HAS_STATE:
            in_s = (tau < 0) & (tau + (W - 1) >= 0)
            sv = tl.load(s0_ptr + b * s0b + c[None, :].to(tl.int64) * s0c + (tau + (W - 1))[:, None],
                         mask=in_s[:, None] & cmask[None, :], other=0.0).to(CD)
            xv = xv + sv  # exactly one of the two is non-zero (masked loads give 0)
        acc += wj[None, :] * xv
    y = silu_f(acc)
    tmask = t < T
    tl.store(y_ptr + b * syb + t[:, None].to(tl.int64) * syt + c[None, :],
             y.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    # final state: the last W-1 inputs of cat(state, x), oldest first; written by the last t block
    if pid_t == tl.num_programs(1) - 1:
        for i in tl.static_range(W - 1):
            tau_i = T - (W - 1) + i
            tau_c = tl.full([BLOCK_C], tau_i, tl.int32)  # a tensor, so the masks below are tensors
            v = tl.load(xb + tau_i * sxt + c, mask=cmask & (tau_c >= 0), other=0.0).to(CD)
            if HAS_STATE:
                v += tl.load(s0_ptr + b * s0b + c.to(tl.int64) * s0c + (tau_i + (W - 1)),
                             mask=cmask & (tau_c < 0), other=0.0).to(CD)
            tl.store(sf_ptr + b * sfb + c.to(tl.int64) * sfc + i, v.to(sf_ptr.dtype.element_ty),
                     mask=cmask)


@jit
def _short_conv_step_kernel(x_ptr, w_ptr, s_ptr, y_ptr, so_ptr, slot_ptr, C,
                            sxb, syb, ssb, ssc, sob, soc,
                            W: tl.constexpr, INDEXED: tl.constexpr, CD: tl.constexpr,
                            BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    # grid (B, cdiv(C, BLOCK_C)). Row b reads state row r (r = b, or slot_ids[b] if INDEXED) and
    # writes the shifted state to so row r (so may alias s: all reads of a row precede its writes,
    # and no other program touches that row). A negative slot id is padding: y row = 0, no write.
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    pdl_wait(PDL)
    if INDEXED:
        r = tl.load(slot_ptr + b).to(tl.int64)
        if r < 0:  # padding (most of a decode tile at small B): a zero row, nothing else read
            tl.store(y_ptr + b * syb + c, tl.zeros([BLOCK_C], CD).to(y_ptr.dtype.element_ty), mask=cmask)
            return
    else:
        r = b
    srow = s_ptr + r * ssb + c.to(tl.int64) * ssc
    orow = so_ptr + r * sob + c.to(tl.int64) * soc
    xv = tl.load(x_ptr + b * sxb + c, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_C], CD)
    # taps 0..W-2 read the state, tap W-1 the new input: the order of _short_conv_kernel
    for j in tl.static_range(W - 1):
        sj = tl.load(srow + j, mask=cmask, other=0.0).to(CD)
        acc += tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(CD) * sj
    acc += tl.load(w_ptr + c * W + (W - 1), mask=cmask, other=0.0).to(CD) * xv.to(CD)
    tl.store(y_ptr + b * syb + c, silu_f(acc).to(y_ptr.dtype.element_ty), mask=cmask)
    # column i <- column i + 1, ascending: each column is read before it is overwritten (in place)
    for i in tl.static_range(W - 2):
        v = tl.load(srow + i + 1, mask=cmask, other=0.0)
        tl.store(orow + i, v.to(so_ptr.dtype.element_ty), mask=cmask)
    tl.store(orow + (W - 2), xv.to(so_ptr.dtype.element_ty), mask=cmask)
