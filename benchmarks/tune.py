"""Launch-setting sweeps of the Triton kernels at the 48B model's sizes (bf16, H200): each setting is
a launch config the op takes through ``launch=`` (nothing writes a module global), timed, and its
output compared bit for bit with the defaults' on the same inputs, so a setting known to keep the
bits can become a default without re-certifying (one that changes them is re-certified:
``parity certify --device cuda``).

    python benchmarks/tune.py kda  [--shapes 1x4096 1x65536] [--kernels gate blocks wy state output fused]
                                   [--best-out best.json]     # then bench_kda.py --launch best.json
    python benchmarks/tune.py mla  [--parts epilogue prefetch ...]
    python benchmarks/tune.py moe  [--kernels gate_up down router grouped_gate_up grouped_down] [--no-shared]
    python benchmarks/tune.py conv
    (each: [--out rows.json] writes every row)

kda: ``fused_chunked`` per kernel (torch profiler, us per call) over ``kda.ChunkLaunch`` settings;
mla: ``mla.paged_decode`` at B in {1, 64} x S in {4096, 32768} (pages of 64), CUDA-graph replay
against the memory floor, over ``mla.Launch`` settings grouped in parts; moe: the routed experts'
grouped form as the model's decode runs it (the shared expert as one more group), their GEMV form
(8 experts and the shared expert as a ninth pair), and
``router_logits``, at B=1 and B=64, each call routed to experts not read for 31 calls (so weights
come from HBM); conv: the decode step on the 48B decode tile (64 rows, one real, C = 12288).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402
from benchmarks.harness import HBM_BYTES_PER_S, bench, graphed, kernel_profile  # noqa: E402


def same_bits(a, b) -> bool:
    """Whether two outputs (a tensor or a tuple of them) are bitwise equal (NaN payloads and the sign
    of zero included)."""
    a, b = (a,) if isinstance(a, torch.Tensor) else tuple(a), (b,) if isinstance(b, torch.Tensor) else tuple(b)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b))


def bits_against_defaults(run, default, settings: list[dict]) -> list[tuple[dict, bool | str]]:
    """``run(launch)`` under each setting (fields replaced on ``default``) against ``run(default)``:
    ``(setting, same bits)``, or the error text of a setting that does not run."""
    want = run(default)
    out = []
    for s in settings:
        try:
            out.append((s, same_bits(run(replace(default, **s)), want)))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            out.append((s, f"{type(exc).__name__}: {str(exc)[:160]}"))
    return out


def _report(rows: list, line: str, **row) -> None:
    rows.append(row)
    print(line, flush=True)


# -- kda -----------------------------------------------------------------------------------------
KDA = {
    "gate": [dict(gate_warps=w, gate_block_k=bk) for bk in (32, 64, 128) for w in (2, 4, 8)],
    "blocks": [dict(blocks_warps=w) for w in (1, 2, 4)] + [dict(blocks_stages=s) for s in (1, 2, 3)]
    + [dict(blocks_maxnreg=n) for n in (96, 128, 160, 200)],
    "wy": [dict(wy_warps=w, wy_stages=s) for w in (2, 4, 8) for s in (2, 3)],
    # the separate state pass and output kernels (fused_output=False)
    "state": [dict(fused_output=False, state_block_v=bv, state_warps=w) for bv in (16, 32, 64) for w in (2, 4, 8)],
    "output": [dict(fused_output=False, output_block_v=bv, output_warps=w) for bv in (64, 128) for w in (4, 8)],
    # the state pass with the output in it
    "fused": [dict(fused_block_v=bv, fused_warps=w) for bv in (16, 32, 64) for w in (4, 8)]
    + [dict(fused_stages=s) for s in (2, 3)],
}
KDA_KERNEL = {"gate": "_gate_cumsum_kernel", "blocks": "_blocks_kernel", "wy": "_wy_kernel",
              "state": "_state_kernel", "output": "_output_kernel", "fused": "_state_output_kernel"}


def tune_kda(args, rows: list) -> None:
    import optimized.kda as okda
    from benchmarks.bench_kda import prefill_inputs

    best: dict = {}
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        inputs = prefill_inputs(B, T)
        run = lambda launch: okda.fused_chunked(*inputs, launch=launch)  # noqa: E731
        prof = kernel_profile(lambda: run(okda.ChunkLaunch()), reps=3)
        print(f"{shape} defaults: " + ", ".join(f"{k} {prof[v][1]:.1f} us" for k, v in KDA_KERNEL.items()
                                                if v in prof), flush=True)
        for kernel in args.kernels:
            for s, same in bits_against_defaults(run, okda.ChunkLaunch(), KDA[kernel]):
                if isinstance(same, str):
                    print(f"{shape} {s}: failed: {same}", flush=True)
                    continue
                prof = kernel_profile(lambda: run(replace(okda.ChunkLaunch(), **s)), reps=3)
                us, total = prof[KDA_KERNEL[kernel]][1], sum(t for _, t in prof.values())
                _report(rows, f"{shape} {s}: {kernel} {us:.1f} us, all {total:.1f} us, "
                        f"bits {'equal' if same else 'DIFFER'}", shape=shape, setting=s, kernel=kernel,
                        us=us, all_us=total, same_bits=same)
                if kernel not in best or us < best[kernel][0]:
                    best[kernel] = (us, s)
    if args.best_out:
        merged = {k: v for _, s in best.values() for k, v in s.items()}
        Path(args.best_out).write_text(json.dumps(merged) + "\n")
        print(f"fastest per kernel: {merged} -> {args.best_out}")


# -- mla -----------------------------------------------------------------------------------------
N, L, R, P, VH, PAGE = 32, 512, 64, 128, 128, 64
SHAPES = [(1, 4096), (1, 32768), (64, 4096), (64, 32768)]
SHORT = [(1, 64), (1, 128), (64, 128)] + SHAPES  # one or two 64-key steps per program, then SHAPES
#: part: (mla.Launch settings, (B, S) shapes); every setting leaves the bits alone by design, which
#: the sweep checks
MLA_PARTS = {
    # attention: rows per program (64: warpgroup MMAs on sm_90), warps, stages
    "rows": ([dict(attn_block_m=m, attn_warps=w, attn_stages=s) for m, w, s in
              ((16, 4, 3), (32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 2))], SHORT),
    "stages": ([dict(attn_stages=s) for s in (1, 2, 3)], SHORT),
    # a partial step's key tiles: rows past the slice masked, or read as its last key's row
    "loads": ([dict(attn_row_mask=m, attn_block_m=r, attn_stages=s)
               for m, r, s in itertools.product((False, True), (16, 32), (2, 3))], SHORT),
    # rows per attention program against the grid's size
    "occupancy": ([dict(attn_block_m=16), dict(attn_block_m=32)],
                  [(b, s) for b in (8, 16, 64) for s in (128, 1024, 4096)]),
    "warps": ([dict(attn_block_m=16, attn_warps=w, attn_stages=s) for w in (4, 2) for s in (3, 2)], SHAPES[:2]),
    # L2 prefetches before the PDL wait: the attention's first key steps, the weight tiles
    "prefetch": ([dict(attn_prefetch_keys=k, prefetch_w=w) for k, w in
                  ((0, False), (1, False), (2, False), (0, True), (2, True), (4, True))], [(1, 64)] + SHAPES),
    # what is read before the PDL wait: the attention's slice bounds, the epilogue's lengths
    "early": ([dict(attn_early=a, epi_early=e) for a in (False, True) for e in (False, True)], SHAPES),
    # the merge + W_UV epilogue: slices in flight, Vh columns per program, warps
    "epilogue": ([dict(epi_warps=w, epi_unroll=u) for w, u in itertools.product((4, 8), (1, 2, 8, 16, 32))],
                 [(1, 64), (64, 64)] + SHAPES),
    "epilogue_v": ([dict(epi_block_v=v, epi_warps=w) for v, w in itertools.product((16, 32, 64, 128), (4, 8))],
                   [(1, 64), (1, 4096), (1, 32768), (64, 128), (64, 4096)]),
    # the q_lat GEMM: P columns per dot, L columns per program, warps, stages
    "q_lat": ([dict(q_lat_block_p=p, q_lat_block_l=lc, q_lat_warps=w, q_lat_stages=s) for p, lc, w, s in
               ((32, 128, 4, 2), (64, 128, 4, 2), (128, 128, 4, 1), (128, 128, 8, 1), (128, 64, 4, 1),
                (128, 256, 8, 1))], [(1, 4096), (1, 32768), (64, 4096)]),
}


def mla_case(B: int, S: int, g: torch.Generator):
    """A decode over a paged cache at the 48B sizes, blocks in random order:
    ``(cache, block_tables, seq_lens, q, w_kvb, floor_ms)``; floor = cache rows + w_kvb at 4.3 TB/s."""
    from optimized import mla

    per_seq = S // PAGE
    cache = mla.PagedLatentCache(B * per_seq, PAGE, L, R, torch.bfloat16, "cuda")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g, device="cuda").to(torch.bfloat16))
    tables = torch.randperm(B * per_seq, generator=g, device="cuda").view(B, per_seq).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    q = torch.randn((B, N, P + R), generator=g, device="cuda").to(torch.bfloat16)
    w_kvb = (torch.randn((N * (P + VH), L), generator=g, device="cuda") * L ** -0.5).to(torch.bfloat16)
    floor_ms = (cache.kv.numel() * 2 + w_kvb.numel() * 2) / HBM_BYTES_PER_S * 1e3
    return cache, tables, lens, q, w_kvb, floor_ms


def _profile_line(replay) -> str:
    prof = kernel_profile(replay)
    return ", ".join(f"{k.split('(')[0][5:20]} {us:.1f}"
                     for k, (n, us) in sorted(prof.items(), key=lambda kv: -kv[1][1]))


def tune_mla(args, rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, S in dict.fromkeys(s for part in args.parts for s in MLA_PARTS[part][1]):
        _mla_shape(B, S, [p for p in args.parts if (B, S) in MLA_PARTS[p][1]], g, rows)
        torch.cuda.empty_cache()


def _mla_shape(B: int, S: int, parts: list[str], g: torch.Generator, rows: list) -> None:
    from optimized import mla

    cache, tables, lens, q, w_kvb, floor_ms = mla_case(B, S, g)
    run = lambda launch: mla.paged_decode(q, cache, tables, lens, w_kvb, launch=launch)  # noqa: E731
    replay = graphed(lambda: run(mla.Launch()))
    ms = bench(replay, warmup_ms=10, rep_ms=60)[0]
    print(f"B={B} S={S} defaults: {ms * 1e3:.1f} us {ms / floor_ms:.2f}x ({_profile_line(replay)})", flush=True)
    for part in parts:
        for s, same in bits_against_defaults(run, mla.Launch(), MLA_PARTS[part][0]):
            if isinstance(same, str):
                print(f"{part} B={B} S={S} {s}: failed: {same}", flush=True)
                continue
            replay = graphed(lambda: run(replace(mla.Launch(), **s)))
            ms = bench(replay, warmup_ms=10, rep_ms=60)[0]
            _report(rows, f"{part} B={B} S={S} {s}: {ms * 1e3:.1f} us {ms / floor_ms:.2f}x"
                    f"{'' if same else ' BITS DIFFER'} ({_profile_line(replay)})", part=part, B=B, S=S,
                    setting=s, graph_ms=ms, floor_ms=floor_ms, same_bits=same)


# -- moe -----------------------------------------------------------------------------------------
E, D, F, KE, TILE = 256, 2304, 1024, 8, 64
MOE = {
    "gate_up": [dict(gate_up_rows=f, gate_up_lanes=d, gate_up_warps=w)
                for f, d, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512), (1, 2, 4, 8))],
    "down": [dict(down_rows=d, down_lanes=f, down_warps=w)
             for d, f, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8, 16))],
    "router": [dict(tokens=t, experts=e, lanes=d, num_warps=w)
               for t, e, d, w in itertools.product((1, 8), (1, 2), (1024, 2048, 4096), (4, 8))],
    # the grouped form as the decode runs it (moe.GROUPED_DECODE; 16-row tiles, the shared expert a group)
    "grouped_gate_up": [dict(gate_up_cols=f, gate_up_depth=d, gate_up_warps=w)
                        for f, d, w in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8))]
    + [dict(gate_up_stages=s) for s in (2, 4, 5)],
    "grouped_down": [dict(down_cols=c, down_depth=d, down_warps=w)
                     for c, d, w in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8))]
    + [dict(down_stages=s) for s in (2, 4, 5)],
}
MOE_KERNEL = {"gate_up": "_gemv_gate_up_kernel", "down": "_gemv_down_kernel", "router": "_router_logits_kernel",
              "grouped_gate_up": "_grouped_gate_up_kernel", "grouped_down": "_grouped_down_kernel"}


def tune_moe(args, rows: list) -> None:
    from optimized import moe

    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (torch.randn((E, F, D), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w2 = torch.randn((E, D, F), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn((TILE, D), generator=g, device="cuda", dtype=torch.bfloat16)
    routers = torch.randn((64, E, D), generator=g, device="cuda") * 0.02  # 151 MB in turn: from HBM
    groups = E // KE
    # each call's experts: B=1 the next group of a fixed permutation, B=64 random; the shared
    # expert half a rotation away, so it too comes from HBM
    perm = torch.randperm(E, generator=g, device="cuda").view(groups, 1, KE)
    gcpu = torch.Generator().manual_seed(1)
    ids64 = torch.stack([torch.randperm(E, generator=gcpu)[:KE] for _ in range(4 * TILE)]).view(4, TILE, KE).cuda()
    wts = {B: torch.rand((B, KE), generator=g, device="cuda") for B in (1, TILE)}
    shared = [(w1[i], w3[i], w2[i]) for i in perm[:, 0, 0].roll(groups // 2).tolist()]
    calls = itertools.count()

    def layer(B, launch, c=None):
        c = next(calls) % groups if c is None else c
        ids = perm[c] if B == 1 else ids64[c % 4]
        sh = None if args.no_shared else shared[c]
        form = "grouped" if isinstance(launch, moe.GroupedLaunch) else "gemv"
        return moe._experts("moe.experts", x[:B], wts[B], ids, w1, w2, w3, form=form, shared=sh, launch=launch)

    def router(B, launch, c=None):
        c = next(calls) % routers.shape[0] if c is None else c
        return moe.router_logits(x[:B], routers[c], launch=launch)

    for kernel in args.kernels:
        fn, default = ((router, moe.ROUTER_LOGITS) if kernel == "router" else
                       (layer, moe.GROUPED_DECODE) if kernel.startswith("grouped") else (layer, moe.GEMV))
        # bits with fixed routing at both sizes; times with the rotation (weights from HBM)
        checked = [bits_against_defaults(lambda lc, B=B: fn(B, lc, c=0), default, MOE[kernel]) for B in (1, TILE)]
        for (s, same1), (_, same64) in zip(*checked):
            if isinstance(same1, str) or isinstance(same64, str):
                print(f"{kernel} {s}: failed: {same1 if isinstance(same1, str) else same64}", flush=True)
                continue
            lc = replace(default, **s)
            us = [kernel_profile(lambda B=B: fn(B, lc), reps=32)[MOE_KERNEL[kernel]][1] for B in (1, TILE)]
            same = same1 and same64
            _report(rows, f"{kernel} {s}: B=1 {us[0]:.2f} us, B={TILE} {us[1]:.2f} us, bits "
                    f"{'equal' if same else 'DIFFER'}", kernel=kernel, setting=s, B1_us=us[0], B64_us=us[1],
                    same_bits=same)


# -- conv ----------------------------------------------------------------------------------------
CONV = [dict(block_c=c, num_warps=w) for c, w in itertools.product((128, 256, 512, 1024), (1, 2, 4))]


def tune_conv(args, rows: list) -> None:
    from optimized import conv

    C, W, real = 3 * 4096, 4, 1
    g = torch.Generator(device="cuda").manual_seed(0)
    y_in = torch.randn((TILE, C + 288), generator=g, device="cuda", dtype=torch.bfloat16)
    x = y_in[:, :C]  # a column slice of the projection's output, as in the model
    weight = torch.randn((C, W), generator=g, device="cuda", dtype=torch.bfloat16)
    state = torch.randn((TILE, C, W - 1), generator=g, device="cuda", dtype=torch.bfloat16)
    slots = torch.full((TILE,), -1, dtype=torch.int64, device="cuda")
    slots[:real] = torch.arange(real, device="cuda")
    run = lambda launch: conv.short_conv_step_(x, weight, state.clone(), slots, launch=launch)  # noqa: E731
    for s, same in bits_against_defaults(run, conv.StepLaunch(), CONV):
        if isinstance(same, str):
            print(f"conv step {s}: failed: {same}", flush=True)
            continue
        lc = replace(conv.StepLaunch(), **s)
        prof = kernel_profile(lambda: conv.short_conv_step_(x, weight, state, slots, launch=lc), reps=50)
        us = sum(t for name, (_, t) in prof.items() if "short_conv_step" in name)
        _report(rows, f"conv step {s}: {us:.2f} us, bits {'equal' if same else 'DIFFER'}", setting=s, us=us,
                same_bits=same)


# -- driver --------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="family", required=True)
    kda = sub.add_parser("kda", help="the chunked KDA prefill's five kernels")
    kda.add_argument("--shapes", nargs="+", default=["1x4096", "1x65536"], help="BxT")
    kda.add_argument("--kernels", nargs="+", default=list(KDA), choices=list(KDA))
    kda.add_argument("--best-out", default=None, help="the fastest setting per kernel, merged (JSON)")
    mla = sub.add_parser("mla", help="mla.paged_decode's three kernels")
    mla.add_argument("--parts", nargs="+", default=["epilogue", "prefetch"], choices=list(MLA_PARTS))
    moe = sub.add_parser("moe", help="the grouped and GEMV experts and router_logits")
    moe.add_argument("--kernels", nargs="+", default=list(MOE), choices=list(MOE))
    moe.add_argument("--no-shared", action="store_true", help="the routed experts alone")
    sub.add_parser("conv", help="the conv decode step")
    for p in sub.choices.values():
        p.add_argument("--out", default=None, help="every row as JSON")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        parser().error("needs a CUDA GPU (the sweeps time kernels)")
    optimized.use("cuda")
    rows: list = []
    {"kda": tune_kda, "mla": tune_mla, "moe": tune_moe, "conv": tune_conv}[args.family](args, rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
