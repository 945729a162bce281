"""Chunked KDA (spec b.9) as a pipeline of four Triton kernels (five with ``fused_output=False``;
two at chunk 16 under a fused gate, where ``_prepare16_kernel`` runs kernels 1-3 as one
program per chunk and head: a single 16-row block needs no merge, and G and Akk stay in registers;
it stores the block's inverse X, kb and beta, and the state pass forms ``w = X kb`` and
``u = X (beta v)`` itself, so u never goes through memory and v is read once).

Per sequence and value head, chunks of ``BT = chunk_size`` tokens (16, 32 or 64), ``G`` = the
inclusive prefix sum of the log-decay g within the chunk (g <= 0, so G is non-increasing in a chunk)::

    Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (i > j)
    Aqk[i,j] = s sum_d q_i k_j exp(G_i - G_j)        (i >= j)
    M = (I + Akk)^-1,  w = M (beta k exp(G)),  u = M (beta v),  kg = k exp(G_last - G),  qg = s q exp(G)
    v_new = u - w S,   o = qg S + Aqk v_new,   S <- diag(exp(G_last)) S + kg^T v_new

Kernels (grid in brackets):

1. ``_gate_cumsum_kernel`` (gate.py) [chunks, B*HV, K/64]: G (fused: the gate and beta = sigmoid
   too); 64-channel programs on 4 warps (:class:`ChunkLaunch`).
2. ``_blocks_kernel`` [chunks, B*HV, BT/BC]: the rows of one ``BC = 16`` row sub-block a of Akk and
   Aqk, and their kg, qg, kb (every exp of the pipeline is taken here). No exponent of a positive
   difference is formed (but one bounded by 75 under the bounded gate, below):
   - earlier sub-blocks through the reference row ``r = a*BC``: ``exp(G_i - G_r) * exp(G_r - G_j)``
     with i >= r > j, both factors <= 1, as tl.dot;
   - the diagonal sub-block the same way, each pair i > j through the reference row at the highest
     bit where i and j differ (i >= r > j again): four levels of dots, squares of 8, 4, 2 and 1 rows,
     one exp tile each (``_diag_block``: log2(BC) exp tiles, where forming each pair directly,
     ``exp(G_i - G_j)`` masked before exp, takes BC [BC, K] exp-and-sum steps). Under the fused
     bounded gate (each step's g >= b >= -5) the block's first row serves every pair of it
     (``_diag_block_bounded``: exp(G_r0 - G_j) <= e^75, one exp tile and two dots), and in the
     prepare16 kernel under softplus where the chunk decays by at most e^-75; then
     its inverse ``D_a = (I + beta*Akk_aa)^-1`` by forward substitution (BC - 1 rank-1 steps;
     the prepare16 kernel substitutes its two 8-row halves side by side and merges them,
     :func:`_unit_lower_inverse`),
     stored in place of the block (Akk is kept in ACC). In a bf16 run the diagonal block's
     products, like the other blocks', take bf16 operands.
   Small ``[BC, K]`` tiles: four programs per chunk and head rather than one whole-chunk program
   (more programs over the SMs, each with a quarter of the chunk's rows in registers), two warps
   each (a 16-row tl.dot on more warps repeats the product on each, one warp serializes it).
3. ``_wy_kernel`` [chunks, B*HV]: with N = D Akk_offdiag (strictly block-lower, N^(BT/BC) = 0),
   ``M = (I + N)^-1 D = (I - N)(I + N^2) D`` for BT = 64 (exact algebra, 4 tl.dots), then
   ``w = M kb`` with ``kb = beta k exp(G)`` written by kernel 2 (so this kernel reads one DT tile
   where it would read k and the ACC G and take the exps again; the store costs kernel 2 less than
   it saves here) and ``u = M (beta v)``.
4-5. ``_state_output_kernel`` [V/BV, N*HV]: the sequential pass over chunks, S in ACC registers, with
   the output in it: per chunk v_new = u - w S, o = qg S + Aqk v_new, S <- exp(G_last) S + kg^T v_new
   (the chain is two dependent dots; the output's two dots hang off it). The chunk-start states h and
   v_new never go through memory; each program re-reads its chunks' qg and Aqk (BV = 64 where the
   64-column grid covers the SMs, else 32: :func:`_fused_block_v`). Bytes per token and head (K = V =
   128, BT = 64, bf16): the state pass and output kernel read and wrote 2,952 (h alone 512 written and
   512 read), the fused kernel 1,416; the pipeline about 7,200 before and 5,650 after, against a floor
   of 1,282 (q, k, v, g_raw, beta read, o written).
   ``fused_output=False`` runs them as the two kernels they were (bitwise the same result):
   ``_state_kernel`` [V/16, N*HV] stores h and v_new, ``_output_kernel`` [V/BV, chunks, B*HV]
   computes o = qg h + Aqk v_new (BV = 128 in 16-bit runs).

Each launch setting and kernel form above is chosen by its time: the figures, with the command
that measures each (``benchmarks/tune.py kda``), are in docs/BENCHMARKS.md, "KDA against fla-core".

Ragged final chunks: rows past the sequence end load k = q = v = beta = 0 and G of the last valid
row (G loads clamp the row index), so G stays non-increasing, finite, and ``G[BT-1] = G_last``.
``fused_chunked`` l2-normalizes q and k on load in kernel 2 (ACC, never written back; the later
kernels only see qg, kg, kb), and applies the gate and the beta sigmoid in kernel 1.

Storage dtypes (ACC = float32, float64 for fp64 inputs; DT = the input dtype, bf16 in production):

==================  ======================  =================================================
tensor              dtype                   why
==================  ======================  =================================================
G (prefix sums)     ACC  [B,T,HV,K]         differences of prefix sums feed exp()
beta (fused)        ACC  [B,T,HV]           a sigmoid output; tiny
Akk (D on diag.)    ACC  [B,T,HV,BT]        the inverse is formed from it; its merge runs
M                   registers only, ACC     tl.dot on DT operands (bf16 tensor cores in bf16)
Aqk                 DT   [B,T,HV,BT]        only ever a DT tl.dot operand (output kernel)
w, u, kg            DT                      tl.dot operands of the state pass
kb (in w's buffer)  DT                      tl.dot operand of the WY kernel; rounded as the dot would
qg                  DT                      tl.dot operand of the output kernel
v_new               DT                      tl.dot operand (state update and output); registers only
                                            in the fused kernel
h (chunk states)    DT   [chunks,HV,K,V]    tl.dot operand of the output: S as DT, the operand of
                                            ``dot``, in the fused kernel (never stored)
running state S     ACC  (registers)        the recurrence accumulates in ACC
final state         ACC                     contract: float32 (float64 for fp64 runs)
o                   DT                      contract: input dtype
==================  ======================  =================================================

So a bf16 run rounds Aqk, w, u, kg, qg, v_new, h and every dot operand to bf16 (the set fla rounds);
an fp32 run rounds nothing below fp32 (ieee dots, no TF32); an fp64 run is fp64 throughout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from .._interpreter import interpreting, settle
from .._jit import jit
from .. import _counters, _launch
from ._common import (SUM, acc_dtype, block_k, bound_exact, cdiv, check_gate_params, check_qkv,
                      check_shape, check_tensor, chunk_span, dot, exp_normal, gate_kind, l2norm_cols,
                      l2norm_rows, next_pow2, prepare_cu_seqlens, prepare_state, sigmoid_f, start_state,
                      state_tile, varlen_chunk_plan)
from .gate import gate_chunk_cumsum, gate_tile

@jit
def _load_rows(ptr, tok, valid, head, NH: tl.constexpr, D: tl.constexpr, dd, md, ACC: tl.constexpr,
               L2NORM: tl.constexpr):
    """Rows ``tok`` of a [*, NH, D] tensor at head ``head``, widened to ACC, optionally l2-normalized."""
    x = tl.load(ptr + (tok * NH + head)[:, None] * D + dd[None, :],
                mask=valid[:, None] & md[None, :], other=0.0).to(ACC)
    if L2NORM:
        x = l2norm_rows(x)
    return x


@jit
def _cols_through_ref(k, Gc, tokT, okT, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      dk, mk, last, Gr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    """``[BK, n]``: columns ``k_j exp(G_r - G_j)`` for the tokens ``tokT`` (``okT``: inside the
    sequence; others load k = 0 and G of the last row), the column side of a block of Akk / Aqk
    formed through the reference row r."""
    kT = tl.load(k + (tokT * H + i_h)[None, :] * K + dk[:, None], mask=mk[:, None] & okT[None, :],
                 other=0.0).to(ACC)
    if L2NORM:
        kT = l2norm_cols(kT)
    GT = tl.load(Gc + (tl.minimum(tokT, last) * HV + i_hv)[None, :] * K + dk[:, None], mask=mk[:, None],
                 other=0.0).to(ACC)
    return kT * tl.exp(Gr[:, None] - GT)


@jit
def _row_of(x, rows, r):
    """Row ``r`` of a [R, BK] tile, as [BK] (exact: the other rows add zeros)."""
    return tl.reduce(tl.where(rows[:, None] == r, x, 0.0), 0, SUM)


@jit
def _square_refs(G, c16, lvl: tl.constexpr, BC: tl.constexpr):
    """``[BC, K]``: for each row of the block's prefix sums G, the row its square of level ``lvl``
    refers to (:func:`_diag_block`: squares of ``2s = BC >> lvl`` rows, the first row of the
    square's later half, ``(c16 // 2s) 2s + s``), gathered exactly: each a sum of that row's value
    and zeros."""
    ref = tl.zeros_like(G)
    for m in tl.static_range(0, 1 << lvl):
        first = m * (BC >> lvl)
        ref = tl.where((c16 // (BC >> lvl) == m)[:, None], _row_of(G, c16, first + (BC >> (lvl + 1)))[None, :],
                       ref)
    return ref


@jit
def _diag_block(Gc, kt, qt, Gm, t0, r0, c16, last, i_hv, HV: tl.constexpr, K: tl.constexpr, dk, mk,
                BC: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, G_ROWS: tl.constexpr = False):
    """The diagonal sub-block of (Akk, Aqk) without an exponent of a positive difference: each pair
    i > j is formed through the reference row r with i >= r > j at the highest bit where i and j
    differ (``r = i`` with that bit's lower bits cleared), ``exp(G_i - G_r) * exp(G_r - G_j)``, both
    factors <= 1. One level per bit (squares of 8, 4, 2, 1 rows for BC = 16), each two tl.dots over K
    masked to its squares; Aqk's diagonal ``q_i . k_i`` (decay 1) directly.

    At a level, the rows that take a left factor (the lower half of each square, i) and those that
    take a right factor (the upper half, j) are complementary, so one [BC, K] exp tile E holds both,
    each row's own: ``kt * E`` is the left operand on the lower halves and, transposed, the right
    one on the upper halves (the products in the masked-off halves are discarded). log2(BC) exp
    tiles in all, against 2 log2(BC) - 1 with separate left and right tiles (the same bits) and BC
    [BC, K] exps with 2 BC cross-lane sums when each pair is formed directly; their times:
    docs/BENCHMARKS.md, "KDA against fla-core". ``G_ROWS``: Gm holds the whole block's rows (the
    prepare16 kernel's chunk, r0 = 0, rows past the sequence end at the last row's G, as the loads
    clamp them), the reference rows taken from it (:func:`_square_refs`) rather than from Gc."""
    tl.static_assert(BC == 16)
    A = tl.zeros([BC, BC], dtype=ACC)
    Qm = tl.zeros([BC, BC], dtype=ACC)
    for lvl in tl.static_range(0, 4):
        s = BC >> (lvl + 1)
        row_in = (c16 & s) != 0  # the lower half of its square: takes the left factor
        if G_ROWS:
            Gref = _square_refs(Gm, c16, lvl, BC)
        else:
            ref = tl.where(row_in, (c16 // s) * s, (c16 // s + 1) * s)  # both halves: the same r
            Gref = tl.load(Gc + (tl.minimum(t0 + r0 + ref, last) * HV + i_hv)[:, None] * K + dk[None, :],
                           mask=mk[None, :], other=0.0).to(ACC)
        # level 1's left factor is exp(G_i - G_i) = exp(0) = 1 exactly
        E = tl.exp(tl.where(row_in[:, None], Gm - Gref, Gref - Gm))  # <= 1 on every row
        kE = kt * E
        right = tl.trans(kE)
        sq = ((c16 // (2 * s))[:, None] == (c16 // (2 * s))[None, :]) & row_in[:, None] & \
            (~row_in)[None, :]
        A = tl.where(sq, dot(kE, right, DT, ACC), A)
        Qm = tl.where(sq, dot(qt * E, right, DT, ACC), Qm)
    qk = tl.reduce(qt * kt, 1, SUM)
    Qm = tl.where(c16[:, None] == c16[None, :], qk[:, None], Qm)
    return A, Qm


@jit
def _diag_block_bounded(kl, ql, kt, qt, Gm, Gr, c16, BC: tl.constexpr, DT: tl.constexpr,
                        ACC: tl.constexpr, FTZ: tl.constexpr):
    """The diagonal sub-block of (Akk, Aqk) under the bounded gate: every pair through the block's
    first row r0 alone, ``exp(G_i - G_r0) * exp(G_r0 - G_j)``. The left factors (<= 1) are the rows'
    own, already formed for the earlier sub-blocks (``kl``, ``ql``: DT, as a dot rounds them); the
    right factor is the exponent of a positive difference, at most ``exp(-b (BC - 1))`` <= e^75 for a
    gate bounded below by b >= -5 (every step decays by more than b), inside the range of bf16 and
    fp32, with k l2-normalized. Each product keeps its two operands' relative roundings, as in
    :func:`_diag_block`; one exp tile and two tl.dots in place of its four levels. The pairs j > i
    (finite, at most 128 e^75) are discarded. ``FTZ``: the exp as :func:`exp_normal` (its results
    are in [1, e^75], normal)."""
    right = tl.trans(kt * exp_normal(Gr[None, :] - Gm, FTZ))
    lower = c16[:, None] > c16[None, :]
    A = tl.where(lower, dot(kl, right, DT, ACC), 0.0)
    Qm = tl.where(lower, dot(ql, right, DT, ACC), 0.0)
    qk = tl.reduce(qt * kt, 1, SUM)
    Qm = tl.where(c16[:, None] == c16[None, :], qk[:, None], Qm)
    return A, Qm


@jit
def _unit_lower_inverse(A, c16, BC: tl.constexpr, ACC: tl.constexpr, LEVELS: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower triangular [BC, BC] tile. The diagonal blocks of
    ``BC >> LEVELS`` rows are inverted side by side by right-looking forward substitution (step s
    eliminates each block's pivot s, ``X[i, :] -= A[i, s] X[s, :]``; rows i <= s have A[i, s] = 0),
    then merged pairwise LEVELS times: two inverted blocks X1, X2 and the block A21 between them
    give ``[[X1, 0], [-X2 A21 X1, X2]]``, that is ``X - X (A_off X)`` with two ACC dots (no operand
    rounded). LEVELS = 0 is BC - 1 rank-1 steps, each a reduction across the tile's rows."""
    b0: tl.constexpr = BC >> LEVELS
    blk = c16 // b0
    X = tl.where(c16[:, None] == c16[None, :], 1.0, 0.0).to(ACC)
    same = blk[:, None] == blk[None, :]
    Ad = tl.where(same, A, 0.0)
    for s in tl.static_range(0, b0 - 1):
        piv = (c16 % b0) == s
        a_col = tl.reduce(tl.where(piv[None, :], Ad, 0.0), 1, SUM)  # A[i, its block's pivot s]
        m_row = tl.reduce(tl.where(piv[:, None], X, 0.0), 0, SUM)  # X[its block's pivot s, c]
        if LEVELS > 0:  # m_row holds every block's pivot row: keep each block's own
            X = X - tl.where(same, a_col[:, None] * m_row[None, :], 0.0)
        else:
            X = X - a_col[:, None] * m_row[None, :]
    for m in tl.static_range(0, LEVELS):
        hi = c16 // (b0 << m)  # the block of b0 << m rows (or columns) each index is in
        off = (hi[:, None] == hi[None, :] + 1) & (hi[:, None] // 2 == hi[None, :] // 2)
        X = X - dot(X, dot(tl.where(off, A, 0.0), X, ACC, ACC), ACC, ACC)
    return X


@jit
def _blocks_kernel(q, k, Gc, beta, Ak, Aq, kg, qg, kb, cu, cidx, scale: tl.float64, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr,
                   IS_VARLEN: tl.constexpr, BOUNDED_DIAG: tl.constexpr, INV_LEVELS: tl.constexpr):
    # One program per (chunk, sequence*value head, BC-row sub-block a): rows a*BC .. a*BC+BC-1 of
    # beta*Akk (ACC, for the inverse; its diagonal block replaced by the block's inverse D) and of
    # Aqk (scale included), and their kg, qg rows. Small [BC, BK] tiles: NB times the programs of a
    # whole-chunk tile, a fraction of its registers.
    ACC = Gc.dtype.element_ty
    DT = k.dtype.element_ty
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_a = tl.program_id(2)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, i_n = chunk_span(cu, cidx, i_c, i_b, T, BT, IS_VARLEN)
    if i_n < 0:
        return
    last = eos - 1
    r0 = i_a * BC
    if t0 + r0 >= eos:
        return  # a sub-block wholly past the sequence end: its rows are never read
    rows = r0 + tl.arange(0, BC)
    tok = t0 + rows
    valid = tok < eos
    dk = tl.arange(0, BK)
    mk = dk < K

    kt = _load_rows(k, tok, valid, i_h, H, K, dk, mk, ACC, L2NORM)
    qt = _load_rows(q, tok, valid, i_h, H, K, dk, mk, ACC, L2NORM)
    Gm = tl.load(Gc + (tl.minimum(tok, last) * HV + i_hv)[:, None] * K + dk[None, :],
                 mask=mk[None, :], other=0.0).to(ACC)
    b = tl.load(beta + tok * HV + i_hv, mask=valid, other=0.0).to(ACC)

    c16 = tl.arange(0, BC)
    off = (tok * HV + i_hv)[:, None] * BT + c16[None, :]  # + column block * BC
    # the rows' left factors exp(G_i - G_r0) (<= 1) through the block's first row r0: the earlier
    # sub-blocks' products, and the diagonal block's under the bounded gate
    Gr = tl.load(Gc + (tl.minimum(t0 + r0, last) * HV + i_hv) * K + dk, mask=mk, other=0.0).to(ACC)
    left = tl.exp(Gm - Gr[None, :])
    kl = (kt * left).to(DT)
    ql = (qt * left).to(DT)
    # -- the diagonal sub-block, and D = (I + beta*A_aa)^-1
    if BOUNDED_DIAG:
        A, Qm = _diag_block_bounded(kl, ql, kt, qt, Gm, Gr, c16, BC, DT, ACC, False)
    else:  # through reference rows inside it, no exponent of a positive difference
        A, Qm = _diag_block(Gc, kt, qt, Gm, t0, r0, c16, last, i_hv, HV, K, dk, mk, BC, DT, ACC)
    X = _unit_lower_inverse(A * b[:, None], c16, BC, ACC, INV_LEVELS)
    tl.store(Ak + off + r0, X.to(Ak.dtype.element_ty), mask=valid[:, None])
    tl.store(Aq + off + r0, (Qm * scale).to(ACC).to(Aq.dtype.element_ty), mask=valid[:, None])
    # the blocks right of the diagonal (0: both matrices are lower triangular) are never written:
    # the WY and output kernels mask them on load
    # kg = k exp(G_last - G) (state update), qg = scale q exp(G) (output), kb = beta k exp(G) (the
    # WY kernel's right operand, DT as the dot would round it): every factor <= 1
    Gl = tl.load(Gc + ((tl.minimum(t0 + BT, eos) - 1) * HV + i_hv) * K + dk, mask=mk, other=0.0).to(ACC)
    m2 = valid[:, None] & mk[None, :]
    row_k = (tok * HV + i_hv)[:, None] * K + dk[None, :]
    tl.store(kg + row_k, (kt * tl.exp(Gl[None, :] - Gm)).to(kg.dtype.element_ty), mask=m2)
    eG = tl.exp(Gm)
    tl.store(qg + row_k, ((qt * eG) * scale).to(qg.dtype.element_ty), mask=m2)
    tl.store(kb + row_k, (kt * eG * b[:, None]).to(kb.dtype.element_ty), mask=m2)

    # -- earlier sub-blocks bb < a through the reference row r0: exp(G_i - G_r0) exp(G_r0 - G_j) with
    # i >= r0 > j, both factors <= 1. Last, so only the two DT row tiles stay live through the loop.
    for bb in range(0, i_a):
        tokT = t0 + bb * BC + c16  # all before r0, so < eos
        rT = _cols_through_ref(k, Gc, tokT, tokT < eos, i_h, i_hv, H, HV, K, dk, mk, last, Gr, L2NORM, ACC)
        Ab = dot(kl, rT, DT, ACC)
        Qb = dot(ql, rT, DT, ACC)
        tl.store(Ak + off + bb * BC, (Ab * b[:, None]).to(Ak.dtype.element_ty), mask=valid[:, None])
        # scale is an fp64 arg (a plain float arrives as fp32: wrong for fp64 runs); back to ACC
        tl.store(Aq + off + bb * BC, (Qb * scale).to(ACC).to(Aq.dtype.element_ty), mask=valid[:, None])


@jit
def _store_wy(X, kb, b, v, w, u, tok, valid, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              dk, mk, BV: tl.constexpr, NV: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
    """The WY form of a chunk's rows ``tok`` (``valid``: inside the sequence), stored: ``w = X kb``
    [BT, K] and ``u = X (beta v)`` [BT, V] in NV blocks of BV columns, from the inverse X [BT, BT],
    kb [BT, BK] (DT, 0 past the sequence end) and beta ``b`` [BT] (ACC, 0 there)."""
    tl.store(w + (tok * HV + i_hv)[:, None] * K + dk[None, :], dot(X, kb, DT, ACC).to(w.dtype.element_ty),
             mask=valid[:, None] & mk[None, :])
    dv = tl.arange(0, BV)
    for iv in tl.static_range(0, NV):
        ov = iv * BV + dv
        mv = ov < V
        vt = _load_rows(v, tok, valid, i_hv, HV, V, ov, mv, ACC, False)
        ut = dot(X, vt * b[:, None], DT, ACC)
        tl.store(u + (tok * HV + i_hv)[:, None] * V + ov[None, :], ut.to(u.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])


# the decay of a chunk (-G_last) up to which the softplus gate's block is formed through its first row
FIRST_ROW_SPAN = tl.constexpr(75.0)


@jit
def _block_first_row(kt, qt, G, Gl, rows, BT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                     FTZ: tl.constexpr):
    """A 16-row chunk's block (Akk, Aqk) through its first row (:func:`_diag_block_bounded`) and its
    decays ``exp(G_last - G)``, ``exp(G)`` ([BT, BK] each), the four exp tiles as
    :func:`exp_normal`: for a chunk whose exponents are all in [-80, 75], ``exp(G_r0 - G_j) <=
    e^75`` and ``G >= -80`` (the bounded gate's 16 steps of at most 5; a softplus chunk that decays
    by at most e^-75), where exp is normal in fp32."""
    Gr = _row_of(G, rows, 0)
    left = exp_normal(G - Gr[None, :], FTZ)
    kl = (kt * left).to(DT)
    ql = (qt * left).to(DT)
    A, Qm = _diag_block_bounded(kl, ql, kt, qt, G, Gr, rows, BT, DT, ACC, FTZ)
    return A, Qm, exp_normal(Gl[None, :] - G, FTZ), exp_normal(G, FTZ)


@jit
def _block_levels(kt, qt, G, Gl, rows, HV: tl.constexpr, K: tl.constexpr, dk, mk, BT: tl.constexpr,
                  DT: tl.constexpr, ACC: tl.constexpr):
    """:func:`_block_first_row` through the four levels of reference rows (:func:`_diag_block`,
    the reference rows from G's registers), with tl.exp: any decay (no exponent of a positive
    difference, subnormal decays kept); the blocks kernel's bits at chunk 16."""
    A, Qm = _diag_block(G, kt, qt, G, 0, 0, rows, 0, 0, HV, K, dk, mk, BT, DT, ACC, True)
    return A, Qm, tl.exp(Gl[None, :] - G), tl.exp(G)


@jit
def _prepare16_kernel(q, k, v, g_raw, A_log, dt_bias, beta_logits, Gc, Aq, kg, qg, w, u, Xs, bs, cu,
                      cidx, slow, scale: tl.float64, lower_bound: tl.float64, T, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, HAS_A: tl.constexpr,
                      IS_VARLEN: tl.constexpr, WRITE_G: tl.constexpr, B_EXACT: tl.constexpr,
                      INV_LEVELS: tl.constexpr, WY_OUT: tl.constexpr, EXP_FTZ: tl.constexpr,
                      HEADS_FIRST: tl.constexpr, GATE: tl.constexpr, DIAG: tl.constexpr):
    # Kernels 1-3 as one at chunk 16 under a fused gate (GATE, gate_tile's; one 16-row block per
    # chunk, so M = D, no merge): one program per (chunk, sequence*value head), _prepare16_chunk.
    # The block (DIAG): 0 through the four levels of reference rows, 1 through its first row, 2 (the
    # softplus gate) through its first row, a chunk whose exponents leave that form's range only
    # flagged in ``slow`` (int8, one a program), 3 (a second launch) the flagged chunks again
    # through the levels, from memory, the others untouched: the first launch holds the first-row
    # form's registers only, and the rare levels form costs it none.
    # HEADS_FIRST: the grid is (chunk x value head, batch row), so consecutive programs are one
    # chunk's heads, whose rows lie side by side in memory.
    if HEADS_FIRST:
        i_c = tl.program_id(0) // HV
        i_hv = tl.program_id(0) % HV
        i_b = tl.program_id(1)
    else:
        i_c = tl.program_id(0)
        i_b = tl.program_id(1) // HV
        i_hv = tl.program_id(1) % HV
    t0, eos, i_n = chunk_span(cu, cidx, i_c, i_b, T, BT, IS_VARLEN)
    if i_n < 0:
        return
    flag = slow + tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    if DIAG == 3:
        if tl.load(flag) == 0:
            return
    low = _prepare16_chunk(q, k, v, g_raw, A_log, dt_bias, beta_logits, Gc, Aq, kg, qg, w, u, Xs, bs, scale,
                           lower_bound, T, i_c, i_b, i_hv, t0, eos, H, HV, K, V, BT, BK, BV, NV, HAS_A,
                           IS_VARLEN, WRITE_G, B_EXACT, INV_LEVELS, WY_OUT, EXP_FTZ, GATE,
                           DIAG == 1 or DIAG == 2)
    if DIAG == 2:
        # G is non-increasing down the chunk and at most 0: its last row bounds every exponent
        tl.store(flag, (low < -FIRST_ROW_SPAN).to(tl.int8))


@jit
def _prepare16_chunk(q, k, v, g_raw, A_log, dt_bias, beta_logits, Gc, Aq, kg, qg, w, u, Xs, bs, scale,
                     lower_bound, T, i_c, i_b, i_hv, t0, eos, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     NV: tl.constexpr, HAS_A: tl.constexpr, IS_VARLEN: tl.constexpr, WRITE_G: tl.constexpr,
                     B_EXACT: tl.constexpr, INV_LEVELS: tl.constexpr, WY_OUT: tl.constexpr,
                     EXP_FTZ: tl.constexpr, GATE: tl.constexpr, FIRST_ROW: tl.constexpr):
    """Chunk ``i_c`` (tokens ``t0`` to ``eos``) of sequence row ``i_b`` at value head ``i_hv``: the
    gate and its prefix sums, beta, the block (:func:`_block_first_row` if FIRST_ROW, else
    :func:`_block_levels`) and its inverse, and kg, qg, Aq with the roundings kernels 1-3 give
    them; G and Akk stay in registers. WY_OUT: w and u too, as the WY kernel forms them; else the
    operands the state pass forms them from (wy_in_pass): kb = beta k exp(G) in w's buffer, the
    inverse X (rounded to DT, as the WY dots round it) and beta (ACC). G's last row per chunk is
    stored for the state pass, one row per chunk in h's chunk order (every token's row with
    WRITE_G, for the stage tests). Returns the lowest channel of G's last row."""
    ACC = Gc.dtype.element_ty
    DT = k.dtype.element_ty
    i_h = i_hv // (HV // H)
    rows = tl.arange(0, BT)
    tok = t0 + rows
    valid = tok < eos
    dk = tl.arange(0, BK)
    mk = dk < K
    m2 = valid[:, None] & mk[None, :]
    row_k = (tok * HV + i_hv)[:, None] * K + dk[None, :]
    # the gate and its prefix sums over the chunk: rows past the end add 0 (G stays at the last valid
    # row's, as kernel 1 leaves it)
    x = tl.load(g_raw + row_k, mask=m2, other=0.0).to(ACC)
    g = gate_tile(x, A_log, dt_bias, i_hv, dk, mk, m2, lower_bound, K, GATE, HAS_A, ACC, B_EXACT)
    G = tl.cumsum(g, axis=0)
    Gl = _row_of(G, rows, BT - 1)
    if WRITE_G:
        tl.store(Gc + row_k, G.to(Gc.dtype.element_ty), mask=m2)
    else:  # the chunk's row of the chunk-state order: the program's index when varlen
        crow = i_c if IS_VARLEN else i_b.to(tl.int64) * tl.cdiv(T, BT) + i_c
        tl.store(Gc + (crow * HV + i_hv) * K + dk, Gl.to(Gc.dtype.element_ty), mask=mk)
    b = sigmoid_f(tl.load(beta_logits + tok * HV + i_hv, mask=valid, other=0.0).to(ACC))
    b = tl.where(valid, b, 0.0)

    kt = _load_rows(k, tok, valid, i_h, H, K, dk, mk, ACC, True)
    qt = _load_rows(q, tok, valid, i_h, H, K, dk, mk, ACC, True)
    if FIRST_ROW:
        A, Qm, eGl, eG = _block_first_row(kt, qt, G, Gl, rows, BT, DT, ACC, EXP_FTZ)
    else:
        A, Qm, eGl, eG = _block_levels(kt, qt, G, Gl, rows, HV, K, dk, mk, BT, DT, ACC)
    X = _unit_lower_inverse(A * b[:, None], rows, BT, ACC, INV_LEVELS)   # M = D
    tl.store(Aq + (tok * HV + i_hv)[:, None] * BT + rows[None, :],
             (Qm * scale).to(ACC).to(Aq.dtype.element_ty), mask=valid[:, None])
    tl.store(kg + row_k, (kt * eGl).to(kg.dtype.element_ty), mask=m2)
    tl.store(qg + row_k, ((qt * eG) * scale).to(qg.dtype.element_ty), mask=m2)
    kb = (kt * eG * b[:, None]).to(w.dtype.element_ty)   # as kernel 2 stores it
    if WY_OUT:  # kb's rows past the end are 0 (k loads 0 there), as are beta's
        _store_wy(X, kb, b, v, w, u, tok, valid, i_hv, HV, K, V, dk, mk, BV, NV, DT, ACC)
    else:
        tl.store(w + row_k, kb, mask=m2)
        tl.store(Xs + (tok * HV + i_hv)[:, None] * BT + rows[None, :], X.to(DT), mask=valid[:, None])
        tl.store(bs + tok * HV + i_hv, b, mask=valid)
    return tl.min(Gl, axis=0)


@jit
def _wy_kernel(kb, v, beta, w, u, Ak, cu, cidx, T,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, NV: tl.constexpr, IS_VARLEN: tl.constexpr):
    # One program per (chunk, sequence*value head): M = (I + beta*Akk)^-1 from _blocks_kernel's rows
    # (beta*Akk off the diagonal blocks, the diagonal blocks' inverses D on them), then the WY form
    # w = M kb (kb = beta k exp(G), from _blocks_kernel), u = M (beta v). w may be kb's buffer: the
    # chunk's kb rows are read (by this program only) before its w rows are written. LOG2_NB =
    # log2(BT // BC), NV = cdiv(V, BV): passed in, since a local computed from constexprs is not a
    # constexpr for the compiler.
    ACC = Ak.dtype.element_ty
    DT = kb.dtype.element_ty
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    t0, eos, i_n = chunk_span(cu, cidx, i_c, i_b, T, BT, IS_VARLEN)
    if i_n < 0:
        return
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    tok = t0 + rows
    valid = tok < eos
    dk = tl.arange(0, BK)
    mk = dk < K

    same = (rows // BC)[:, None] == (cols // BC)[None, :]
    lower = (rows // BC)[:, None] >= (cols // BC)[None, :]  # the blocks _blocks_kernel writes
    A = tl.load(Ak + (tok * HV + i_hv)[:, None] * BT + cols[None, :], mask=valid[:, None] & lower,
                other=0.0).to(ACC)
    X = tl.where(same, A, 0.0)  # D
    if LOG2_NB > 0:
        # merge: (I + A)^-1 = (I + N)^-1 D with N = D A_off strictly block-lower (N^NB = 0), and
        # (I + N)^-1 = (I - N)(I + N^2)(I + N^4)...: LOG2_NB factors
        P = -dot(X, tl.where(same, 0.0, A), DT, ACC)
        for m in tl.static_range(LOG2_NB):
            X = X + dot(P, X, DT, ACC)
            if m + 1 < LOG2_NB:
                P = dot(P, P, DT, ACC)

    # -- WY form: w = M kb, u = M (beta v); rows past the sequence end load 0
    kbt = tl.load(kb + (tok * HV + i_hv)[:, None] * K + dk[None, :], mask=valid[:, None] & mk[None, :],
                  other=0.0)
    b = tl.load(beta + tok * HV + i_hv, mask=valid, other=0.0).to(ACC)
    _store_wy(X, kbt, b, v, w, u, tok, valid, i_hv, HV, K, V, dk, mk, BV, NV, DT, ACC)


@jit
def _gate_last(Gc, t0, eos, crow, c, nt, i_hv, dk, mk, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               CHUNK_ROWS: tl.constexpr):
    """``[BK]``: G at the last row of chunk ``c`` (of ``nt``; 0 past them), which starts at row
    ``t0``: Gc's row ``crow`` where it holds one row per chunk (``CHUNK_ROWS``, in the chunk-state
    order of h), else the chunk's last token row. The state passes fetch it one chunk ahead: the
    compiler's pipeline prefetches only the dot operands' tiles, and a load issued in the step that
    uses it stalls the chain a memory latency."""
    row = crow if CHUNK_ROWS else tl.minimum(t0 + BT, eos) - 1
    return tl.load(Gc + (row * HV + i_hv) * K + dk, mask=mk & (dk * 0 + c < nt), other=0.0)


@jit
def _sequence_chunks(cu, co, i_n, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n`` of a state pass: ``(bos, eos, nt, c0)``, its first and end rows, its chunk
    count, and the row of its first chunk in the chunk-state tensor h."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
        nt = (eos - bos + BT - 1) // BT
        c0 = tl.load(co + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        nt = NT
        c0 = i_n.to(tl.int64) * NT
    return bos, eos, nt, c0


@jit
def _state_kernel(kg, w, u, Gc, vnew, h, h0, ht, cu, co, T, NT,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, G_CHUNK_ROWS: tl.constexpr):
    # One program per (sequence*value head, V block): the only sequential part. Per chunk: two
    # dependent dots on operands prepared by kernels 2 and 3; S stays in ACC registers.
    ACC = ht.dtype.element_ty
    DT = w.dtype.element_ty
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_hv = i_nh % HV
    bos, eos, nt, c0 = _sequence_chunks(cu, co, i_nh // HV, T, NT, BT, IS_VARLEN)
    dk, mk, dv, mv, mkv, kv_off = state_tile(i_v, K, V, BK, BV)
    S = start_state(h0, i_nh, kv_off, mkv, K, V, BK, BV, HAS_H0, ACC)
    rows = tl.arange(0, BT)
    Gl_next = _gate_last(Gc, bos, eos, c0, 0, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
    for c in range(0, nt):
        t0 = bos + c * BT
        tok = t0 + rows
        valid = tok < eos
        Gl = Gl_next.to(ACC)
        Gl_next = _gate_last(Gc, t0 + BT, eos, c0 + c + 1, c + 1, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
        tl.store(h + ((c0 + c) * HV + i_hv) * K * V + kv_off, S.to(h.dtype.element_ty), mask=mkv)
        wt = tl.load(w + (tok * HV + i_hv)[:, None] * K + dk[None, :],
                     mask=valid[:, None] & mk[None, :], other=0.0)
        ut = tl.load(u + (tok * HV + i_hv)[:, None] * V + dv[None, :],
                     mask=valid[:, None] & mv[None, :], other=0.0).to(ACC)
        vn = (ut - dot(wt, S, DT, ACC)).to(DT)  # rounded once: the same v_new feeds o and S
        tl.store(vnew + (tok * HV + i_hv)[:, None] * V + dv[None, :], vn,
                 mask=valid[:, None] & mv[None, :])
        # kg^T loaded as a [BK, BT] tile (transposed addressing, no register transpose)
        kgT = tl.load(kg + (tok * HV + i_hv)[None, :] * K + dk[:, None],
                      mask=mk[:, None] & valid[None, :], other=0.0)
        S = S * tl.exp(Gl)[:, None] + dot(kgT, vn, DT, ACC)
    tl.store(ht + i_nh.to(tl.int64) * K * V + kv_off, S.to(ht.dtype.element_ty), mask=mkv)


@jit
def _output_kernel(qg, h, vnew, Aq, o, cu, cidx, T, NT,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    # o = qg h + Aq v_new: qg = scale q exp(G) and Aq (scale included) come from _blocks_kernel.
    ACC = tl.float64 if o.dtype.element_ty == tl.float64 else tl.float32
    DT = h.dtype.element_ty
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    t0, eos, i_n = chunk_span(cu, cidx, i_c, i_b, T, BT, IS_VARLEN)
    if i_n < 0:
        return
    # this chunk's row of h: the varlen plan numbers chunks across sequences, else B rows of NT
    if IS_VARLEN:
        chunk = i_c.to(tl.int64)
    else:
        chunk = i_b.to(tl.int64) * NT + i_c
    rows = tl.arange(0, BT)
    tok = t0 + rows
    valid = tok < eos
    dk = tl.arange(0, BK)
    mk = dk < K
    dv = i_v * BV + tl.arange(0, BV)
    mv = dv < V
    # rows past the sequence end of qg / Aq / v_new were never written: masked to 0 (0 * garbage
    # could be NaN)
    qgt = tl.load(qg + (tok * HV + i_hv)[:, None] * K + dk[None, :],
                  mask=valid[:, None] & mk[None, :], other=0.0)
    hb = tl.load(h + (chunk * HV + i_hv) * K * V + dk[:, None] * V + dv[None, :],
                 mask=mk[:, None] & mv[None, :], other=0.0)
    acc = dot(qgt, hb, DT, ACC)
    # Aq's blocks right of the diagonal are never written (0)
    lower = (rows // BC)[:, None] >= (rows // BC)[None, :]
    At = tl.load(Aq + (tok * HV + i_hv)[:, None] * BT + rows[None, :], mask=valid[:, None] & lower,
                 other=0.0)
    vn = tl.load(vnew + (tok * HV + i_hv)[:, None] * V + dv[None, :],
                 mask=valid[:, None] & mv[None, :], other=0.0)
    acc += dot(At, vn, DT, ACC)
    tl.store(o + (tok * HV + i_hv)[:, None] * V + dv[None, :], acc.to(o.dtype.element_ty),
             mask=valid[:, None] & mv[None, :])


@jit
def _state_output_kernel(kg, w, u, qg, Aq, Gc, o, vnew, h, h0, ht, Xs, bs, cu, co, T, NT,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                         IS_VARLEN: tl.constexpr, WRITE_STAGES: tl.constexpr, WY_IN: tl.constexpr,
                         G_CHUNK_ROWS: tl.constexpr):
    # Kernels 4 and 5 as one: per (sequence*value head, V block), per chunk, v_new = u - w S,
    # o = qg S + Aq v_new, S <- exp(G_last) S + kg^T v_new, so neither the chunk-start states h nor
    # v_new go through memory (WRITE_STAGES: stored anyway, for the stage tests). The same roundings
    # as the two kernels: S enters both dots as DT (what h holds), v_new is rounded once to DT.
    # WY_IN (one 16-row block per chunk): w = X kb and u = X (beta v) formed here from the prepare
    # kernel's inverse rows X (Xs, DT), kb (in w's place), v (in u's) and beta (bs), each rounded to
    # DT as stored, so u never goes through memory; off the chain over chunks (no S in them).
    ACC = ht.dtype.element_ty
    DT = w.dtype.element_ty
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_hv = i_nh % HV
    bos, eos, nt, c0 = _sequence_chunks(cu, co, i_nh // HV, T, NT, BT, IS_VARLEN)
    dk, mk, dv, mv, mkv, kv_off = state_tile(i_v, K, V, BK, BV)
    S = start_state(h0, i_nh, kv_off, mkv, K, V, BK, BV, HAS_H0, ACC)
    rows = tl.arange(0, BT)
    lower = (rows // BC)[:, None] >= (rows // BC)[None, :]  # Aq's blocks right of the diagonal: 0
    Gl_next = _gate_last(Gc, bos, eos, c0, 0, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
    for c in range(0, nt):
        t0 = bos + c * BT
        tok = t0 + rows
        valid = tok < eos
        Gl = Gl_next.to(ACC)
        Gl_next = _gate_last(Gc, t0 + BT, eos, c0 + c + 1, c + 1, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
        if WRITE_STAGES:
            tl.store(h + ((c0 + c) * HV + i_hv) * K * V + kv_off, S.to(h.dtype.element_ty), mask=mkv)
        row_v = (tok * HV + i_hv)[:, None] * V + dv[None, :]
        m_v = valid[:, None] & mv[None, :]
        wt = tl.load(w + (tok * HV + i_hv)[:, None] * K + dk[None, :],
                     mask=valid[:, None] & mk[None, :], other=0.0)
        ut = tl.load(u + row_v, mask=m_v, other=0.0).to(ACC)
        if WY_IN:  # wt holds kb, ut v; rows past the sequence end load X = 0
            Xt = tl.load(Xs + (tok * HV + i_hv)[:, None] * BT + rows[None, :], mask=valid[:, None],
                         other=0.0)
            bt = tl.load(bs + tok * HV + i_hv, mask=valid, other=0.0)
            wt = dot(Xt, wt, DT, ACC).to(DT)
            ut = dot(Xt, ut * bt[:, None], DT, ACC).to(DT).to(ACC)
        vn = (ut - dot(wt, S, DT, ACC)).to(DT)  # rounded once: the same v_new feeds o and S
        if WRITE_STAGES:
            tl.store(vnew + row_v, vn, mask=m_v)
        # rows past the sequence end of qg / Aq were never written: masked to 0
        qgt = tl.load(qg + (tok * HV + i_hv)[:, None] * K + dk[None, :],
                      mask=valid[:, None] & mk[None, :], other=0.0)
        At = tl.load(Aq + (tok * HV + i_hv)[:, None] * BT + rows[None, :], mask=valid[:, None] & lower,
                     other=0.0)
        acc = dot(qgt, S, DT, ACC)
        acc += dot(At, vn, DT, ACC)
        tl.store(o + row_v, acc.to(o.dtype.element_ty), mask=m_v)
        kgT = tl.load(kg + (tok * HV + i_hv)[None, :] * K + dk[:, None],
                      mask=mk[:, None] & valid[None, :], other=0.0)
        S = S * tl.exp(Gl)[:, None] + dot(kgT, vn, DT, ACC)
    tl.store(ht + i_nh.to(tl.int64) * K * V + kv_off, S.to(ht.dtype.element_ty), mask=mkv)


@jit
def _state_output_t_kernel(kg, w, u, qg, Aq, Gc, o, h0, ht, Xs, bs, cu, co, T, NT,
                           HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                           IS_VARLEN: tl.constexpr, G_CHUNK_ROWS: tl.constexpr):
    # _state_output_kernel with WY_IN (no stages), transposed: the state held as S^T [BV, BK], so
    # that it, v_new^T and every other operand on the chain over chunks is a dot's left operand
    # (a register operand of the MMA) or its accumulator: v_new^T = u^T - S^T w^T,
    # o^T = S^T qg^T + v_new^T Aq^T, S^T <- S^T diag(exp(G_last)) + v_new^T kg; w^T = kb^T X^T and
    # u^T = (beta v)^T X^T. The same products, each operand rounded as there; the order of the
    # sums inside a dot is the MMA's.
    ACC = ht.dtype.element_ty
    DT = w.dtype.element_ty
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_hv = i_nh % HV
    bos, eos, nt, c0 = _sequence_chunks(cu, co, i_nh // HV, T, NT, BT, IS_VARLEN)
    dk, mk, dv, mv, mkv, kv_off = state_tile(i_v, K, V, BK, BV)
    vk_off = dk[None, :] * V + dv[:, None]   # [BV, BK]: S^T's elements in a [K, V] state
    mvk = mv[:, None] & mk[None, :]
    if HAS_H0:
        St = tl.load(h0 + i_nh.to(tl.int64) * K * V + vk_off, mask=mvk, other=0.0).to(ACC)
    else:
        St = tl.zeros([BV, BK], dtype=ACC)
    rows = tl.arange(0, BT)
    lowerT = (rows // BC)[None, :] >= (rows // BC)[:, None]  # Aq^T's blocks below the diagonal: 0
    Gl_next = _gate_last(Gc, bos, eos, c0, 0, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
    for c in range(0, nt):
        t0 = bos + c * BT
        tok = t0 + rows
        valid = tok < eos
        Gl = Gl_next.to(ACC)
        Gl_next = _gate_last(Gc, t0 + BT, eos, c0 + c + 1, c + 1, nt, i_hv, dk, mk, HV, K, BT, G_CHUNK_ROWS)
        tk = (tok * HV + i_hv)[None, :]
        m_kt = mk[:, None] & valid[None, :]
        # X^T [BT(j), BT(i)]: the columns of rows past the sequence end load 0, as X's rows there
        XT = tl.load(Xs + tk * BT + rows[:, None], mask=valid[None, :], other=0.0)
        wT = dot(tl.load(w + tk * K + dk[:, None], mask=m_kt, other=0.0), XT, DT, ACC).to(DT)
        bt = tl.load(bs + tok * HV + i_hv, mask=valid, other=0.0)
        vT = tl.load(u + tk * V + dv[:, None], mask=mv[:, None] & valid[None, :], other=0.0).to(ACC)
        uT = dot(vT * bt[None, :], XT, DT, ACC).to(DT).to(ACC)
        vnT = (uT - dot(St, wT, DT, ACC)).to(DT)  # rounded once: the same v_new feeds o and S
        qgT = tl.load(qg + tk * K + dk[:, None], mask=m_kt, other=0.0)
        AT = tl.load(Aq + tk * BT + rows[:, None], mask=valid[None, :] & lowerT, other=0.0)
        accT = dot(St, qgT, DT, ACC)
        accT += dot(vnT, AT, DT, ACC)
        tl.store(o + tk * V + dv[:, None], accT.to(o.dtype.element_ty), mask=mv[:, None] & valid[None, :])
        kgt = tl.load(kg + (tok * HV + i_hv)[:, None] * K + dk[None, :], mask=valid[:, None] & mk[None, :],
                      other=0.0)
        St = St * tl.exp(Gl)[None, :] + dot(vnT, kgt, DT, ACC)
    tl.store(ht + i_nh.to(tl.int64) * K * V + vk_off, St.to(ht.dtype.element_ty), mask=mvk)


@dataclass(frozen=True)
class ChunkLaunch:
    """Launch settings of the chunked-KDA kernels; a None is chosen per dtype or V beside the
    kernel (:func:`_num_stages`, :func:`_output_block_v`, :func:`_fused_block_v`). None of them
    changes a row's arithmetic (the state pass and the output kernel split V columns, which never
    mix; ``fused_output`` only decides whether h and v_new go through memory) except ``gate_warps``
    and ``gate_block_k``, whose layout can re-associate the gate's prefix sum, ``bounded_diag`` and
    ``inverse_levels`` (the defaults are the certified values; another is re-certified, ``parity
    certify --device cuda``).
    ``blocks_maxnreg``, ``prepare_maxnreg``, ``fused_maxnreg``: register caps for the blocks,
    prepare16 (its first launch, under either gate) and fused state pass kernels (a launch option
    of Triton's CUDA backend; None: the compiler's choice; the prepare16 default of 168 timed under
    the bounded gate against no cap and caps of 144, 160, 176 and 192, under softplus against no
    cap and 192, the state pass's 128 and 168 slower than none: docs/BENCHMARKS.md, "Bytes, chunk
    size and FlashKDA"). ``inverse_levels``: how the 16-row diagonal blocks are inverted
    (:func:`_unit_lower_inverse`; None: 1 in the prepare16 kernel, 8-row halves merged by two dots,
    9% faster there than 0, 15 substitution steps; 0 in the blocks kernel); every value is exact
    algebra, each its own roundings. Why the
    defaults (bf16, B=1, T=65536; each setting timed per kernel and checked bit for bit against the
    defaults by ``benchmarks/tune.py kda --shapes 1x65536 --kernels <kernel>``; the figures:
    docs/BENCHMARKS.md, "KDA against fla-core"):

    - gate: 64-channel programs on 4 warps; 128-channel programs (half the grid) are slower, and
      32 channels on 2 warps only tie while their layout would re-open the certificate;
    - blocks: 2 warps (a 16-row tl.dot on more warps repeats the product on each, one warp
      serializes it); 3 stages in 16-bit runs (the earlier sub-blocks' columns prefetched; bitwise
      equal); no register cap: the kernel holds 255 registers, a cap below that forces spills, and
      every cap tried was slower;
    - WY: 4 warps (2 spill, 8 are slower);
    - state pass: 16-column V blocks on 4 warps: the serial chain over chunks is as long whatever
      the block's width, so narrower blocks spread it over more programs; other warp counts and
      wider blocks are slower;
    - output: one 128-column program per chunk and head in 16-bit runs reads qg and Aq once, not
      once per 64-column block;
    - ``fused_output`` (default): the output computed in the state pass (kernels 4 and 5 as one;
      bitwise the same as the two; ``state_*`` and ``output_*`` then unused), 13-18% faster in all
      on an H100 at B=1 T=4k-64k H=32, B=8 T=4k and H=96 T=8k; ``fused_block_v`` None picks 64
      columns where that grid covers every SM, else 32 (``_fused_block_v``; 16 columns, 2 stages
      and 8 warps are slower), ``fused_warps`` 4, ``fused_stages`` None: 3 in 16-bit runs, else 1
      (``benchmarks/kda_forms.py``);
    - ``bounded_diag`` (default): under the fused bounded gate the diagonal blocks are formed
      through their first row (:func:`_diag_block_bounded`: one exp tile and two dots) rather than
      four levels of reference rows (:func:`_diag_block`, the softplus gate's form); its own
      roundings, within the same bound; under softplus, in the prepare16 kernel, the blocks of the
      chunks that decay by at most e^-75 (``FIRST_ROW_SPAN``) are formed so too (the others are
      formed again by a second launch, and every block with ``bounded_diag`` False, through the
      four levels: the three kernels' bits on the interpreter; on an H100 the kernel's G, the
      gate's prefix sum, differs from the gate kernel's in the last bits, and so what follows);
    - ``wy_in_pass`` (default, with ``prepare16`` and ``fused_output``): the fused state pass forms
      w and u from the prepare16 kernel's inverse X, kb and beta (two dots off its chain over
      chunks) rather than reading them: the prepare kernel no longer reads v nor writes u, and the
      pass reads v where it read u (bitwise the stored form: X and both products rounded as
      stored; the stage tests, which read w and u, get the stored form);
    - ``state_transposed`` (None: chosen per grid, :func:`_state_transposed`; with
      ``wy_in_pass``, stages not written): that state pass on S^T (``_state_output_t_kernel``), so
      every operand on its chain over chunks is a register operand or the accumulator of an MMA
      (warpgroup MMAs at 64 V columns) rather than a tile through shared memory; the same products
      and operand roundings, its own order of sums inside each dot, yet the default's bits in
      bf16 on an H100 (every shape timed) and on the interpreter (a test on both); within the bound
      on its own (its test);
    - ``prepare16`` (default): at chunk 16 under a fused gate, kernels 1-3 as one
      (``_prepare16_kernel``; at the same ``inverse_levels`` and block form the three kernels'
      bits on the interpreter, and under the bounded gate in bf16 on an H100; under softplus
      there the kernel's G differs from the gate kernel's in the last bits, ``bounded_diag``);
      under the bounded gate 11-13% faster than the three on ``prepare_warps`` 2 (4 warps are
      slower than the three, 8 slower still: a 16-row tl.dot is repeated on every warp;
      ``benchmarks/kda_forms.py --launches '{"prepare16": false}' '{}' '{"prepare_warps": 4}'
      --chunk-sizes 16``), under softplus faster at every shape timed (docs/BENCHMARKS.md,
      ``--gates softplus``). Under softplus each program of the first launch flags its chunk when
      it leaves the first-row form's range, and a second launch, whose programs of unflagged
      chunks return at once, forms those again, so the first holds the first-row form's
      registers only: 8-22% faster than the same second pass in the first launch's program after
      a barrier, which held the levels form's registers (255 and spills uncapped, the call 13-19%
      slower at a cap of 168; H100);
    - ``prepare_heads_first`` (None: from ``HEADS_FIRST_MIN_HV`` value heads on,
      :func:`_prepare_heads_first`): the prepare16 kernel's programs ordered with one chunk's heads
      adjacent rather than one head's chunks; the same programs, so the same bits (a test).
    """
    gate_warps: int = 4
    gate_block_k: int = 64
    blocks_warps: int = 2
    blocks_stages: int | None = None
    blocks_maxnreg: int | None = None
    wy_warps: int = 4
    wy_stages: int | None = None
    state_block_v: int = 16
    state_warps: int = 4
    state_stages: int | None = None
    output_block_v: int | None = None
    output_warps: int = 4
    fused_output: bool = True
    fused_block_v: int | None = None
    fused_warps: int = 4
    fused_stages: int | None = None
    fused_maxnreg: int | None = None
    bounded_diag: bool = True
    prepare16: bool = True
    prepare_warps: int = 2
    prepare_maxnreg: int | None = 168
    inverse_levels: int | None = None
    wy_in_pass: bool = True
    state_transposed: bool | None = None
    prepare_heads_first: bool | None = None


CHUNK_LAUNCH = ChunkLaunch()  # the defaults (frozen, so one instance serves every call)


def _num_stages(kernel: str, dtype: torch.dtype) -> int:
    """Software-pipelining depth per kernel: the state pass prefetches whole [BT, K] tiles of w, k,
    G and u per stage, which at fp32/fp64 would exceed the H200's 227 KiB of shared memory."""
    if kernel == "state":
        return {torch.float64: 1, torch.float32: 2}.get(dtype, 3)
    if kernel == "fused":  # the state pass's tiles plus qg and Aq per stage
        return 1 if dtype.itemsize > 2 else 3
    if kernel == "blocks":  # prefetch of the earlier sub-blocks' columns (tune.py kda --kernels blocks)
        return 3 if dtype.itemsize == 2 else 2
    return 3 if dtype != torch.float64 else 2


def _inverse_levels(launch: ChunkLaunch, kernel: str) -> int:
    """Merge levels of the 16-row diagonal blocks' inverse (:func:`_unit_lower_inverse`): the
    launch's, else 1 in the prepare16 kernel and 0 in the blocks kernel."""
    if launch.inverse_levels is None:
        return 1 if kernel == "prepare16" else 0
    return launch.inverse_levels


def _output_block_v(dtype: torch.dtype, BV: int) -> int:
    """V columns per output program: 128 in 16-bit runs (one program per chunk and head reads qg and
    Aq once, not once per V tile), else the pipeline's V tile."""
    return max(BV, 128) if dtype.itemsize == 2 else BV


def _check_chunk_size(op, chunk_size):
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"{op}: chunk_size: expected 16, 32 or 64, got {chunk_size!r}")
    return int(chunk_size)


@dataclass(frozen=True)
class _Plan:
    """Sizes, tiles and chunk table of one call: ``N`` sequences (B, or the cu_seqlens count),
    ``NT`` chunks per sequence (0 when varlen), ``n_chunks`` chunk programs; ``cu``, ``cidx``, ``co``
    the varlen tables (None otherwise)."""
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    BT: int
    BC: int
    BK: int
    BV: int
    N: int
    NT: int
    n_chunks: int
    cu: torch.Tensor | None
    cidx: torch.Tensor | None
    co: torch.Tensor | None

    @property
    def varlen(self) -> bool:
        return self.cu is not None


def _check_inputs(op, q, k, v, g, beta, A_log, dt_bias, chunk_size, fused, lower_bound=None):
    """Validated sizes ``(B, T, H, HV, K, V)``, chunk size and the gate parameters (contiguous when
    fused; ``lower_bound`` None or the bounded gate's b)."""
    B, T, H, HV, K, V = check_qkv(op, q, k, v)
    BT = _check_chunk_size(op, chunk_size)
    gname, bname = ("g_raw", "beta_logits") if fused else ("g", "beta")
    check_tensor(op, gname, g)
    check_shape(op, gname, g, (B, T, HV, K), "[B,T,HV,K]")
    check_tensor(op, bname, beta)
    check_shape(op, bname, beta, (B, T, HV), "[B,T,HV]")
    if fused:
        A_log, dt_bias, lower_bound = check_gate_params(op, A_log, dt_bias, HV, K, q, lower_bound)
    return (B, T, H, HV, K, V), BT, A_log, dt_bias, lower_bound


def _plan(op, sizes, BT, dtype, cu_seqlens, dev) -> _Plan:
    if cu_seqlens is None:
        return _dense_plan(sizes, BT, dtype.itemsize)
    B, T, H, HV, K, V = sizes
    cu, N = prepare_cu_seqlens(op, cu_seqlens, B, T, dev)
    cidx, co, n_chunks = varlen_chunk_plan(cu, N, T, BT)
    BK, BV = _tiles(K, V, dtype.itemsize)
    return _Plan(B, T, H, HV, K, V, BT, min(16, BT), BK, BV, N, 0, n_chunks, cu, cidx, co)


@functools.lru_cache(maxsize=256)
def _dense_plan(sizes, BT, itemsize) -> _Plan:
    """The plan of B equal sequences: a function of the sizes alone, so made once per shape (a call's
    host time is what a short eager call waits on)."""
    B, T, H, HV, K, V = sizes
    NT = cdiv(T, BT)
    BK, BV = _tiles(K, V, itemsize)
    return _Plan(B, T, H, HV, K, V, BT, min(16, BT), BK, BV, B, NT, NT, None, None, None)


def _tiles(K, V, itemsize) -> tuple[int, int]:
    """``(BK, BV)``. 16-bit runs compile one tile configuration, the real model's (128 keys, 64
    values), smaller K and V zero-padded by the masks (exact): a small-K bf16 test then runs the
    production tiles (32-key bf16 tiles have hit an illegal memory access on the GPU where fp32 ran
    clean; ``bash benchmarks/check_gpu.sh`` runs the small-K bf16 tests on CUDA)."""
    BK, BV = block_k(K), min(64, max(16, next_pow2(V)))
    return (max(BK, 128), 64) if itemsize == 2 else (BK, BV)


def _launch_intra(p: _Plan, q, k, v, G, beta, scale, fused, launch: ChunkLaunch, bounded: bool):
    """Kernels 2 and 3: ``(w, u, Aq, kg, qg)``. w's buffer first holds kb = beta k exp(G) (blocks
    kernel), replaced by w in the WY kernel. ``bounded``: the fused bounded gate (g >= b >= -5, q and
    k l2-normalized), under which the diagonal blocks may take :func:`_diag_block_bounded`."""
    dt, dev, acc = q.dtype, q.device, acc_dtype(q.dtype)
    B, T, HV = p.B, p.T, p.HV
    w = torch.empty(B, T, HV, p.K, dtype=dt, device=dev)
    u = torch.empty(B, T, HV, p.V, dtype=dt, device=dev)
    Aq = torch.empty(B, T, HV, p.BT, dtype=dt, device=dev)
    kg = torch.empty_like(w)
    qg = torch.empty_like(w)
    Ak = torch.empty(B, T, HV, p.BT, dtype=acc, device=dev)
    cap = launch.blocks_maxnreg
    _blocks_kernel[(p.n_chunks, B * HV, p.BT // p.BC)](
        q, k, G, beta, Ak, Aq, kg, qg, w, p.cu, p.cidx, scale, T,
        H=p.H, HV=HV, K=p.K, BT=p.BT, BC=p.BC, BK=p.BK, L2NORM=fused, IS_VARLEN=p.varlen,
        BOUNDED_DIAG=bounded and launch.bounded_diag, INV_LEVELS=_inverse_levels(launch, "blocks"),
        num_warps=launch.blocks_warps,
        num_stages=_num_stages("blocks", dt) if launch.blocks_stages is None else launch.blocks_stages,
        **({"maxnreg": cap} if cap is not None else {}))
    _wy_kernel[(p.n_chunks, B * HV)](
        w, v, beta, w, u, Ak, p.cu, p.cidx, T,
        HV=HV, K=p.K, V=p.V, BT=p.BT, BC=p.BC, LOG2_NB=(p.BT // p.BC).bit_length() - 1, BK=p.BK,
        BV=p.BV, NV=cdiv(p.V, p.BV), IS_VARLEN=p.varlen, num_warps=launch.wy_warps,
        num_stages=_num_stages("wy", dt) if launch.wy_stages is None else launch.wy_stages)
    return w, u, Aq, kg, qg


def _flush_exp(acc: torch.dtype) -> bool:
    """The prepare16 kernel's ``EXP_FTZ``: its exps as ``exp_normal`` in fp32 on a GPU (the
    interpreter runs no inline PTX). The backend is settled first, as a launch would: a first call
    that chose none asks before any kernel has launched."""
    settle()
    return acc == torch.float32 and not interpreting()


HEADS_FIRST_MIN_HV = 96  # value heads from which the prepare16 kernel runs one chunk's heads side by side


def _prepare_heads_first(p: _Plan) -> bool:
    """``ChunkLaunch.prepare_heads_first`` None: heads first from ``HEADS_FIRST_MIN_HV`` value heads
    on. The order changes no program, only which programs run side by side; on an H100 it was
    faster at every shape timed with 96 heads (the prepare kernel 0.85 of the default's time at
    T = 64k, 0.98 at 1k) and slower at every one with 32 and 64 (1.16-1.27); why is not known, nor
    is it the registers (docs/BENCHMARKS.md, "Bytes, chunk size and FlashKDA")."""
    return p.HV >= HEADS_FIRST_MIN_HV


def _launch_prepare16(p: _Plan, q, k, v, g_raw, beta_logits, A_log, dt_bias, scale, lower_bound,
                      launch: ChunkLaunch, write_g: bool, wy_out: bool = True):
    """Kernels 1-3 as one at chunk 16 under a fused gate (``lower_bound`` None: softplus):
    ``(G, w, u, Aq, kg, qg, wy)``;
    G holds each chunk's last row, ``[chunks, HV, K]`` in h's chunk order (``[B, T, HV, K]``, every
    row, for ``write_g``): 1/16 of the token rows' bytes, 3 GB less at T = 64k, H = 96. ``wy_out``:
    w and u, wy None; else w holds kb, u is v, and wy is ``(X, beta)`` for the state pass
    (:class:`ChunkLaunch`'s ``wy_in_pass``)."""
    dt, dev = q.dtype, q.device
    B, T, HV = p.B, p.T, p.HV
    acc = acc_dtype(dt)
    G = torch.empty(*((B, T) if write_g else (p.B * p.NT if not p.varlen else p.n_chunks,)), HV, p.K,
                    dtype=acc, device=dev)
    w = torch.empty(B, T, HV, p.K, dtype=dt, device=dev)
    Aq = torch.empty(B, T, HV, p.BT, dtype=dt, device=dev)
    kg = torch.empty_like(w)
    qg = torch.empty_like(w)
    if wy_out:
        u, wy = torch.empty(B, T, HV, p.V, dtype=dt, device=dev), None
    else:
        u, wy = v, (torch.empty_like(Aq), torch.empty(B, T, HV, dtype=acc, device=dev))
    Xs, bs = wy if wy is not None else (Aq, G)  # unread with WY_OUT
    grid, settings, again = _cached(_prepare16_settings, p, launch, A_log is not None,
                                    bound_exact(lower_bound, acc), _flush_exp(acc), write_g, wy_out,
                                    gate_kind(lower_bound))
    slow = torch.empty(grid[0] * grid[1], dtype=torch.int8, device=dev) if again is not None else G
    args = (q, k, v, g_raw, A_log, dt_bias, beta_logits, G, Aq, kg, qg, w, u, Xs, bs, p.cu, p.cidx, slow,
            scale, 0.0 if lower_bound is None else lower_bound, T)
    _prepare16_kernel[grid](*args, **settings)
    if again is not None:  # the chunks the first launch flagged, through the levels
        _prepare16_kernel[grid](*args, **again)
    return G, w, u, Aq, kg, qg, wy


def _cached(settings, p: _Plan, *key):
    """``settings(p, *key)``, made once per plan and key where the plan is of equal sequences (a
    varlen plan holds its tables, made for one call)."""
    return settings.__wrapped__(p, *key) if p.varlen else settings(p, *key)


@functools.lru_cache(maxsize=256)
def _prepare16_settings(p: _Plan, launch: ChunkLaunch, has_a: bool, b_exact: bool, ftz: bool,
                        write_g: bool, wy_out: bool, gate: int) -> tuple[tuple, dict, dict | None]:
    """The prepare16 launch's grid and constexprs, and the second launch's or None (a function of
    the plan and the launch: made once per shape, :func:`_cached`). The block's form (``DIAG``):
    through its first row under the bounded gate, and under softplus in each chunk that decays by
    at most ``FIRST_ROW_SPAN`` (``bounded_diag``), the others through the four levels in a second
    launch (uncapped: the levels form holds 255 registers, and few programs get past the flag)."""
    heads_first = _prepare_heads_first(p) if launch.prepare_heads_first is None else launch.prepare_heads_first
    grid = (p.n_chunks * p.HV, p.B) if heads_first else (p.n_chunks, p.B * p.HV)
    diag = (1 if gate == 1 else 2) if launch.bounded_diag else 0
    settings = dict(
        H=p.H, HV=p.HV, K=p.K, V=p.V, BT=p.BT, BK=p.BK, BV=p.BV, NV=cdiv(p.V, p.BV), HAS_A=has_a,
        IS_VARLEN=p.varlen, WRITE_G=write_g, B_EXACT=b_exact, INV_LEVELS=_inverse_levels(launch, "prepare16"),
        WY_OUT=wy_out, EXP_FTZ=ftz, HEADS_FIRST=heads_first, GATE=gate, DIAG=diag,
        num_warps=launch.prepare_warps)
    again = dict(settings, DIAG=3) if diag == 2 else None
    cap = {"maxnreg": launch.prepare_maxnreg} if launch.prepare_maxnreg is not None else {}
    return grid, settings | cap, again


def _launch_state(p: _Plan, kg, w, u, G, h0, launch: ChunkLaunch):
    """Kernel 4, the sequential pass: ``(h, v_new, final state)``. Smaller V blocks: more programs
    for the pass, fewer registers."""
    dt, dev = w.dtype, w.device
    h = torch.empty((p.B * p.NT if not p.varlen else p.n_chunks), p.HV, p.K, p.V, dtype=dt, device=dev)
    vnew = torch.empty_like(u)
    ht = torch.empty(p.N, p.HV, p.K, p.V, dtype=acc_dtype(dt), device=dev)
    BVs = launch.state_block_v
    _state_kernel[(cdiv(p.V, BVs), p.N * p.HV)](
        kg, w, u, G, vnew, h, h0, ht, p.cu, p.co, p.T, p.NT,
        HV=p.HV, K=p.K, V=p.V, BT=p.BT, BK=p.BK, BV=BVs, HAS_H0=h0 is not None,
        IS_VARLEN=p.varlen, G_CHUNK_ROWS=G.dim() == 3, num_warps=launch.state_warps,
        num_stages=_num_stages("state", dt) if launch.state_stages is None else launch.state_stages)
    return h, vnew, ht


def _launch_output(p: _Plan, qg, h, vnew, Aq, launch: ChunkLaunch):
    """Kernel 5: ``o = qg h + Aqk v_new``."""
    dt = qg.dtype
    o = torch.empty(p.B, p.T, p.HV, p.V, dtype=dt, device=qg.device)
    BVo = _output_block_v(dt, p.BV) if launch.output_block_v is None else launch.output_block_v
    _output_kernel[(cdiv(p.V, BVo), p.n_chunks, p.B * p.HV)](
        qg, h, vnew, Aq, o, p.cu, p.cidx, p.T, p.NT,
        HV=p.HV, K=p.K, V=p.V, BT=p.BT, BC=p.BC, BK=p.BK, BV=BVo, IS_VARLEN=p.varlen,
        num_warps=launch.output_warps, num_stages=_num_stages("output", dt))
    return o


def _fused_block_v(p: _Plan, sms: int) -> int:
    """V columns per program of the fused state pass on ``sms`` SMs: 64 where the 64-column grid
    (sequences x value heads x V/64) still covers every SM, else 32 (more programs for the serial
    chain over chunks); each program re-reads its chunks' qg and Aq, so wider blocks read them fewer
    times."""
    return 64 if p.N * p.HV * cdiv(p.V, 64) >= sms else 32


def _state_transposed(p: _Plan, BV: int, dtype: torch.dtype, sms: int | None) -> bool:
    """``ChunkLaunch.state_transposed`` None, for a GPU of ``sms`` SMs (None: not a GPU, the
    default pass): the transposed pass in 16-bit runs where its V blocks are 64 columns wide (at 32
    its MMAs are not warpgroup MMAs, and it is slower), except on grids of 3 to 4 programs per SM.
    On an H100 (Triton 3.6) it holds 3 programs per SM, the default 4, and a full round of it takes
    0.61 of the default's: the grids that one round of the default's holds but two of its are needed
    for are the only ones where it lost (512 programs: 770 against 728 us at B=8 T=4k H=32, 792
    against 730 at B=4 H=64); 2-39% faster at the 14 other grids timed (docs/BENCHMARKS.md, "Bytes,
    chunk size and FlashKDA"). It gives the default's bits (a test, on the GPU and the
    interpreter), so the default's certificate covers it."""
    if sms is None or dtype.itemsize != 2 or BV != 64:
        return False
    return not 3 * sms < p.N * p.HV * cdiv(p.V, BV) <= 4 * sms


def _launch_state_output(p: _Plan, kg, w, u, qg, Aq, G, h0, launch: ChunkLaunch, write_stages: bool,
                         wy=None):
    """Kernels 4 and 5 fused: ``(o, h, v_new, final state)``; h and v_new are allocated and written
    only for ``write_stages`` (else None). ``wy``: the prepare kernel's ``(X, beta)``, w and u then
    kb and v (:func:`_launch_prepare16`)."""
    dt, dev = w.dtype, w.device
    o = torch.empty(p.B, p.T, p.HV, p.V, dtype=dt, device=dev)
    h = vnew = None
    if write_stages:
        h = torch.empty((p.B * p.NT if not p.varlen else p.n_chunks), p.HV, p.K, p.V, dtype=dt, device=dev)
        vnew = torch.empty_like(u)
    ht = torch.empty(p.N, p.HV, p.K, p.V, dtype=acc_dtype(dt), device=dev)
    Xs, bs = wy if wy is not None else (Aq, G)  # unread without WY_IN
    transposed, grid, settings = _cached(_state_output_settings, p, launch, dt, _launch.sm_count(dev),
                                         dev.type == "cuda", write_stages, wy is not None, G.dim() == 3,
                                         h0 is not None)
    if transposed:
        _state_output_t_kernel[grid](kg, w, u, qg, Aq, G, o, h0, ht, Xs, bs, p.cu, p.co, p.T, p.NT, **settings)
        return o, None, None, ht
    _state_output_kernel[grid](
        kg, w, u, qg, Aq, G, o, vnew if write_stages else o, h if write_stages else o, h0, ht, Xs, bs,
        p.cu, p.co, p.T, p.NT, **settings)
    return o, h, vnew, ht


@functools.lru_cache(maxsize=256)
def _state_output_settings(p: _Plan, launch: ChunkLaunch, dt: torch.dtype, sms: int, gpu: bool,
                           write_stages: bool, wy_in: bool, g_rows: bool, has_h0: bool) -> tuple[bool, tuple, dict]:
    """The fused state pass's form (transposed or not), grid and constexprs on ``sms`` SMs (``gpu``:
    of a CUDA device), made once per shape (:func:`_cached`)."""
    BVf = _fused_block_v(p, sms) if launch.fused_block_v is None else launch.fused_block_v
    transposed = launch.state_transposed
    if transposed is None:
        transposed = _state_transposed(p, BVf, dt, sms if gpu else None)
    transposed = bool(transposed and wy_in and not write_stages)
    common = dict(HV=p.HV, K=p.K, V=p.V, BT=p.BT, BC=p.BC, BK=p.BK, BV=BVf, HAS_H0=has_h0, IS_VARLEN=p.varlen,
                  G_CHUNK_ROWS=g_rows, num_warps=launch.fused_warps,
                  num_stages=_num_stages("fused", dt) if launch.fused_stages is None else launch.fused_stages,
                  **({"maxnreg": launch.fused_maxnreg} if launch.fused_maxnreg is not None else {}))
    if not transposed:
        common.update(WRITE_STAGES=write_stages, WY_IN=wy_in)
    return transposed, (cdiv(p.V, BVf), p.N * p.HV), common


def _aq_as_read(p: _Plan, Aq, dev):
    """Aq as the output kernel reads it: the blocks right of the diagonal, never written, as 0."""
    t = torch.arange(p.T, device=dev)
    if p.varlen:
        cu64 = p.cu.long()
        t = t - cu64[torch.searchsorted(cu64, t, right=True) - 1]
    keep = (t % p.BT // p.BC)[:, None] >= (torch.arange(p.BT, device=dev) // p.BC)[None, :]
    return Aq.masked_fill(~keep[None, :, None, :], 0)


def _pipeline(op, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, chunk_size, cu_seqlens,
              fused, stages=None, launch=None, lower_bound=None):
    """The launches. ``stages``, a dict, receives the intermediates (tests localize a wrong
    kernel with them): G, w, u, Aq, kg, qg, h, v_new. ``launch``: a :class:`ChunkLaunch`;
    ``lower_bound``: the fused gate's (None: softplus)."""
    launch = _launch.resolve(op, launch, CHUNK_LAUNCH)
    if launch.inverse_levels not in (None, 0, 1, 2, 3, 4):  # 16-row blocks: at most 4 halvings
        raise ValueError(f"{op}: launch.inverse_levels: expected None or 0 to 4, "
                         f"got {launch.inverse_levels!r}")
    sizes, BT, A_log, dt_bias, lower_bound = _check_inputs(op, q, k, v, g, beta, A_log, dt_bias, chunk_size,
                                                           fused, lower_bound)
    B, T, H, HV, K, V = sizes
    dev, dt = q.device, q.dtype
    acc = acc_dtype(dt)
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    p = _plan(op, sizes, BT, dt, cu_seqlens, dev)
    h0 = prepare_state(op, initial_state, p.N, HV, K, V, acc, q, p.varlen)
    if B * T == 0:
        o = torch.empty(B, T, HV, V, dtype=dt, device=dev)
        return o, (h0.clone() if h0 is not None else torch.zeros(p.N, HV, K, V, dtype=acc, device=dev))
    bounded = fused and lower_bound is not None
    wy = None
    if fused and p.BT == 16 and launch.prepare16:
        # 1-3 as one kernel: one 16-row block per chunk needs no merge; w and u formed in the fused
        # state pass unless the stage tests read them
        wy_out = not (launch.wy_in_pass and launch.fused_output) or stages is not None
        G, w, u, Aq, kg, qg, wy = _launch_prepare16(p, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound,
                                                    launch, write_g=stages is not None, wy_out=wy_out)
    else:
        # 1. gate / prefix sums (fused: the gate and the beta sigmoid too)
        G, beta_f = gate_chunk_cumsum(g, A_log=A_log if fused else None, dt_bias=dt_bias if fused else None,
                                      beta_logits=beta if fused else None, chunk_size=p.BT, cumsum=True,
                                      cu=p.cu, cidx=p.cidx, grid_chunks=p.n_chunks, acc=acc,
                                      num_warps=launch.gate_warps, block_k_cols=launch.gate_block_k,
                                      lower_bound=lower_bound)
        if fused:
            beta = beta_f
        # 2-3. intra-chunk matrices and the diagonal blocks' inverses; the merged inverse and WY
        w, u, Aq, kg, qg = _launch_intra(p, q, k, v, G, beta, scale, fused, launch, bounded=bounded)
    # 4. sequential state pass; 5. output (fused into 4 by default: h and v_new stay on chip)
    if launch.fused_output:
        o, h, vnew, ht = _launch_state_output(p, kg, w, u, qg, Aq, G, h0, launch, stages is not None, wy)
    else:
        h, vnew, ht = _launch_state(p, kg, w, u, G, h0, launch)
        o = _launch_output(p, qg, h, vnew, Aq, launch)
    if stages is not None:
        stages.update(G=G, w=w, u=u, Aq=_aq_as_read(p, Aq, dev), kg=kg, qg=qg, h=h, v_new=vnew)
    return o, ht


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64, cu_seqlens=None,
            launch=None):
    """Chunked KDA forward (spec b.9); same result as :func:`optimized.kda.recurrent`.

    q, k: [B,T,H,K] (already l2-normalized); v: [B,T,HV,V] (HV a multiple of H; value head hv reads
    qk head hv // (HV//H)); g: [B,T,HV,K] log-space decay (<= 0; any float dtype, float32 typical);
    beta: [B,T,HV]. scale defaults to K**-0.5. initial_state: [B,HV,K,V] K-first (or [N,HV,K,V] with
    cu_seqlens [N+1] ints, B == 1), any float dtype, or None (zeros). chunk_size: 16, 32 or 64.
    launch: a :class:`ChunkLaunch` (default: the tuned one).
    Returns ``(o [B,T,HV,V] in q.dtype, final_state [N or B,HV,K,V] float32)``; float64 inputs compute
    and return the state in float64.
    """
    _counters.record("kda.chunked")
    return _pipeline("kda.chunked", q, k, v, g, beta, None, None, scale, initial_state,
                     chunk_size, cu_seqlens, fused=False, launch=launch)


def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  chunk_size=64, cu_seqlens=None, launch=None, lower_bound=None):
    """:func:`chunked` of ``l2norm(q), l2norm(k), gate(g_raw, A_log, dt_bias, lower_bound=lower_bound),
    sigmoid(beta_logits)`` with the prologue fused into the kernels (q, k normalized on load in
    float32, never rounded).

    g_raw: [B,T,HV,K]; beta_logits: [B,T,HV]; A_log: HV elements (None: the bounded gate without
    it); dt_bias: HV*K elements; lower_bound: None (the softplus gate) or b in [-5, 0) (the bounded
    gate). Other arguments and the result as in :func:`chunked`.
    """
    _counters.record("kda.fused_chunked")
    return _pipeline("kda.fused_chunked", q, k, v, g_raw, beta_logits, A_log, dt_bias, scale,
                     initial_state, chunk_size, cu_seqlens, fused=True, launch=launch, lower_bound=lower_bound)
