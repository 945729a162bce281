"""Prototype: the absorbed MLA decode's attention step with its q.k product as independent partial
products (the latent's two halves and the rope part: three MMA chains of 16, 16 and 4 k-steps
instead of one of 36), timed against the kernel on main by CUDA-graph replay (paged cache, the
48B model's sizes). Only the paged, shared-KV (absorbed) path. Not a test: bits differ from main's
(the q.k sum is associated differently); the accuracy against an fp64 evaluation is printed.

    python benchmarks/proto_mla.py [--shapes 1x4096 1x32768 64x4096] [--warps 4 8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import bench, graphed, kernel_profile  # noqa: E402
from optimized._pdl import pdl_launch_next, pdl_wait  # noqa: E402
from optimized.mla.kernels import _num_slices, _prefetch_keys  # noqa: E402


@triton.jit
def _attn_split_kernel(
        q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, o_ptr, pacc_ptr, pml_ptr, bt_ptr, slen_ptr,
        T, S, N, D1, R, DV, block_size, split_keys, max_splits, scale: tl.float64,
        sq1b, sq1t, sq1h, sq2b, sq2t, sq2h,
        sk1b, sk1s, sk1h, sk2b, sk2s, svb, svs, svh,
        sob, sot, soh, sbtb,
        HP: tl.constexpr, SHARED_KV: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
        VAR_LEN: tl.constexpr, DIRECT: tl.constexpr, EVEN_D: tl.constexpr, ROW_MASK: tl.constexpr,
        CD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    tl.static_assert(SHARED_KV and PAGED and PAGE_ALIGNED and VAR_LEN and EVEN_D and not DIRECT)
    HALF: tl.constexpr = BLOCK_D1 // 2
    b = tl.program_id(0).to(tl.int64)
    n_rb = tl.cdiv(T * HP, BLOCK_M)
    hg = tl.program_id(1) // n_rb
    rb = tl.program_id(1) % n_rb
    split = tl.program_id(2)
    if PREFETCH > 0:
        _prefetch_keys(k1_ptr, bt_ptr, slen_ptr, b, split, S, D1 + R, block_size, split_keys, max_splits,
                       sk1s, sbtb, VAR_LEN, PREFETCH, BLOCK_N)
    pdl_wait(PDL, LAUNCH_NEXT=False)
    S_b = tl.load(slen_ptr + b).to(tl.int32)
    if S_b == 0:
        return
    n_split = _num_slices(S_b, split_keys, max_splits)
    if split >= n_split:
        return
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < T * HP
    t = r // HP
    h = (hg * HP + r % HP).to(tl.int64)
    t64 = t.to(tl.int64)
    pos = S_b - T + t
    dh = tl.arange(0, HALF)
    dr = tl.arange(0, BLOCK_R)
    q1p = q1_ptr + b * sq1b + t64[:, None] * sq1t + h[:, None] * sq1h + dh[None, :]
    q1a = tl.load(q1p, mask=rmask[:, None], other=0.0)
    q1b = tl.load(q1p + HALF, mask=rmask[:, None], other=0.0)
    q2 = tl.load(q2_ptr + b * sq2b + t64[:, None] * sq2t + h[:, None] * sq2h + dr[None, :],
                 mask=rmask[:, None] & (dr < R)[None, :], other=0.0)
    split_len = tl.cdiv(tl.cdiv(S_b, n_split), BLOCK_N) * BLOCK_N
    start = split * split_len
    last_pos = S_b - T + tl.minimum(rb * BLOCK_M + BLOCK_M - 1, T * HP - 1) // HP
    end = tl.minimum(tl.minimum(start + split_len, S_b), last_pos + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), CD)
    l_i = tl.zeros([BLOCK_M], CD)
    acc_a = tl.zeros([BLOCK_M, HALF], CD)
    acc_b = tl.zeros([BLOCK_M, HALF], CD)
    sc = tl.full([BLOCK_M, BLOCK_N], scale, CD)
    nxt = tl.load(bt_ptr + b * sbtb + start // block_size, mask=start < end, other=0)
    for s0 in range(start, end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        smask = s < end
        if ROW_MASK:
            j_ld = tl.arange(0, BLOCK_N)
        else:
            j_ld = tl.minimum(tl.arange(0, BLOCK_N), end - 1 - s0)
        blk = nxt.to(tl.int64)
        nxt = tl.load(bt_ptr + b * sbtb + (s0 + BLOCK_N) // block_size, mask=s0 + BLOCK_N < end, other=0)
        row = blk * block_size + s0 % block_size + j_ld
        k1row = k1_ptr + row * sk1s
        if ROW_MASK:
            k1a = tl.load(k1row[:, None] + dh[None, :], mask=smask[:, None], other=0.0)
            k1b = tl.load(k1row[:, None] + HALF + dh[None, :], mask=smask[:, None], other=0.0)
            k2 = tl.load((k2_ptr + row * sk2s)[:, None] + dr[None, :], mask=smask[:, None], other=0.0)
        else:
            k1a = tl.load(k1row[:, None] + dh[None, :])
            k1b = tl.load(k1row[:, None] + HALF + dh[None, :])
            k2 = tl.load((k2_ptr + row * sk2s)[:, None] + dr[None, :])
        # two independent MMA chains (the first half and the rope part: 20 k-steps; the second half: 16)
        qa = tl.dot(q2, tl.trans(k2), tl.dot(q1a, tl.trans(k1a), input_precision="ieee", out_dtype=CD),
                    input_precision="ieee", out_dtype=CD)
        qk = qa + tl.dot(q1b, tl.trans(k1b), input_precision="ieee", out_dtype=CD)
        visible = smask[None, :] & (s[None, :] <= pos[:, None])
        qk = tl.where(visible, qk * sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pb = p.to(k1a.dtype)
        acc_a = tl.dot(pb, k1a, acc_a * alpha[:, None], input_precision="ieee", out_dtype=CD)
        acc_b = tl.dot(pb, k1b, acc_b * alpha[:, None], input_precision="ieee", out_dtype=CD)
        m_i = m_new
    pdl_launch_next(PDL)
    prow = ((b * max_splits + split) * T + t64) * N + h
    pa = pacc_ptr + prow[:, None] * DV + dh[None, :]
    tl.store(pa, acc_a, mask=rmask[:, None])
    tl.store(pa + HALF, acc_b, mask=rmask[:, None])
    tl.store(pml_ptr + prow * 2, m_i, mask=rmask)
    tl.store(pml_ptr + prow * 2 + 1, l_i, mask=rmask)


def reference(case) -> torch.Tensor:
    """fp64 absorbed decode of the case (torch on the GPU): o [B, N, Vh]."""
    from benchmarks.tune_mla import L, N, P
    B = case.B
    o = []
    wk = case.w_kvb.double().view(N, -1, L)
    for b in range(B):
        lat, kpe = case.cache.gather(case.tables[b], int(case.lens[b]))
        q = case.q[b].double()
        q_lat = torch.einsum("np,npl->nl", q[:, :P], wk[:, :P])
        s = (q_lat @ lat.double().T + q[:, P:] @ kpe.double().T) * (q.shape[-1]) ** -0.5
        a = torch.softmax(s, -1) @ lat.double()
        o.append(torch.einsum("nl,nvl->nv", a, wk[:, P:]))
    return torch.stack(o)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "1x32768", "64x4096"])
    ap.add_argument("--kernels", nargs="*", default=["main", "split"], choices=["main", "split"])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--save", help="save the default setting's outputs (torch.save) to compare across trees")
    ap.add_argument("--compare", help="compare the default setting's outputs with a --save file, bit for bit")
    args = ap.parse_args(argv)
    import optimized.mla as mla
    from benchmarks.tune_mla import Case, profile_line

    main_kernel = mla._mla_attn_kernel
    kernels = {"main": main_kernel, "split": _attn_split_kernel}
    g = torch.Generator(device="cuda").manual_seed(0)
    saved = {}
    other = torch.load(args.compare) if args.compare else {}
    for shape in args.shapes:
        B, S = map(int, shape.split("x"))
        case = Case(B, S, g)
        ref = reference(case) if B <= 8 else None
        for name in args.kernels:
            mla._mla_attn_kernel = kernels[name]
            base = None
            for launch in [{"num_warps": w} for w in args.warps] + [{"BLOCK_M": 32 if B < 8 else 16, "num_warps": 4},
                                                                  {"BLOCK_M": 32, "num_warps": 8}]:
                ms, out, replay = case.timed(None, launch)
                if base is None:
                    base = out
                    if name == "main":
                        saved[shape] = out.cpu()
                        if shape in other:
                            print(f"B={B} S={S} main vs --compare: "
                                  f"{'BITWISE EQUAL' if torch.equal(other[shape], saved[shape]) else 'BITS DIFFER'}")
                err = "" if ref is None else \
                    f" max|err|/max|o| {((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}"
                print(f"B={B} S={S} {name} {launch}: {ms * 1e3:.1f} us {ms / case.floor_ms:.2f}x{err} "
                      f"{'same bits' if torch.equal(out, base) else 'BITS DIFFER'} ({profile_line(replay)})", flush=True)
        mla._mla_attn_kernel = main_kernel
        mla._TUNE.clear()
        del case
        torch.cuda.empty_cache()
    if args.save:
        torch.save(saved, args.save)


if __name__ == "__main__":
    main()
