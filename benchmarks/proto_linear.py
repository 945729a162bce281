"""Prototype: a batch-invariant Triton linear (``y = x @ W.T``, bf16, fp32 accumulate) for the decode
step's projections, timed against torch (cuBLAS) at the model's shapes. Each row's result does not
depend on M (fixed BLOCK_M = 16 tiles, the dot computed as ``W_tile @ x_tile^T``), so a decode step
could run on exactly B rows instead of a padded 64-row tile.

    python benchmarks/proto_linear.py [--out linear.json]
    python benchmarks/proto_linear.py --smoke     # CPU (Triton interpreter): the row-invariance check
    python benchmarks/proto_linear.py --graph [--out linear-graph.json]   # one 64-row tile, in CUDA graphs

Measured (session 5, docs/BENCHMARKS.md): 6% faster than cuBLAS at B=1, twice as slow at B=64; not
adopted.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402,F401  (TRITON_INTERPRET=1 when there is no GPU)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (name, N, K, count per step at 48B)
SHAPES = [("kda.w_in", 12576, 2304, 20), ("kda.f_b/g_b", 4096, 128, 40), ("o_proj", 2304, 4096, 27),
          ("mla.w_in", 6720, 2304, 7), ("shared.gate_up", 2048, 2304, 26), ("shared.down", 2304, 1024, 26),
          ("dense.gate_up", 18432, 2304, 1), ("dense.down", 2304, 9216, 1), ("lm_head", 163840, 2304, 1)]


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, sy,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nm, mm = n < N, m < M
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb in range(0, K, BLOCK_K):
        k = kb + k0
        km = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        xt = tl.load(x_ptr + m[None, :].to(tl.int64) * sx + k[:, None], mask=km[:, None] & mm[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + m[None, :].to(tl.int64) * sy + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=nm[:, None] & mm[None, :])


def linear(x, w, bn, bk, warps, stages, bm=16):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)
    return y


def graph_us(calls) -> float:
    """Device us per call of ``calls`` (closures over distinct weights, so each reads its weight from
    HBM) captured back to back in one CUDA graph, as a decode step replays them."""
    from benchmarks.harness import bench, graphed

    replay = graphed(lambda: [c() for c in calls])
    return bench(replay)[0] * 1e3 / len(calls) if replay is not None else float("nan")


def in_graph(out: str | None) -> None:
    """``--graph``: each decode projection at the 64-row tile inside a CUDA graph: cuBLAS ``x @ W.T``,
    cuBLAS ``W @ x.T`` (the tile on the N side), and this kernel with one 64-row tile (the weight
    read once), best of a small sweep."""
    res, tot = [], {"torch": 0.0, "torch_t": 0.0, "ours": 0.0, "floor": 0.0}
    for name, N, K, cnt in SHAPES:
        copies = max(2, min(16, int(200e6 // (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(64, K, device="cuda", dtype=torch.bfloat16)
        t = graph_us([(lambda w=w: x @ w.T) for w in ws])
        tt = graph_us([(lambda w=w: w @ x.T) for w in ws])
        best = None
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)):
            try:
                us = graph_us([(lambda w=w: linear(x, w, bn, bk, warps, stages, bm=64)) for w in ws])
            except Exception:  # noqa: BLE001 (out of shared memory etc.)
                continue
            if us == us and (best is None or us < best[0]):
                best = (us, dict(BLOCK_N=bn, BLOCK_K=bk, warps=warps, stages=stages))
        floor = N * K * 2 / 4.3e12 * 1e6
        r = dict(name=name, N=N, K=K, count=cnt, floor_us=floor, torch_us=t, torch_t_us=tt,
                 ours_us=best[0], config=best[1])
        print(json.dumps(r), flush=True)
        res.append(r)
        for key, v in (("torch", t), ("torch_t", tt), ("ours", best[0]), ("floor", floor)):
            tot[key] += cnt * v
        del ws
    print("per-step totals in graphs (us):", {k: round(v, 1) for k, v in tot.items()})
    if out:
        Path(out).write_text(json.dumps({"results": res, "totals_us": tot}, indent=1))


def rows_invariant(M: int = 20, N: int = 48, K: int = 96, dtype=torch.float32, device="cpu") -> bool:
    """Each row of an M-row product has the bits of that row computed alone (the kernel's claim)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device, dtype)
    y = linear(x, w, 16, 32, 4, 3)
    return all(torch.equal(linear(x[i:i + 1], w, 16, 32, 4, 3)[0], y[i]) for i in (0, 7, M - 1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: the row-invariance check only")
    ap.add_argument("--graph", action="store_true", help="the 64-row tile inside CUDA graphs (see in_graph)")
    args = ap.parse_args(argv)
    if args.smoke:
        print("rows bitwise independent of M:", rows_invariant())
        return
    if not torch.cuda.is_available():
        sys.exit("proto_linear.py: timing needs a CUDA GPU (none here); --smoke runs the CPU check")
    if args.graph:
        return in_graph(args.out)
    from triton.testing import do_bench
    dev = "cuda"
    res = []
    tot = {"torch64": 0.0, "torch1": 0.0, "ours1": 0.0, "ours64": 0.0, "floor": 0.0}
    for name, N, K, cnt in SHAPES:
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
        x64 = torch.randn(64, K, device=dev, dtype=torch.bfloat16)
        x1 = x64[:1].clone()
        t64 = do_bench(lambda: x64 @ w.T, warmup=5, rep=40) * 1e3
        t1 = do_bench(lambda: x1 @ w.T, warmup=5, rep=40) * 1e3
        floor = N * K * 2 / 4.3e12 * 1e6
        best = None
        for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4)):
            if bn * bk > 128 * 256:
                continue
            try:
                us = do_bench(lambda: linear(x1, w, bn, bk, warps, stages), warmup=3, rep=15) * 1e3
            except Exception:  # noqa: BLE001 (out of shared memory etc.)
                continue
            if best is None or us < best[0]:
                best = (us, bn, bk, warps, stages)
        us1, bn, bk, warps, stages = best
        us64 = do_bench(lambda: linear(x64, w, bn, bk, warps, stages), warmup=5, rep=40) * 1e3
        y = linear(x64, w, bn, bk, warps, stages)
        rows_equal = all(torch.equal(linear(x64[i:i + 1], w, bn, bk, warps, stages)[0], y[i]) for i in (0, 17, 63))
        err = ((y.float() - (x64.float() @ w.float().T)).abs().max() / (x64.float() @ w.float().T).abs().max()).item()
        r = dict(name=name, N=N, K=K, count=cnt, floor_us=floor, torch_M64_us=t64, torch_M1_us=t1,
                 ours_M1_us=us1, ours_M64_us=us64, config=dict(BLOCK_N=bn, BLOCK_K=bk, warps=warps, stages=stages),
                 rows_bitwise_M_invariant=rows_equal, rel_err=err)
        print(json.dumps(r), flush=True)
        res.append(r)
        for key, v in (("torch64", t64), ("torch1", t1), ("ours1", us1), ("ours64", us64), ("floor", floor)):
            tot[key] += cnt * v
    print("per-step totals (us):", {k: round(v, 1) for k, v in tot.items()})
    if args.out:
        Path(args.out).write_text(json.dumps({"results": res, "totals_us": tot}, indent=1))


if __name__ == "__main__":
    main()
