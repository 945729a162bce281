"""What a decode kernel chain costs before it computes anything, on this GPU: CUDA-graph replay time
of n empty Triton launches in a row (n = 1, 2, 3; with and without programmatic dependent launch),
and of one kernel that only reads a B=1 MLA latent cache ([S, 576] bf16, S = 4096 and 32768) and
sums it, alone and with as many more rows as the op's weights (w_kvb, [32 * 256, 512] bf16: W_UK and
W_UV) take: every byte the op's floor counts, in one launch. ``--chain n`` also times n of those
reads, and n ``mla.paged_decode`` calls at B=1, back to back in one graph, each on its own cache
and weights (as a model's MLA layers are): the per-call cost once the graph's own launch is
shared, which is how the op runs inside a decode step. Read against ``mla.paged_decode`` at B=1 (three launches: q_lat, attention, merge + W_UV),
they say how much of its time no kernel body can remove, and how close a single launch gets to
the bytes / 4.3 TB/s floor at these sizes.

    python benchmarks/launch_floor.py [--chain 8] [--out launch_floor.json]

Each replay starts with a cold L2 (``do_bench`` flushes it), as the decode benchmarks do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import HBM_BYTES_PER_S, bench, graphed  # noqa: E402
import optimized  # noqa: E402
from optimized import _pdl  # noqa: E402

ROW = 576  # a latent cache row: L = 512 latent + R = 64 k_pe, bf16
CONTEXTS = (4096, 32768)
#: w_kvb of the 48B model (N = 32 heads x (P + Vh = 256) rows x L = 512) as rows of ROW elements
WEIGHT_ROWS = -(-32 * 256 * 512 // ROW)


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    # the PDL rule (optimized/_pdl.py): wait before any store; this kernel has none
    _pdl.pdl_wait(PDL)


@triton.jit
def _read_kernel(x_ptr, out_ptr, rows, rows_per_program, BLOCK_ROWS: tl.constexpr, PDL: tl.constexpr):
    # grid (programs,): program p sums rows [p * rows_per_program, ...) of x [rows, 576] in fp32
    # (the 512 latent columns and the 64 k_pe columns as two tiles) and stores its sum
    _pdl.pdl_wait(PDL)
    p = tl.program_id(0)
    first = p * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    c1 = tl.arange(0, 512)
    c2 = 512 + tl.arange(0, 64)
    acc = tl.zeros([BLOCK_ROWS], tl.float32)
    for r0 in range(first, last, BLOCK_ROWS):
        r = r0 + tl.arange(0, BLOCK_ROWS)
        ok = r < last
        base = x_ptr + r.to(tl.int64)[:, None] * 576
        acc += tl.sum(tl.load(base + c1[None, :], mask=ok[:, None], other=0.0).to(tl.float32), axis=1)
        acc += tl.sum(tl.load(base + c2[None, :], mask=ok[:, None], other=0.0).to(tl.float32), axis=1)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def read_sum(x: torch.Tensor, programs: int, block_rows: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Per-program sums [programs] (fp32) of x [rows, 576] (bf16), rows cut into equal runs."""
    rows = x.shape[0]
    out = torch.empty(programs, dtype=torch.float32, device=x.device)
    per = triton.cdiv(rows, programs)
    pdl = _pdl.enabled(x.device)
    _read_kernel[(programs,)](x, out, rows, per, BLOCK_ROWS=block_rows, PDL=pdl, launch_pdl=pdl,
                              num_warps=num_warps)
    return out


def empty_chain(x: torch.Tensor, n: int, programs: int) -> None:
    pdl = _pdl.enabled(x.device)
    for _ in range(n):
        _empty_kernel[(programs,)](x, PDL=pdl, launch_pdl=pdl, num_warps=4)


def read_chain(S: int, extra: int, n: int, setting: tuple, floor_us: float, g) -> dict:
    """n reads of distinct [S + extra, ROW] buffers (``setting``: programs, rows, warps) in one graph."""
    bufs = [torch.randn((S + extra, ROW), generator=g, device="cuda").to(torch.bfloat16) for _ in range(n)]
    replay = graphed(lambda: [read_sum(b, *setting) for b in bufs])
    us = bench(replay, warmup_ms=10, rep_ms=100)[0] * 1e3 / n
    print(f"{n} reads of [{S} + weights, {ROW}] in one graph: {us:.2f} us per read ({us / floor_us:.2f}x)", flush=True)
    return dict(kind="read_chain", S=S, weights=True, chain=n, per_call_us=us, floor_us=floor_us)


def mla_chain(S: int, n: int, g) -> dict:
    """n ``mla.paged_decode`` calls at B=1 over S cached tokens, each with its own cache and w_kvb
    (``tune.mla_case``: the 48B model's sizes, pages of 64), in one graph."""
    from benchmarks.tune import mla_case
    from optimized import mla

    cases = [mla_case(1, S, g) for _ in range(n)]
    floor_us = cases[0][-1] * 1e3
    replay = graphed(lambda: [mla.paged_decode(q, cache, tables, lens, w) for cache, tables, lens, q, w, _ in cases])
    us = bench(replay, warmup_ms=10, rep_ms=100)[0] * 1e3 / n
    print(f"{n} B=1 MLA decodes over {S} tokens in one graph: {us:.2f} us per call ({us / floor_us:.2f}x)", flush=True)
    return dict(kind="mla_chain", S=S, chain=n, per_call_us=us, floor_us=floor_us)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--chain", type=int, default=0, help="also time this many reads / MLA decodes in one graph")
    args = ap.parse_args(argv)
    if args.chain < 0:
        ap.error(f"--chain: expected a count >= 0, got {args.chain}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it times launches)")
    optimized.use("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(8, device="cuda")
    rows = []
    for pdl in ("1", "0"):
        os.environ[_pdl.ENV] = pdl
        for n in (1, 2, 3):
            replay = graphed(lambda: empty_chain(x, n, sms))
            us = bench(replay, warmup_ms=10, rep_ms=100)[0] * 1e3
            rows.append(dict(kind="empty", launches=n, pdl=pdl == "1", programs=sms, graph_us=us))
            print(f"{n} empty launch(es) of {sms} programs, PDL {'on' if pdl == '1' else 'off'}: {us:.2f} us",
                  flush=True)
    os.environ[_pdl.ENV] = "1"
    g = torch.Generator(device="cuda").manual_seed(0)
    for S, extra in [(S, extra) for S in CONTEXTS for extra in (0, WEIGHT_ROWS)]:
        cache = torch.randn((S + extra, ROW), generator=g, device="cuda").to(torch.bfloat16)
        floor_us = cache.numel() * 2 / HBM_BYTES_PER_S * 1e6
        exact = cache.double().sum().item()
        best = None
        for programs in (sms, 2 * sms, 4 * sms):
            for block_rows in (16, 32, 64):
                for warps in (4, 8):
                    got = read_sum(cache, programs, block_rows, warps).double().sum().item()
                    # fp32 sums of |x| <= ~5 over S * 576 terms: far inside 1e-3 relative
                    assert abs(got - exact) <= 1e-3 * cache.double().abs().sum().item(), (got, exact)
                    replay = graphed(lambda: read_sum(cache, programs, block_rows, warps))
                    us = bench(replay, warmup_ms=10, rep_ms=100)[0] * 1e3
                    rows.append(dict(kind="read", S=S, weights=extra > 0, programs=programs, block_rows=block_rows, warps=warps,
                                     graph_us=us, floor_us=floor_us))
                    if best is None or us < best[0]:
                        best = (us, programs, block_rows, warps)
        print(f"read [{S}{' + weights' if extra else ''}, {ROW}] bf16 ({cache.numel() * 2 / 1e6:.1f} MB, floor {floor_us:.2f} us): best "
              f"{best[0]:.2f} us ({best[0] / floor_us:.2f}x) with {best[1]} programs, {best[2]} rows, "
              f"{best[3]} warps", flush=True)
        if args.chain and extra:
            rows.append(read_chain(S, extra, args.chain, best[1:], floor_us, g))
    if args.chain:
        for S in CONTEXTS:
            rows.append(mla_chain(S, args.chain, g))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
