"""KDA forget gate (spec b.6) and the fused gate + within-chunk prefix sum (spec b.9 step 1).

Two gates, chosen by the constexpr ``GATE`` (each compiles its own kernel; the softplus one is the
code it always was): ``GATE = 0``, the softplus gate ``g = -exp(A_log[hv]) * softplus(g_raw +
dt_bias[hv*K + d])`` (threshold 20); ``GATE = 1``, the bounded gate ``g = b * sigmoid(exp(A_log[hv])
* (g_raw + dt_bias))`` with ``b = lower_bound`` in [-5, 0), or ``b * sigmoid(g_raw + dt_bias)``
without ``A_log`` (``HAS_A = False``). Log-space, natural base (no ``1/ln 2`` rescaling: the
kernels use ``tl.exp``).

Storage dtypes: the gate and its prefix sums are always written in the compute dtype, float32 (float64
for fp64 inputs), whatever the dtype of ``g_raw``: a bf16 log-decay would lose ``2^-8 |G|`` of
absolute accuracy in every decay factor, and the chunk kernels take differences of prefix sums. The
optional ``beta = sigmoid(beta_logits)`` is written in the same dtype.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .._jit import jit
from .. import _counters
from ._common import (acc_dtype, block_k, bound_exact, bounded_gate_f, cdiv, check_gate_params,
                      check_tensor, chunk_span, gate_kind, kda_gate_f, next_pow2, sigmoid_f)


@jit
def gate_tile(x, A_log, dt_bias, i_hv, dk, mk, m2, lower_bound, K: tl.constexpr, GATE: tl.constexpr,
              HAS_A: tl.constexpr, ACC: tl.constexpr, B_EXACT: tl.constexpr = False):
    """The gate of a [rows, BK] tile ``x`` of g_raw (ACC) at value head ``i_hv``, channels ``dk``
    (``mk``: inside K); 0 outside ``m2`` (rows past the sequence end, masked channels), so a prefix
    sum over the rows stays flat past the end. GATE 0: softplus, 1: bounded by ``lower_bound``
    (``B_EXACT``: it is exact in ACC, :func:`bounded_gate_f`)."""
    bias = tl.load(dt_bias + i_hv * K + dk, mask=mk, other=0.0).to(ACC)
    if GATE == 0:
        a = tl.exp(tl.load(A_log + i_hv).to(ACC))
        x = tl.where(m2, kda_gate_f(x, a, bias[None, :]), 0.0)
    else:
        z = x + bias[None, :]
        if HAS_A:
            z = tl.exp(tl.load(A_log + i_hv).to(ACC)) * z
        x = tl.where(m2, bounded_gate_f(z, lower_bound, ACC, B_EXACT), 0.0)
    return x


@jit
def _gate_cumsum_kernel(g, A_log, dt_bias, beta_in, G_out, beta_out, cu, cidx, T, lower_bound: tl.float64,
                        HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        RAW: tl.constexpr, CUMSUM: tl.constexpr, HAS_BETA: tl.constexpr,
                        IS_VARLEN: tl.constexpr, GATE: tl.constexpr = 0, HAS_A: tl.constexpr = True,
                        B_EXACT: tl.constexpr = False):
    # One program per (chunk, sequence*value head, BK key channels): a [BT, BK] tile of tokens x key
    # channels. RAW: g holds g_raw and the gate is applied (GATE 0 softplus, 1 bounded by
    # lower_bound, an fp64 argument: a plain float would arrive as fp32); CUMSUM: inclusive prefix
    # sum over the chunk's rows (chunks restart at every sequence start); HAS_BETA: also beta_out =
    # sigmoid(beta_in), by the first channel block's program.
    ACC = G_out.dtype.element_ty
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_k = tl.program_id(2)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    t0, eos, i_n = chunk_span(cu, cidx, i_c, i_b, T, BT, IS_VARLEN)
    if i_n < 0:
        return
    tok = t0 + tl.arange(0, BT)
    valid = tok < eos
    dk = i_k * BK + tl.arange(0, BK)
    mk = dk < K
    m2 = valid[:, None] & mk[None, :]
    off = (tok * HV + i_hv)[:, None] * K + dk[None, :]
    x = tl.load(g + off, mask=m2, other=0.0).to(ACC)
    if RAW:
        x = gate_tile(x, A_log, dt_bias, i_hv, dk, mk, m2, lower_bound, K, GATE, HAS_A, ACC, B_EXACT)
    if CUMSUM:
        x = tl.cumsum(x, axis=0)
    tl.store(G_out + off, x.to(G_out.dtype.element_ty), mask=m2)
    if HAS_BETA and i_k == 0:
        b = tl.load(beta_in + tok * HV + i_hv, mask=valid, other=0.0).to(ACC)
        tl.store(beta_out + tok * HV + i_hv, sigmoid_f(b).to(beta_out.dtype.element_ty), mask=valid)


def gate_chunk_cumsum(g, *, A_log=None, dt_bias=None, beta_logits=None, chunk_size=64,
                      cumsum=True, cu=None, cidx=None, grid_chunks=None, acc=None, num_warps=4,
                      block_k_cols=None, lower_bound=None):
    """Launch the gate kernel (internal; no argument checks, no launch counter).

    g: [B,T,HV,K] (``g_raw`` when ``dt_bias`` is given, with ``A_log`` (None only for the bounded
    gate) and ``lower_bound`` (None: the softplus gate), else the log-decay). Returns
    ``(G [B,T,HV,K], beta [B,T,HV] or None)`` in ``acc`` (float32/float64): ``G`` holds the
    within-chunk inclusive prefix sums when ``cumsum`` (chunks of ``chunk_size``; with ``cu``/``cidx``
    from :func:`._common.varlen_chunk_plan` they restart at each sequence start), else the gate itself.
    ``num_warps`` and ``block_k_cols`` (key channels per program, a power of two; default all) are
    launch settings; the tile's layout can re-associate the prefix sum (in bounds).
    """
    B, T, HV, K = g.shape
    acc = acc or acc_dtype(g.dtype)
    G = torch.empty(B, T, HV, K, dtype=acc, device=g.device)
    raw = dt_bias is not None
    has_beta = beta_logits is not None
    beta = torch.empty(B, T, HV, dtype=acc, device=g.device) if has_beta else None
    BT = chunk_size
    nchunks = grid_chunks if grid_chunks is not None else cdiv(T, BT)
    if B * T == 0:
        return G, beta
    BK = min(block_k_cols or block_k(K), block_k(K))
    _gate_cumsum_kernel[(nchunks, B * HV, cdiv(K, BK))](
        g, A_log, dt_bias, beta_logits, G, beta, cu, cidx, T, 0.0 if lower_bound is None else lower_bound,
        HV=HV, K=K, BT=BT, BK=BK, RAW=raw, CUMSUM=cumsum, HAS_BETA=has_beta,
        IS_VARLEN=cidx is not None, GATE=gate_kind(lower_bound), HAS_A=A_log is not None,
        B_EXACT=bound_exact(lower_bound, acc), num_warps=num_warps)
    return G, beta


def gate(g_raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor, *,
         lower_bound: float | None = None) -> torch.Tensor:
    """KDA forget gate: ``g = -exp(A_log[hv]) * softplus(g_raw + dt_bias)`` (threshold 20), or with
    ``lower_bound = b`` in [-5, 0) the bounded gate ``g = b * sigmoid(exp(A_log[hv]) * (g_raw +
    dt_bias))`` (``A_log`` None: ``b * sigmoid(g_raw + dt_bias)``).

    g_raw: [B,T,HV,K] (any float dtype); A_log: HV elements ([HV] or the checkpoint's [1,1,HV,1]);
    dt_bias: HV*K elements (flat index ``hv*K + d``). Returns g [B,T,HV,K], the log-space decay
    (<= 0), in float32 (float64 when ``g_raw`` is float64): the KDA kernels take g in that dtype.
    """
    _counters.record("kda.gate")
    op = "kda.gate"
    check_tensor(op, "g_raw", g_raw, 4, "B,T,HV,K")
    B, T, HV, K = g_raw.shape
    if K > 256:
        raise ValueError(f"{op}: g_raw: K = {K} > 256 is not supported")
    A_log, dt_bias, lower_bound = check_gate_params(op, A_log, dt_bias, HV, K, g_raw, lower_bound)
    g_raw = g_raw.contiguous()
    BT = min(64, next_pow2(max(T, 1)))
    G, _ = gate_chunk_cumsum(g_raw, A_log=A_log, dt_bias=dt_bias, chunk_size=BT, cumsum=False,
                             lower_bound=lower_bound)
    return G
