"""MLA attention kernels: one flash-attention kernel for both MLA forms, plus a split combiner and
the paged-cache writer.

``_mla_attn_kernel`` computes, for each query row (b, t, h) at position ``S_b - T + t``,
``softmax_s(scale * (q1 . k1_s + q2 . k2_s)) @ v`` over keys ``s <= S_b - T + t`` (and ``s < S_b``):

* absorbed form (``SHARED_KV``): q1 = ``q_lat`` [L], k1 = v = the latent ``c_s`` [L], q2 = ``q_pe``,
  k2 = ``k_pe_s``: MQA with one 576-wide key and the latent as value, shared by every head. All
  ``T * N`` query rows of a sequence share each loaded latent tile, which serves as key *and* value
  (the cache is read once per row block).
* naive form: per-head keys ``[k_nope_h ; k_pe]`` and values ``v_h`` (one head per program).

Online softmax in the compute dtype (fp32, fp64 for fp64 runs); probabilities are cast to the value
dtype for the PV product (bf16 in production, as FlashAttention does). Flash-decoding: the key range
of a sequence of length ``S_b`` is cut into ``n = _num_slices(S_b, split_keys, max_splits)`` slices
(``cdiv(S_b, split_keys)`` clamped to ``[1, max_splits]``: ``split_keys = 1`` gives a fixed count
``max_splits``) of ``cdiv(cdiv(S_b, n), BLOCK_N) * BLOCK_N`` keys; each program writes its
unnormalized partial ``(acc, m, l)`` and an epilogue kernel merges the slices in ascending order:
``_mla_combine_uv_kernel`` for the absorbed form (merge, then the W_UV product, fused; one program
per Vh chunk, each redoing the cheap merge, to spread the W_UV read over more SMs at small batch),
``_mla_combine_kernel`` for the naive form (which stores directly when there is one slice). Slice
boundaries depend only on ``S_b``, ``split_keys``, ``max_splits`` and ``BLOCK_N``, never on the
memory layout or the batch, so the paged cache (``PAGED``: key position -> block table -> physical
row) reduces in exactly the contiguous order, and a sequence in any batch in the same order.
"""
from __future__ import annotations

import triton.language as tl

from .._jit import jit
from .._pdl import pdl_launch_next, pdl_wait, prefetch_l2


@jit
def _num_slices(S_b, split_keys, max_splits):
    """Key slices of a sequence of length S_b: cdiv(S_b, split_keys), clamped to [1, max_splits]. A
    function of the sequence's own length only (max_splits never binds below what the batch's
    largest capacity allows, see ``_attend``), so its bits never depend on its batch."""
    return tl.minimum(tl.maximum(tl.cdiv(S_b, split_keys), 1), max_splits)


@jit
def _slice_len(S_b, n_split, BLOCK_N: tl.constexpr):
    """Keys per slice of a sequence of S_b keys cut into n_split slices: whole steps of BLOCK_N."""
    return tl.cdiv(tl.cdiv(S_b, n_split), BLOCK_N) * BLOCK_N


@jit
def _load_tile(rows, cols, n_cols, rows_ok, ROW_MASK: tl.constexpr, EVEN: tl.constexpr):
    """Load the tile ``rows[:, None] + cols[None, :]`` (row pointers, column offsets); rows not
    ``rows_ok`` (when ROW_MASK) and columns ``>= n_cols`` (unless EVEN: there are none) read as 0.
    With neither mask the load carries no predicate."""
    ptrs = rows[:, None] + cols[None, :]
    if ROW_MASK and EVEN:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif ROW_MASK:
        return tl.load(ptrs, mask=rows_ok[:, None] & (cols < n_cols)[None, :], other=0.0)
    elif EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(cols < n_cols)[None, :], other=0.0)


@jit
def _prefetch_keys(kv_ptr, bt_ptr, slen_ptr, b, split, S, ROW, block_size, split_keys, max_splits, skv,
                   sbtb, VAR_LEN: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefetch into L2 the paged rows (ROW elements each, 2-byte) of the first STEPS steps of this
    program's key slice, from the sequence length and block table as they read now (a hint: see
    ``prefetch_l2``)."""
    if VAR_LEN:
        S_b = tl.load(slen_ptr + b).to(tl.int32)
    else:
        S_b = S
    n_split = _num_slices(S_b, split_keys, max_splits)
    split_len = _slice_len(S_b, n_split, BLOCK_N)
    start = split * split_len
    line = tl.minimum(tl.arange(0, 16) * 64, ROW - 1)  # a 128-byte line's first element; 16 >= ROW / 64
    for i in tl.static_range(STEPS):
        s0 = start + i * BLOCK_N
        if (split < n_split) & (s0 < tl.minimum(start + split_len, S_b)):
            blk = tl.load(bt_ptr + b * sbtb + s0 // block_size).to(tl.int64)
            row = blk * block_size + s0 % block_size + tl.arange(0, BLOCK_N)
            prefetch_l2(kv_ptr + row[:, None] * skv + line[None, :], True)


@jit
def _slice_range(S_b, n_split, rb, split, T, HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end): an attention program's keys, its slice of the sequence's S_b keys cut at the
    program's last query position."""
    split_len = _slice_len(S_b, n_split, BLOCK_N)
    start = split * split_len
    last_pos = S_b - T + tl.minimum(rb * BLOCK_M + BLOCK_M - 1, T * HP - 1) // HP
    end = tl.minimum(tl.minimum(start + split_len, S_b), last_pos + 1)
    return start, end


@jit
def _mla_attn_kernel(
        q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, o_ptr, pacc_ptr, pml_ptr, bt_ptr, slen_ptr,
        T, S, N, D1, R, DV, block_size, split_keys, max_splits, scale: tl.float64,
        sq1b, sq1t, sq1h, sq2b, sq2t, sq2h,
        sk1b, sk1s, sk1h, sk2b, sk2s, svb, svs, svh,
        sob, sot, soh, sbtb,
        HP: tl.constexpr, SHARED_KV: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
        VAR_LEN: tl.constexpr, DIRECT: tl.constexpr, EVEN_D: tl.constexpr, ROW_MASK: tl.constexpr,
        CD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
        EARLY: tl.constexpr = False):
    # grid (B, (N // HP) * cdiv(T * HP, BLOCK_M), max_splits). Rows of a program: r -> t = r // HP,
    # h = hg * HP + r % HP. HP = N (absorbed: all heads share K/V) or 1 (naive: per-head K/V).
    # EVEN_D: D1, R and DV equal their blocks, so the key and value tiles load without column masks.
    # PREFETCH (paged, page-aligned, shared form, with PDL): steps of keys prefetched into L2 first.
    b = tl.program_id(0).to(tl.int64)
    n_rb = tl.cdiv(T * HP, BLOCK_M)
    hg = tl.program_id(1) // n_rb
    rb = tl.program_id(1) % n_rb
    split = tl.program_id(2)
    if PREFETCH > 0:  # the slice's first key rows into L2 while the kernel before still runs
        _prefetch_keys(k1_ptr, bt_ptr, slen_ptr, b, split, S, D1 + R, block_size, split_keys, max_splits,
                       sk1s, sbtb, VAR_LEN, PREFETCH, BLOCK_N)
    # EARLY (one-wave grids): the sequence length, the slice's range and its first block-table entry
    # are read before the PDL wait, which the _pdl rule allows (the kernel just before, q_lat in a
    # paged decode, writes neither), so that after the wait only q and the keys are a memory latency
    # away. Bit-neutral. Not in grids of several waves, whose later programs start after the wait
    # anyway: there the reordered prologue is slower, so they keep the order below. The PREFETCH
    # hints above load the length and first table entry on their own: handed these values, they
    # would issue after both loads and lose their gain. Figures and commands: docs/BENCHMARKS.md,
    # "MLA decode".
    if EARLY:
        if VAR_LEN:
            S_b = tl.load(slen_ptr + b).to(tl.int32)
        else:
            S_b = S
        n_split = _num_slices(S_b, split_keys, max_splits)
        start, end = _slice_range(S_b, n_split, rb, split, T, HP, BLOCK_M, BLOCK_N)
        if PAGED and PAGE_ALIGNED:
            nxt = tl.load(bt_ptr + b * sbtb + start // block_size, mask=start < end, other=0)
    # PDL: the epilogue may launch only once every program is past its key loop: launched at the
    # start, its programs would sit on the SMs through the last wave (docs/BENCHMARKS.md, "MLA
    # decode")
    pdl_wait(PDL, LAUNCH_NEXT=False)
    if EARLY:
        if (split >= n_split) | (S_b == 0):  # see below
            return
    else:
        if VAR_LEN:
            S_b = tl.load(slen_ptr + b).to(tl.int32)
            if S_b == 0:  # an idle row (decode padding): no partials; the epilogue writes zeros
                return
        else:
            S_b = S
        n_split = _num_slices(S_b, split_keys, max_splits)
        if split >= n_split:  # past this sequence's slices: no partials, the merge reads n_split of them
            return
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < T * HP
    t = r // HP
    h = (hg * HP + r % HP).to(tl.int64)
    t64 = t.to(tl.int64)
    pos = S_b - T + t  # query position; key s is visible iff s <= pos

    d1 = tl.arange(0, BLOCK_D1)
    dr = tl.arange(0, BLOCK_R)
    q1 = tl.load(q1_ptr + b * sq1b + t64[:, None] * sq1t + h[:, None] * sq1h + d1[None, :],
                 mask=rmask[:, None] & (d1 < D1)[None, :], other=0.0)
    q2 = tl.load(q2_ptr + b * sq2b + t64[:, None] * sq2t + h[:, None] * sq2h + dr[None, :],
                 mask=rmask[:, None] & (dr < R)[None, :], other=0.0)
    hoff = hg.to(tl.int64) * (1 - SHARED_KV)  # per-head K/V offset (0 in the shared form)

    if not EARLY:
        start, end = _slice_range(S_b, n_split, rb, split, T, HP, BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), CD)
    l_i = tl.zeros([BLOCK_M], CD)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], CD)
    sc = tl.full([BLOCK_M, BLOCK_N], scale, CD)
    dv = tl.arange(0, BLOCK_DV)
    if PAGED and PAGE_ALIGNED and not EARLY:
        nxt = tl.load(bt_ptr + b * sbtb + start // block_size, mask=start < end, other=0)
    for s0 in range(start, end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        smask = s < end
        # ROW_MASK: keys past the end load as 0. Otherwise they load key end - 1's row (in the
        # step's page when PAGE_ALIGNED), finite, and the scores mask them (p = 0): the same bits,
        # and loads without row predicates (in the sm_90 build the masks' selects and compares
        # were a fifth of the step's instructions)
        if ROW_MASK:
            j_ld = tl.arange(0, BLOCK_N)
        else:
            j_ld = tl.minimum(tl.arange(0, BLOCK_N), end - 1 - s0)
        s_ld = s0 + j_ld
        if PAGED:
            if PAGE_ALIGNED:  # the BLOCK_N keys lie in one page: one table entry, read a step ahead
                blk = nxt.to(tl.int64)
                nxt = tl.load(bt_ptr + b * sbtb + (s0 + BLOCK_N) // block_size, mask=s0 + BLOCK_N < end,
                              other=0)
                row = blk * block_size + s0 % block_size + j_ld
            else:  # an entry per key (a [BLOCK_N] vector read a step ahead spills: sm_90, triton 3.9)
                if ROW_MASK:
                    blk = tl.load(bt_ptr + b * sbtb + s // block_size, mask=smask, other=0).to(tl.int64)
                else:
                    blk = tl.load(bt_ptr + b * sbtb + s_ld // block_size).to(tl.int64)
                row = blk * block_size + s_ld % block_size
            k1row = k1_ptr + row * sk1s
            k2row = k2_ptr + row * sk2s
            vrow = v_ptr + row * svs
        else:
            s64 = s_ld.to(tl.int64)
            k1row = k1_ptr + b * sk1b + s64 * sk1s + hoff * sk1h
            k2row = k2_ptr + b * sk2b + s64 * sk2s
            vrow = v_ptr + b * svb + s64 * svs + hoff * svh
        k1 = _load_tile(k1row, d1, D1, smask, ROW_MASK, EVEN_D)
        k2 = _load_tile(k2row, dr, R, smask, ROW_MASK, EVEN_D)
        qk = tl.dot(q1, tl.trans(k1), input_precision="ieee", out_dtype=CD)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision="ieee", out_dtype=CD)
        visible = smask[None, :] & (s[None, :] <= pos[:, None])
        qk = tl.where(visible, qk * sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SHARED_KV:
            vt = k1  # the latent is the value: same tile
        else:
            vt = _load_tile(vrow, dv, DV, smask, ROW_MASK, EVEN_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision="ieee", out_dtype=CD)
        m_i = m_new

    pdl_launch_next(PDL)
    omask = rmask[:, None] & (dv < DV)[None, :]
    if DIRECT:  # one slice and no epilogue kernel: normalize and store the output here
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + t64[:, None] * sot + h[:, None] * soh + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        # partials [B, max_splits, T, N, DV] and [B, max_splits, T, N, 2], contiguous
        prow = ((b * max_splits + split) * T + t64) * N + h
        tl.store(pacc_ptr + prow[:, None] * DV + dv[None, :], acc, mask=omask)
        tl.store(pml_ptr + prow * 2, m_i, mask=rmask)
        tl.store(pml_ptr + prow * 2 + 1, l_i, mask=rmask)


@jit
def _mla_combine_kernel(pacc_ptr, pml_ptr, o_ptr, T, S, N, DV, sob, sot, soh, split_keys, max_splits,
                        CD: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False):
    # grid (B * T * N, cdiv(DV, BLOCK_DV)); o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # (b * T + t) * N + h
    h = row % N
    bt = row // N
    b = bt // T
    t = bt % T
    dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dmask = dv < DV
    n_split = _num_slices(S, split_keys, max_splits)
    stride_split = T * N
    base = b * max_splits * stride_split + t * N + h
    m_max = tl.load(pml_ptr + base * 2)
    for sp in range(1, n_split):
        m_max = tl.maximum(m_max, tl.load(pml_ptr + (base + sp * stride_split) * 2))
    num = tl.zeros([BLOCK_DV], CD)
    den = tl.sum(tl.zeros([1], CD), axis=0)
    for sp in range(0, n_split):
        prow = base + sp * stride_split
        wsp = tl.exp(tl.load(pml_ptr + prow * 2) - m_max)  # 0 for an empty slice (m = -inf)
        num += wsp * tl.load(pacc_ptr + prow * DV + dv, mask=dmask, other=0.0)
        den += wsp * tl.load(pml_ptr + prow * 2 + 1)
    o = num / den
    tl.store(o_ptr + b * sob + t * sot + h * soh + dv, o.to(o_ptr.dtype.element_ty), mask=dmask)


@jit
def _paged_write_kernel(lat_ptr, kpe_ptr, slot_ptr, kv_ptr, L, R, slat, skpe, skv,
                        BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    # grid (n,): kv[slot[i], :L] = latent[i]; kv[slot[i], L:L+R] = k_pe[i]; slot < 0 = padding
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    ok_l = (dl < L) & ((tl.zeros([BLOCK_L], tl.int64) + slot) >= 0)
    ok_r = (dr < R) & ((tl.zeros([BLOCK_R], tl.int64) + slot) >= 0)
    slot = tl.maximum(slot, 0)
    lat = tl.load(lat_ptr + i * slat + dl, mask=ok_l, other=0.0)
    tl.store(kv_ptr + slot * skv + dl, lat.to(kv_ptr.dtype.element_ty), mask=ok_l)
    kpe = tl.load(kpe_ptr + i * skpe + dr, mask=ok_r, other=0.0)
    tl.store(kv_ptr + slot * skv + L + dr, kpe.to(kv_ptr.dtype.element_ty), mask=ok_r)


@jit
def _mla_combine_uv_kernel(pacc_ptr, pml_ptr, wuv_ptr, o_ptr, slen_ptr, BT, T, S, N, L, VH, swh, swv,
                           sob, sot, soh, split_keys, max_splits, VAR_LEN: tl.constexpr,
                           CD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
                           BLOCK_V: tl.constexpr, BLOCK_SP: tl.constexpr, MERGE_UNROLL: tl.constexpr,
                           PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           EARLY: tl.constexpr = False):
    # grid (cdiv(VH, BLOCK_V), N, cdiv(B*T, BLOCK_R)). For BLOCK_V output columns v, head h and
    # BLOCK_R query rows (b, t): merge each row's slices (``_num_slices`` of its own length; BLOCK_SP
    # >= max_splits), o_lat = sum_s e^(m_s - M) acc_s /
    # sum_s e^(m_s - M) l_s (slices in ascending order), round o_lat to W_UV's dtype, then
    # o = o_lat @ W_UV[h, v]^T (one tl.dot over the full L, CD accumulation), stored in
    # [B, T, N, Vh]. Fuses the split merge, the W_UV GEMM and the output layout: one launch. The Vh
    # chunks are separate programs so the W_UV read spreads over more SMs at small batch; each
    # redoes the cheap merge (bitwise the same), and they are adjacent in launch order so they
    # share the partials through L2. BLOCK_R < 16 (a small batch): the merge runs on the live rows
    # only, and the dot on 16 rows, those rows repeated (a row's dot never depends on the others).
    DOT_M: tl.constexpr = 16 if BLOCK_R < 16 else BLOCK_R
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < BT
    b = (r // T).to(tl.int64)
    t = (r % T).to(tl.int64)
    vmask = v < VH
    lo = tl.arange(0, BLOCK_L)
    lmask = lo < L
    # W_UV is read after the merge, not before the wait: held through the merge, its tile costs
    # registers the merge needs (docs/BENCHMARKS.md, "MLA decode"). PREFETCH: its lines into L2
    # before the wait instead.
    if PREFETCH:
        tl.static_assert(BLOCK_L % 64 == 0)
        vc = tl.minimum(v, VH - 1)
        prefetch_l2(wuv_ptr + h * swh + vc[:, None] * swv + (tl.arange(0, BLOCK_L // 64) * 64)[None, :], True)
    # EARLY: the sequence lengths before the wait (the _pdl rule allows it: the attention just
    # before does not write them)
    if VAR_LEN and EARLY:
        S_r = tl.load(slen_ptr + b, mask=rmask, other=0)
    pdl_wait(PDL)
    # live rows: an idle row (sequence length 0, decode padding) has no partials and gets zeros
    live = rmask
    if VAR_LEN:
        if not EARLY:
            S_r = tl.load(slen_ptr + b, mask=rmask, other=0)
        live = rmask & (S_r > 0)
        if tl.max(live.to(tl.int32), axis=0) == 0:  # all padding: zeros, W_UV not read
            tl.store(o_ptr + b[:, None] * sob + t[:, None] * sot + h * soh + v[None, :],
                     tl.zeros([BLOCK_R, BLOCK_V], o_ptr.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])
            return
    else:
        S_r = tl.zeros([BLOCK_R], tl.int32) + S
    n_split = _num_slices(S_r, split_keys, max_splits)  # per row: its sequence's slices
    stride_split = T * N
    base = (b * max_splits * T + t) * N + h  # partial row of slice 0
    # M: the max of every slice's m, read as one tile (a row's slices past its own count: -inf)
    spo = tl.arange(0, BLOCK_SP)
    m_all = tl.load(pml_ptr + (base[:, None] + spo[None, :] * stride_split) * 2,
                    mask=live[:, None] & (spo[None, :] < n_split[:, None]), other=float("-inf"))
    m_max = tl.where(live, tl.max(m_all, axis=1), 0.0)
    num = tl.zeros([BLOCK_R, BLOCK_L], CD)
    den = tl.zeros([BLOCK_R], CD)
    n_max = tl.max(tl.where(live, n_split, 1), axis=0)
    # the sums run slice by slice in ascending order, as written: a tl.sum over the tile groups its
    # terms (and may contract them into FMAs) as the tile's layout spreads them, i.e. by BLOCK_SP,
    # which follows the batch's capacity, not the sequence. Each slice's (m, l) is loaded again
    # (an L2 hit): taking a column out of the tile is a cross-lane reduction per slice.
    # MERGE_UNROLL slices' loads in flight.
    for sp0 in range(0, n_max, MERGE_UNROLL):
        for j in tl.static_range(MERGE_UNROLL):
            sp = sp0 + j
            prow = base + sp * stride_split
            has = live & (sp < n_split)
            wsp = tl.exp(tl.load(pml_ptr + prow * 2, mask=has, other=float("-inf")) - m_max)  # 0: absent
            lsp = tl.load(pml_ptr + prow * 2 + 1, mask=has, other=0.0)
            num += wsp[:, None] * tl.load(pacc_ptr + prow[:, None] * L + lo[None, :],
                                          mask=has[:, None] & lmask[None, :], other=0.0)
            den += wsp * lsp
    o_lat = tl.where(live[:, None], num / tl.where(live, den, 1.0)[:, None], 0.0).to(wuv_ptr.dtype.element_ty)
    if BLOCK_R < DOT_M:  # row i of the dot is o_lat row i % BLOCK_R
        o_lat = tl.reshape(tl.broadcast_to(o_lat[None, :, :], (DOT_M // BLOCK_R, BLOCK_R, BLOCK_L)),
                           (DOT_M, BLOCK_L))
    wt = tl.load(wuv_ptr + h * swh + v[None, :].to(tl.int64) * swv + lo[:, None],
                 mask=lmask[:, None] & vmask[None, :], other=0.0)  # [BLOCK_L, BLOCK_V] = W_UV[h]^T
    o = tl.dot(o_lat, wt, input_precision="ieee", out_dtype=CD)
    i = tl.arange(0, DOT_M)  # the dot's first BLOCK_R rows are the program's rows
    ro = tl.program_id(2) * BLOCK_R + i
    bo = (ro // T).to(tl.int64)
    to = (ro % T).to(tl.int64)
    tl.store(o_ptr + bo[:, None] * sob + to[:, None] * sot + h * soh + v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=((i < BLOCK_R) & (ro < BT))[:, None] & vmask[None, :])


@jit
def _q_lat_kernel(q_ptr, w_ptr, o_ptr, M, P, L, sqm, sqh, swh, swp, som, soh,
                  CD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_L: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    # grid (N, cdiv(M, BLOCK_M), cdiv(L, BLOCK_L)): o[m, h, l] = q[m, h, :] @ W_UK[h][:, l] ([P, L]),
    # CD accumulation. A fixed tile and a fixed P order (BLOCK_P chunks, ascending) for every output
    # element: a row's result never depends on the other rows (batch invariance, which a library
    # GEMM choosing its algorithm from M does not give). The L tiles are separate programs only to
    # spread the W_UK read (P x L per head) over more SMs when M is small (decode).
    h = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < M
    lo = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    lm = lo < L
    po = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_M, BLOCK_L], CD)
    if PREFETCH > 0:  # this program's W_UK lines into L2 while the kernel before still runs
        tl.static_assert(BLOCK_L % 64 == 0)
        pc = tl.minimum(tl.arange(0, PREFETCH), P - 1)  # PREFETCH: a power of two >= P
        lc = tl.minimum(tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L // 64) * 64, L - 1)
        prefetch_l2(w_ptr + h * swh + pc[:, None].to(tl.int64) * swp + lc[None, :], True)
    pdl_wait(PDL)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + po
        pm = p < P
        qt = tl.load(q_ptr + m[:, None].to(tl.int64) * sqm + h * sqh + p[None, :],
                     mask=mm[:, None] & pm[None, :], other=0.0)
        wt = tl.load(w_ptr + h * swh + p[:, None].to(tl.int64) * swp + lo[None, :],
                     mask=pm[:, None] & lm[None, :], other=0.0)
        acc = tl.dot(qt, wt, acc, input_precision="ieee", out_dtype=CD)
    tl.store(o_ptr + m[:, None].to(tl.int64) * som + h * soh + lo[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=mm[:, None] & lm[None, :])
