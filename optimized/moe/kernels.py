"""MoE kernels: the router's logits GEMM, the sigmoid router, SiLU-gated product, and the
routed-expert SwiGLU in two forms.

Expert forms (both accumulate in the compute dtype, round the intermediate ``h`` to x's dtype as the
bf16 production paths do, and combine the ``k_e`` expert outputs of a token in the fixed order
k = 0 .. k_e-1 with fp32/fp64 weights):

* GEMV form (decode, few (token, expert) pairs): one program per (pair, F tile) streams only the
  routed experts' weight rows (gate/up), then one per (pair, D tile) (down, into an fp32/fp64
  scratch), and the combine kernel sums a token's k_e outputs in order. Three launches in all (two
  for a dense MLP), no sort, no host sync.
* grouped form (prefill; decode, where the shared expert is one more group): pairs are sorted by
  expert on the device (torch's argsort, or for a decode step's few hundred pairs one
  ``_bucket_kernel`` program); each program takes a tile of up to BLOCK_M rows of *one* expert (an
  expert's rows never share a tile with another's) and runs ``tl.dot`` GEMMs, so each expert's
  weights are read once per call, not once per (token, expert) pair; per-pair outputs are combined
  by a third kernel. The tile -> expert map is found in-kernel from the cumulative tile counts, so
  the grid size is a host-side upper bound (``cdiv(M, BLOCK_M) + min(M, E)``) and nothing waits
  for the device. A row's bits depend on neither its tile's other rows nor its place in the tile,
  so they are the same at any batch size: the batch-invariant decode form above a few pairs.
"""
from __future__ import annotations

import triton.language as tl

from .._jit import jit
from .._pdl import pdl_wait
from ..elementwise.kernels import sigmoid_f, silu_f


@jit
def _router_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, T, E, EG, stride_l, scaling: tl.float64,
                   K: tl.constexpr, K_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                   KG: tl.constexpr, RENORM: tl.constexpr, BIASED: tl.constexpr, CD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    # One program routes BLOCK_T tokens. Ties in any max go to the lowest index (expert or group).
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    lg = tl.load(logit_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :],
                 mask=tmask[:, None] & emask[None, :], other=0.0).to(CD)
    s = sigmoid_f(lg)
    sel = s + tl.load(bias_ptr + e, mask=emask, other=0.0).to(CD)[None, :]
    neg = float("-inf")
    # a NaN score is selected last (as in the reference's sort), so ids stay in range and distinct;
    # its NaN still reaches the output through the weights when it is selected
    sel = tl.where(sel == sel, sel, -3.0e38)  # below any score, above the -inf of taken experts
    sel = tl.where(emask[None, :], sel, neg)
    if G > 1:
        # group score = sum of the group's two largest selection scores; keep the KG best groups
        gid = e // EG
        ga = tl.arange(0, G_PAD)
        gscore = tl.full([BLOCK_T, G_PAD], neg, CD)
        for g in tl.static_range(G):
            ing = (gid == g)[None, :] & emask[None, :]
            v = tl.where(ing, sel, neg)
            m1 = tl.max(v, axis=1)
            i1 = tl.min(tl.where(ing & (v == m1[:, None]), e[None, :], BLOCK_E), axis=1)
            m2 = tl.max(tl.where(e[None, :] == i1[:, None], neg, v), axis=1)
            m2 = tl.where(m2 == neg, 0.0, m2)  # a group of one expert scores its top-1
            gscore = tl.where(ga[None, :] == g, (m1 + m2)[:, None], gscore)
        keep = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
        for _ in tl.static_range(KG):
            gm = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == gm[:, None], ga[None, :], G_PAD), axis=1)
            keep = keep | (gid[None, :] == gi[:, None])
            gscore = tl.where(ga[None, :] == gi[:, None], neg, gscore)
        sel = tl.where(keep, sel, neg)  # experts of dropped groups can never be chosen
    ka = tl.arange(0, K_PAD)
    wts = tl.zeros([BLOCK_T, K_PAD], CD)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    wsum = tl.zeros([BLOCK_T], CD)
    for k in tl.static_range(K):
        m = tl.max(sel, axis=1)
        i = tl.min(tl.where(sel == m[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == i[:, None]
        if BIASED:
            wk = tl.sum(tl.where(hit, sel, 0.0), axis=1)  # exactly one term is non-zero
        else:
            wk = tl.sum(tl.where(hit, s, 0.0), axis=1)
        wsum += wk  # sequential in selection order
        wts = tl.where(ka[None, :] == k, wk[:, None], wts)
        ids = tl.where(ka[None, :] == k, i[:, None], ids)
        sel = tl.where(hit, neg, sel)
    if RENORM:
        wts = wts / wsum[:, None]
    wts = wts * tl.full([BLOCK_T, K_PAD], scaling, CD)
    omask = tmask[:, None] & (ka[None, :] < K)
    off = t[:, None].to(tl.int64) * K + ka[None, :]
    tl.store(w_ptr + off, wts.to(w_ptr.dtype.element_ty), mask=omask)
    tl.store(id_ptr + off, ids.to(id_ptr.dtype.element_ty), mask=omask)


@jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, sx, sw, so, CD: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):
    # grid (cdiv(E, BLOCK_E), cdiv(T, BLOCK_T)); out[t, e] = sum_d x[t, d] w[e, d] in CD.
    # Order of the sum, the same for every output: BLOCK_D lane sums, lane j accumulating the
    # products of d = j, j + BLOCK_D, ... in ascending d, then one fixed tree over the lanes (tl.sum).
    # Nothing in it depends on T or on the row's place in its tile (padding rows are zeros kept in
    # their own accumulators), so a row's bits are batch invariant on a GPU and under the interpreter.
    # Not tl.dot: an fp32 FMA tl.dot is one serial chain of D FMAs per output (the lane sums run
    # BLOCK_D chains of D / BLOCK_D side by side), and under the interpreter it is np.matmul, whose
    # BLAS rounds a row differently by its position in the tile.
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    em = e < E
    tm = t < T
    d0 = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + t[:, None].to(tl.int64) * sx        # [BLOCK_T, 1]
    w_rows = w_ptr + e[:, None].to(tl.int64) * sw        # [BLOCK_E, 1]
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_D], CD)
    # the weight is read one slice ahead, its first slice before the wait (PDL: while the kernel
    # before this one drains; the weight is no kernel's output)
    b_next = tl.load(w_rows + d0[None, :], mask=em[:, None] & (d0 < D)[None, :], other=0.0)
    pdl_wait(PDL)
    for k0 in range(0, D, BLOCK_D):
        d = k0 + d0
        dm = d < D
        # x widened in registers (bf16/fp16 -> fp32 is exact): no separate cast kernel
        a = tl.load(x_rows + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(CD)
        b = b_next
        b_next = tl.load(w_rows + (d + BLOCK_D)[None, :], mask=em[:, None] & (d + BLOCK_D < D)[None, :],
                         other=0.0)
        acc += a[:, None, :] * b[None, :, :]              # CD products and sums: no TF32 anywhere
    out = tl.sum(acc, axis=2)
    tl.store(out_ptr + t[:, None].to(tl.int64) * so + e[None, :], out, mask=tm[:, None] & em[None, :])


@jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, n_rows, F, sg, su, sh, CD: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    # h = silu(g) * u, per element, in CD; grid (cdiv(n_rows, ROWS), cdiv(F, BLOCK_F))
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (r < n_rows)[:, None] & (f < F)[None, :]
    g = tl.load(g_ptr + r[:, None] * sg + f[None, :], mask=m, other=0.0).to(CD)
    u = tl.load(u_ptr + r[:, None] * su + f[None, :], mask=m, other=0.0).to(CD)
    tl.store(h_ptr + r[:, None] * sh + f[None, :], (silu_f(g) * u).to(h_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------
# GEMV form (decode)


@jit
def _gemv_pair(pair, ids_ptr, KE, DENSE: tl.constexpr, SHARED: tl.constexpr):
    """(token, expert id, whether the pair is the shared expert's) of a GEMV program's pair. Pairs
    are token-major: k_e routed pairs per token, plus one more for the shared expert (SHARED).
    (One return of one type in every specialization: Triton 3.6 refuses per-branch returns.)"""
    tok = pair
    e = pair * 0
    is_shared = pair < 0
    if not DENSE:
        if SHARED:
            tok = pair // (KE + 1)
            k = pair % (KE + 1)
            is_shared = k == KE
            e = tl.load(ids_ptr + tok * KE + k, mask=k < KE, other=0).to(tl.int64)
        else:
            tok = pair // KE
            e = tl.load(ids_ptr + pair).to(tl.int64)
    return tok, e, is_shared


@jit
def _gemv_gate_up_kernel(x_ptr, ids_ptr, w1_ptr, w3_ptr, ws1_ptr, ws3_ptr, h_ptr, D, F, KE,
                         sx, s1e, s1f, s3e, s3f, ss1f, ss3f, sh, CD: tl.constexpr, DENSE: tl.constexpr,
                         SHARED: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr = False):
    # grid (pairs, cdiv(F, BLOCK_F)); h[pair, f] = silu(w1[e] x)[f] * (w3[e] x)[f]
    # DENSE: one expert (e = 0) and no ids (the dense MLP / shared expert). SHARED: each token's last
    # pair runs the shared expert (ws1, ws3) with the very code (and so the bits) of DENSE.
    pair = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)  # the expert ids are the router's output
    tok, e, is_shared = _gemv_pair(pair, ids_ptr, KE, DENSE, SHARED)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = f < F
    d0 = tl.arange(0, BLOCK_D)
    acc1 = tl.zeros([BLOCK_F, BLOCK_D], CD)
    acc3 = tl.zeros([BLOCK_F, BLOCK_D], CD)
    w1e = w1_ptr + e * s1e
    w3e = w3_ptr + e * s3e
    if SHARED:  # scalar selects: a select of pointer tiles would lose their alignment (no vector loads)
        w1e = tl.where(is_shared, ws1_ptr, w1e)
        w3e = tl.where(is_shared, ws3_ptr, w3e)
        s1f = tl.where(is_shared, ss1f, s1f)
        s3f = tl.where(is_shared, ss3f, s3f)
    w1row = w1e + f[:, None].to(tl.int64) * s1f
    w3row = w3e + f[:, None].to(tl.int64) * s3f
    for k0 in range(0, D, BLOCK_D):
        d = k0 + d0
        dm = d < D
        xv = tl.load(x_ptr + tok * sx + d, mask=dm, other=0.0).to(CD)
        m = fm[:, None] & dm[None, :]
        acc1 += tl.load(w1row + d[None, :], mask=m, other=0.0).to(CD) * xv[None, :]
        acc3 += tl.load(w3row + d[None, :], mask=m, other=0.0).to(CD) * xv[None, :]
    h = silu_f(tl.sum(acc1, axis=1)) * tl.sum(acc3, axis=1)
    tl.store(h_ptr + pair * sh + f, h.to(h_ptr.dtype.element_ty), mask=fm)


@jit
def _gemv_down_kernel(h_ptr, ids_ptr, w2_ptr, ws2_ptr, out_ptr, D, F, KE, sh, s2e, s2d, ss2d, so,
                      CD: tl.constexpr, DENSE: tl.constexpr, SHARED: tl.constexpr,
                      BLOCK_DO: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr = False):
    # grid (pairs, cdiv(D, BLOCK_DO)); out[pair, d] = (w2[e] h[pair])[d]: one program per
    # (pair, D tile), so a single token's 8 experts stream their rows in parallel (a program per D
    # tile looping over the experts left too few loads in flight). _combine_kernel then sums the
    # pairs of a token in order; DENSE: out is y itself (one expert, weight 1); SHARED: each
    # token's last pair is the shared expert (ws2).
    pair = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    tok, e, is_shared = _gemv_pair(pair, ids_ptr, KE, DENSE, SHARED)
    d = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dm = d < D
    f0 = tl.arange(0, BLOCK_F)
    acc = tl.zeros([BLOCK_DO, BLOCK_F], CD)
    w2e = w2_ptr + e * s2e
    if SHARED:  # scalar selects (see the gate/up kernel)
        w2e = tl.where(is_shared, ws2_ptr, w2e)
        s2d = tl.where(is_shared, ss2d, s2d)
    w2row = w2e + d[:, None].to(tl.int64) * s2d
    for k0 in range(0, F, BLOCK_F):
        f = k0 + f0
        fm = f < F
        hv = tl.load(h_ptr + pair * sh + f, mask=fm, other=0.0).to(CD)
        acc += tl.load(w2row + f[None, :], mask=dm[:, None] & fm[None, :], other=0.0).to(CD) * hv[None, :]
    tl.store(out_ptr + pair * so + d, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=dm)


# ----------------------------------------------------------------------------------------------
# grouped form (prefill, and decode with the shared expert as one more group)


@jit
def _bucket_kernel(ids_ptr, order_ptr, cum_ptr, offs_ptr, cnt_ptr, N, E, KE, SHARED: tl.constexpr,
                   BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, G_PAD: tl.constexpr,
                   PDL: tl.constexpr = False):
    # One program sorts the N (token, expert) pairs by expert: what the host's argsort and counts
    # give, in one launch (a decode step's few hundred pairs). Pairs are token-major, k_e per token
    # (SHARED: k_e + 1, the last the shared expert, group E). order: pair indices by group, pair
    # order inside one; cnt, offs: each group's pairs and first row; cum: tiles of BLOCK_M rows up
    # to and including each group. G_PAD > the groups, so the padding lanes' group is no group.
    pdl_wait(PDL)  # the expert ids are the router's output
    i = tl.arange(0, N_PAD)
    m = i < N
    P = KE + 1 if SHARED else KE
    t = i // P
    k = i - t * P
    routed = m & (k < KE)
    e = tl.load(ids_ptr + t * KE + k, mask=routed, other=0).to(tl.int32)
    e = tl.where(routed, e, E)
    e = tl.where(m, e, G_PAD - 1)
    key = tl.sort(e * N_PAD + i)  # distinct keys: the group, then the pair
    tl.store(order_ptr + i, key % N_PAD, mask=m)
    g = tl.arange(0, G_PAD)
    G = E + 1 if SHARED else E
    gm = g < G
    cnt = tl.where(gm, tl.histogram(e, G_PAD), 0)
    tl.store(cnt_ptr + g, cnt, mask=gm)
    tl.store(offs_ptr + g, tl.cumsum(cnt, 0) - cnt, mask=gm)
    tl.store(cum_ptr + g, tl.cumsum((cnt + BLOCK_M - 1) // BLOCK_M, 0), mask=gm)


@jit
def _tile_expert(tile, cum_ptr, offs_ptr, cnt_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert owning ``tile`` (E when the tile is past the last one) and its row range."""
    ev = tl.arange(0, BLOCK_E)
    cum = tl.load(cum_ptr + ev, mask=ev < E, other=2147483647)
    e = tl.sum((cum <= tile).to(tl.int32), axis=0)  # experts whose tiles all precede this tile
    ec = tl.minimum(e, E - 1)
    first_tile = tl.load(cum_ptr + ec - 1, mask=ec > 0, other=0)
    start = tl.load(offs_ptr + ec)
    row0 = start + (tile - first_tile) * BLOCK_M
    row_end = start + tl.load(cnt_ptr + ec)
    return e, ec.to(tl.int64), row0, row_end


@jit
def _grouped_gate_up_kernel(x_ptr, order_ptr, cum_ptr, offs_ptr, cnt_ptr, w1_ptr, w3_ptr, ws1_ptr, ws3_ptr,
                            h_ptr, D, F, G, P, sx, s1e, s1f, s3e, s3f, ss1f, ss3f, sh, CD: tl.constexpr,
                            SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    # grid (max tiles, cdiv(F, BLOCK_F)); h rows are in group-sorted order; G groups (SHARED: the
    # last is the shared expert, ws1/ws3), P pairs per token. A row's bits do not depend on the
    # other rows of its tile or on its place there (each MMA row is its own sum).
    pdl_wait(PDL)  # the tile map is the kernel before's output
    e, ec, row0, row_end = _tile_expert(tl.program_id(0), cum_ptr, offs_ptr, cnt_ptr, G, BLOCK_M, BLOCK_E)
    if e < G:
        r = row0 + tl.arange(0, BLOCK_M)
        rm = r < row_end
        tok = tl.load(order_ptr + r, mask=rm, other=0).to(tl.int64) // P
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm = f < F
        d0 = tl.arange(0, BLOCK_D)
        w1e = w1_ptr + ec * s1e
        w3e = w3_ptr + ec * s3e
        if SHARED:  # scalar selects (a select of pointer tiles would lose their alignment)
            is_shared = ec == G - 1
            w1e = tl.where(is_shared, ws1_ptr, w1e)
            w3e = tl.where(is_shared, ws3_ptr, w3e)
            s1f = tl.where(is_shared, ss1f, s1f)
            s3f = tl.where(is_shared, ss3f, s3f)
        acc1 = tl.zeros([BLOCK_M, BLOCK_F], CD)
        acc3 = tl.zeros([BLOCK_M, BLOCK_F], CD)
        for k0 in range(0, D, BLOCK_D):
            d = k0 + d0
            dm = d < D
            a = tl.load(x_ptr + tok[:, None] * sx + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
            bm = dm[:, None] & fm[None, :]
            b1 = tl.load(w1e + f[None, :].to(tl.int64) * s1f + d[:, None], mask=bm, other=0.0)
            b3 = tl.load(w3e + f[None, :].to(tl.int64) * s3f + d[:, None], mask=bm, other=0.0)
            acc1 = tl.dot(a, b1, acc1, input_precision="ieee", out_dtype=CD)
            acc3 = tl.dot(a, b3, acc3, input_precision="ieee", out_dtype=CD)
        h = silu_f(acc1) * acc3
        tl.store(h_ptr + r[:, None].to(tl.int64) * sh + f[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & fm[None, :])


@jit
def _grouped_down_kernel(h_ptr, order_ptr, cum_ptr, offs_ptr, cnt_ptr, w2_ptr, ws2_ptr, out_ptr,
                         D, F, G, sh, s2e, s2d, ss2d, so, CD: tl.constexpr, SHARED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_DO: tl.constexpr, BLOCK_F: tl.constexpr,
                         BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    # grid (max tiles, cdiv(D, BLOCK_DO)); out[pair, d] (unsorted pair order, compute dtype). The
    # tile map is two kernels back (read before the wait); h, the kernel before's output, after it.
    e, ec, row0, row_end = _tile_expert(tl.program_id(0), cum_ptr, offs_ptr, cnt_ptr, G, BLOCK_M, BLOCK_E)
    pdl_wait(PDL)
    if e < G:
        r = row0 + tl.arange(0, BLOCK_M)
        rm = r < row_end
        pair = tl.load(order_ptr + r, mask=rm, other=0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
        dm = d < D
        f0 = tl.arange(0, BLOCK_F)
        w2e = w2_ptr + ec * s2e
        if SHARED:  # scalar selects (see the gate/up kernel)
            is_shared = ec == G - 1
            w2e = tl.where(is_shared, ws2_ptr, w2e)
            s2d = tl.where(is_shared, ss2d, s2d)
        acc = tl.zeros([BLOCK_M, BLOCK_DO], CD)
        for k0 in range(0, F, BLOCK_F):
            f = k0 + f0
            fm = f < F
            a = tl.load(h_ptr + r[:, None].to(tl.int64) * sh + f[None, :], mask=rm[:, None] & fm[None, :],
                        other=0.0)
            b = tl.load(w2e + d[None, :].to(tl.int64) * s2d + f[:, None], mask=fm[:, None] & dm[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=CD)
        tl.store(out_ptr + pair[:, None] * so + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])


@jit
def _combine_kernel(out_ptr, wts_ptr, y_ptr, D, KE, so, sy, CD: tl.constexpr, BLOCK_D: tl.constexpr,
                    ADD: tl.constexpr = False, SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
    # grid (T, cdiv(D, BLOCK_D)); y[t] = sum_k wts[t, k] * out[t * P + k], k ascending (P = k_e, or
    # k_e + 1 with SHARED); ADD: y[t] += that sum rounded to y's dtype (the bits of a torch add of
    # the two, one launch fewer); SHARED: the same add, of out[t * P + k_e] rounded to y's dtype
    # (the shared expert's output, as its DENSE down GEMV would have stored it)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    P = KE + 1 if SHARED else KE
    y = tl.zeros([BLOCK_D], CD)
    pdl_wait(PDL)
    for k in range(0, KE):
        pair = t * P + k
        y += tl.load(wts_ptr + t * KE + k).to(CD) * tl.load(out_ptr + pair * so + d, mask=dm, other=0.0).to(CD)
    y = y.to(y_ptr.dtype.element_ty)
    if SHARED:
        s = tl.load(out_ptr + (t * P + KE) * so + d, mask=dm, other=0.0).to(y_ptr.dtype.element_ty)
        y = (y.to(CD) + s.to(CD)).to(y_ptr.dtype.element_ty)
    elif ADD:
        y = (y.to(CD) + tl.load(y_ptr + t * sy + d, mask=dm, other=0.0).to(CD)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * sy + d, y, mask=dm)
