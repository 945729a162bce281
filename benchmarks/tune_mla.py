"""Key-slice policy and launch-setting sweep of ``mla.paged_decode`` (absorbed MLA decode over the
paged latent cache) at the 48B model's sizes (bf16, N=32, L=512, R=64, P=Vh=128, block 64), at
B in {1, 64} and S in {4096, 32768}: CUDA-graph replay time per call against the memory floor.

Policies set a sequence's key slices (``split_keys`` keys per slice, at most ``max_splits``; or a
fixed count) and BLOCK_N the keys per online-softmax step: both are part of the reduction order,
so a new default changes bits and is re-certified. Launch settings (``mla._TUNE``: BLOCK_M,
num_stages, merge_unroll) must not: each setting's output is compared bit for bit with the default
setting's under the same policy, which is what lets ``_block_m`` choose rows per program from the
batch.

    python benchmarks/tune_mla.py [--parts slicing epilogue] [--out tune_mla.json]

``slicing``: policies x BLOCK_N, then the launch settings of the best policies; ``epilogue``: the
merge + W_UV kernel's settings (warps, partials in flight, Vh columns per program) under the
default policy, including the short context of the model benchmark; ``stages``: the attention
kernel's pipeline stages under the default policy, short contexts included; ``rows``: the
attention's rows per program (16, 32, or 64: warpgroup MMAs on sm_90), warps and stages; ``loads``:
the key tiles' loads (rows past a slice's end masked, or clamped to its last key) by rows and stages;
``prefetch``: L2 prefetches before the PDL wait; ``occupancy``: 16 or 32 rows per attention program
at B in {8, 16, 64} and short to medium contexts; ``epilogue_v``: the epilogue's Vh columns per program
and warps; ``b1``: more key slices than the default, by keys per step, rows per program and stages;
``warps``: 2 or 4 warps per 16-row attention program, by stages; ``q_lat``: the q_lat GEMM's tile
(P columns per dot, L columns per program, warps, stages); ``rows8``: one 32-row program per
sequence and slice on 8 warps (a sequence's two 16-row halves share each key tile) against 16 and
32 rows on 4 warps, at the default and doubled slice counts, with each setting's attention also
compared in fp32 (``attention_bits``: finer than the bf16 output); ``early``: the attention's slice
bounds and the epilogue's sequence lengths read before or after the PDL wait.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import HBM_BYTES_PER_S, bench, graphed, kernel_profile  # noqa: E402

N, L, R, P, VH, BLOCK = 32, 512, 64, 128, 128, 64
SHAPES = [(1, 4096), (1, 32768), (64, 4096), (64, 32768)]
#: the epilogue (merge + W_UV) sweep adds the model benchmark's short context (one slice)
EPILOGUE_SHAPES = [(1, 64), (64, 64)] + SHAPES
#: the attention's pipeline stages at short contexts too (one or two 64-key steps per program)
STAGES_SHAPES = [(1, 64), (1, 128), (64, 128)] + SHAPES
#: (split_keys, max_splits); split_keys None = the fixed count max_splits (the old default: 8)
POLICIES = [(None, 8), (128, 32), (256, 32), (256, 64), (512, 32), (512, 64), (1024, 32)]
#: keys per step of the online softmax (part of the reduction order, like the policy)
BLOCK_NS = (32, 64)
LAUNCH = [dict(BLOCK_M=m, num_stages=s, merge_unroll=u) for m, s, u in itertools.product((16, 32), (2, 3), (2, 8))]
EPILOGUE = [dict(epi_warps=w, merge_unroll=u, BLOCK_V=v) for w, u, v in itertools.product((4, 8), (1, 2, 4, 8, 16, 32), (16, 32))]
#: the attention's rows per program, warps and stages (64 rows on sm_90: warpgroup MMAs, wgmma)
ROWS = [dict(BLOCK_M=m, num_warps=w, num_stages=s) for m, w, s in
        ((16, 4, 3), (32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 1), (64, 8, 2))]
#: how the attention loads its key tiles: rows past a slice's end masked, or read as the last key's
#: row (no predicates), at 16 and 32 rows per program, 2 and 3 stages
LOADS = [dict(row_mask=m, BLOCK_M=r, num_stages=s) for m, r, s in itertools.product((False, True), (16, 32), (2, 3))]
#: L2 prefetches before the PDL wait: the attention's first key steps, the q_lat / epilogue weight tiles
#: (session 13 run 4 timed the first three and the last two against the default of then: no prefetch)
PREFETCH = [dict(prefetch_keys=0, prefetch_w=False), dict(prefetch_keys=1, prefetch_w=False),
            dict(prefetch_keys=2, prefetch_w=False), dict(prefetch_keys=0, prefetch_w=True),
            dict(prefetch_keys=2, prefetch_w=True), dict(prefetch_keys=4, prefetch_w=True)]
PREFETCH_SHAPES = [(1, 64), (1, 4096), (1, 32768), (64, 4096), (64, 32768)]
#: rows per attention program against the grid's size (16 rows: 3 stages, unmasked loads; 32: 2, masked)
OCCUPANCY = [dict(BLOCK_M=16), dict(BLOCK_M=32)]
OCCUPANCY_SHAPES = [(b, s) for b in (8, 16, 64) for s in (128, 1024, 4096)]
#: the epilogue's Vh columns per program with its W_UV tile prefetched (each program redoes the merge)
EPILOGUE_V = [dict(BLOCK_V=v, epi_warps=w) for v, w in itertools.product((16, 32, 64, 128), (4, 8))]
EPILOGUE_V_SHAPES = [(1, 64), (1, 4096), (1, 32768), (64, 128), (64, 4096)]
#: a small batch against the slice count: policies (split_keys, max_splits) x keys per step x rows
#: per program x stages (fewer stages: more programs per SM, which more slices can fill)
B1_POLICIES = [(256, 64), (256, 128), (128, 128)]
B1 = [dict(BLOCK_M=16, num_stages=s) for s in (3, 2)] + [dict(BLOCK_M=32, num_stages=2), dict(BLOCK_M=16, num_stages=1)]
B1_SHAPES = SHAPES
#: warps per 16-row attention program (each warp re-reads the program's q tile from shared memory
#: every step, so fewer warps read less of it) by stages
WARPS = [dict(BLOCK_M=16, num_warps=w, num_stages=s) for w in (4, 2) for s in (3, 2)]
WARPS_SHAPES = [(1, 4096), (1, 32768)]
#: the q_lat GEMM's tile: P columns per dot (32: four chained dots over P = 128; 128: one), L
#: columns per program, warps and stages
Q_LAT = [dict(q_lat_p=p, q_lat_l=l, q_lat_warps=w, q_lat_stages=s)
         for p, l, w, s in ((32, 128, 4, 2), (64, 128, 4, 2), (128, 128, 4, 1), (128, 128, 8, 1),
                            (128, 64, 4, 1), (128, 256, 8, 1), (32, 64, 4, 2))]
Q_LAT_SHAPES = [(1, 4096), (1, 32768), (64, 4096)]
#: 32 rows on 8 warps: the q.k tile [32, 64 keys] split as two 16-row halves by four key quarters,
#: each warp's part as a 16-row program on 4 warps has it; with twice the slices at 32k a B=1
#: sequence still fills the GPU with one program per slice
ROWS8_POLICIES = [(256, 64), (256, 128), (128, 128)]
ROWS8 = [dict(BLOCK_M=16, num_warps=4, num_stages=3), dict(BLOCK_M=32, num_warps=4, num_stages=2),
         dict(BLOCK_M=32, num_warps=8, num_stages=2)]
ROWS8_SHAPES = SHAPES
#: what is read before the PDL wait: the attention's slice bounds (sequence length, first table
#: entry), the epilogue's sequence lengths
EARLY = [dict(early_setup=a, early_lens=e) for a in (False, True) for e in (False, True)]
EARLY_SHAPES = SHAPES

def setup(B: int, S: int, g: torch.Generator):
    from optimized import mla

    per_seq = S // BLOCK
    cache = mla.PagedLatentCache(B * per_seq, BLOCK, L, R, torch.bfloat16, "cuda")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g, device="cuda").to(torch.bfloat16))
    tables = torch.randperm(B * per_seq, generator=g, device="cuda").view(B, per_seq).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    q = torch.randn((B, N, P + R), generator=g, device="cuda").to(torch.bfloat16)
    w_kvb = (torch.randn((N * (P + VH), L), generator=g, device="cuda") * L ** -0.5).to(torch.bfloat16)
    floor_ms = (cache.kv[:B * per_seq].numel() * 2 + w_kvb.numel() * 2) / HBM_BYTES_PER_S * 1e3
    return cache, tables, lens, q, w_kvb, floor_ms


class Case:
    """One (B, S) setup and its timed calls."""

    def __init__(self, B: int, S: int, g: torch.Generator):
        self.B, self.S = B, S
        self.cache, self.tables, self.lens, self.q, self.w_kvb, self.floor_ms = setup(B, S, g)

    def call(self, policy):
        """The decode under ``policy``: None (the module's default), or (split_keys, max_splits)."""
        from optimized import mla

        if policy is None:
            return lambda: mla.paged_decode(self.q, self.cache, self.tables, self.lens, self.w_kvb)
        keys, most = policy
        if keys is None:
            return lambda: mla.paged_decode(self.q, self.cache, self.tables, self.lens, self.w_kvb, num_splits=most)
        mla.DECODE_MAX_SPLITS = most
        return lambda: mla.paged_decode(self.q, self.cache, self.tables, self.lens, self.w_kvb, split_keys=keys)

    def timed(self, policy, launch):
        """(graph ms, output, replay) under ``launch`` (mla._TUNE)."""
        from optimized import mla

        mla._TUNE.clear()
        mla._TUNE.update(launch)
        fn = self.call(policy)
        out = fn().clone()
        replay = graphed(fn)
        ms = bench(replay, warmup_ms=10, rep_ms=60)[0]
        return ms, out, replay

    def row(self, **fields):
        ms = fields["graph_ms"]
        return dict(B=self.B, S=self.S, floor_ms=self.floor_ms, x_floor=ms / self.floor_ms, **fields)


def profile_line(replay) -> str:
    prof = kernel_profile(replay)
    return ", ".join(f"{k.split('(')[0][5:20]} {us:.1f}" for k, (n, us) in sorted(prof.items(), key=lambda kv: -kv[1][1]))


def sweep_slicing(case: Case, top: int, rows: list) -> None:
    from optimized import mla

    max_splits = mla.DECODE_MAX_SPLITS
    for block_n in BLOCK_NS:
        mla.BLOCK_N_LATENT = block_n
        first = []
        for policy in POLICIES:
            ms, _, _ = case.timed(policy, {})
            first.append((ms, policy))
            rows.append(case.row(part="slicing", block_n=block_n, policy=policy, launch={}, graph_ms=ms))
            print(f"B={case.B} S={case.S} BLOCK_N={block_n} {policy}: {ms * 1e3:.1f} us "
                  f"{ms / case.floor_ms:.2f}x", flush=True)
        first.sort(key=lambda row: row[0])
        for _, policy in first[:top]:
            _, ref_out, _ = case.timed(policy, {})
            best = None
            for launch in LAUNCH:
                try:
                    ms, out, replay = case.timed(policy, launch)
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                    print(f"  {launch}: failed {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                same = bool(torch.equal(out, ref_out))
                rows.append(case.row(part="slicing", block_n=block_n, policy=policy, launch=launch,
                                     graph_ms=ms, same_bits=same))
                if not same:
                    print(f"  {policy} {launch}: BITS DIFFER", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, launch, replay)
            if best is not None:
                print(f"  best BLOCK_N={block_n} {policy} {best[1]}: {best[0] * 1e3:.1f} us "
                      f"{best[0] / case.floor_ms:.2f}x; {profile_line(best[2])}", flush=True)
    mla.BLOCK_N_LATENT, mla.DECODE_MAX_SPLITS = 64, max_splits


def sweep_epilogue(case: Case, rows: list) -> None:
    policy = None
    _, ref_out, _ = case.timed(policy, {})
    best = None
    for launch in EPILOGUE:
        ms, out, replay = case.timed(policy, launch)
        same = bool(torch.equal(out, ref_out))
        rows.append(case.row(part="epilogue", policy=policy, launch=launch, graph_ms=ms, same_bits=same))
        print(f"  epilogue B={case.B} S={case.S} {launch}: {ms * 1e3:.1f} us"
              f"{'' if same else ' BITS DIFFER'}", flush=True)
        if best is None or ms < best[0]:
            best = (ms, launch, replay)
    ms, _, replay = case.timed(policy, {})
    print(f"epilogue B={case.B} S={case.S}: default {ms * 1e3:.1f} us ({profile_line(replay)}); "
          f"best {best[1]} {best[0] * 1e3:.1f} us ({profile_line(best[2])})", flush=True)


def sweep_launches(case: Case, rows: list, part: str, launches: list, policy=None) -> None:
    """``launches`` (mla._TUNE settings) under ``policy`` (None: the default): time, kernels, and
    whether the output is bitwise the default setting's under that policy."""
    _, ref_out, replay = case.timed(policy, {})
    print(f"{part} B={case.B} S={case.S} {policy or ''} default: ({profile_line(replay)})", flush=True)
    for launch in launches:
        try:
            ms, out, replay = case.timed(policy, launch)
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
            print(f"{part} B={case.B} S={case.S} {launch}: failed {type(exc).__name__}: {str(exc)[:120]}")
            continue
        same = bool(torch.equal(out, ref_out))
        rows.append(case.row(part=part, policy=policy, launch=launch, graph_ms=ms, same_bits=same))
        print(f"{part} B={case.B} S={case.S} {policy or ''} {launch}: {ms * 1e3:.1f} us {ms / case.floor_ms:.2f}x"
              f"{'' if same else ' BITS DIFFER'} ({profile_line(replay)})", flush=True)


def attention_bits(case: Case, policy, launch) -> torch.Tensor:
    """The attention alone under ``policy`` ((split_keys, max_splits)) and ``launch``: its slices
    merged in fp32 by the plain combine kernel ([B, 1, N, L], no W_UV, no bf16 rounding), so a
    layout that changes a row's sums shows in far more elements than the bf16 output would."""
    from optimized import mla

    mla._TUNE.clear()
    mla._TUNE.update(launch)
    keys, most = policy
    w_uk, _ = mla._w_views(case.w_kvb, N, P, VH)
    q4 = case.q[:, None]
    q_lat = mla._q_lat(q4[..., :P], w_uk)
    out = torch.empty((case.B, 1, N, L), dtype=torch.float32, device="cuda")
    kv = case.cache.kv.view(-1, L + R)
    mla._attend(q_lat, q4[..., P:], kv, kv[:, L:], kv, out, T=1, S=case.tables.shape[1] * BLOCK, N=N, D1=L,
                R=R, DV=L, scale=(P + R) ** -0.5, shared_kv=True, split_keys=keys, max_splits=most,
                paged=(case.tables, BLOCK), seq_lens=case.lens)
    return out


def sweep_rows8(case: Case, rows: list) -> None:
    """ROWS8 under each of ROWS8_POLICIES: time, kernels, and the fp32 attention's bits against the
    first setting's under the same policy."""
    from optimized import mla

    max_splits = mla.DECODE_MAX_SPLITS
    for policy in ROWS8_POLICIES:
        ref = attention_bits(case, policy, ROWS8[0])
        for launch in ROWS8:
            try:
                ms, _, replay = case.timed(policy, launch)
                att = attention_bits(case, policy, launch)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                print(f"rows8 B={case.B} S={case.S} {policy} {launch}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            differ = int((att != ref).sum().item())
            rows.append(case.row(part="rows8", policy=policy, launch=launch, graph_ms=ms,
                                 attention_elements_differ=differ))
            print(f"rows8 B={case.B} S={case.S} {policy} {launch}: {ms * 1e3:.1f} us {ms / case.floor_ms:.2f}x, "
                  f"fp32 attention {differ} of {ref.numel()} elements differ ({profile_line(replay)})", flush=True)
    mla.DECODE_MAX_SPLITS = max_splits


def sweep_policies(case: Case, rows: list, part: str, policies: list, launches: list) -> None:
    """``sweep_launches`` under each of ``policies`` (the module's slice limit restored after)."""
    from optimized import mla

    max_splits = mla.DECODE_MAX_SPLITS
    for policy in policies:
        sweep_launches(case, rows, part, launches, policy)
    mla.DECODE_MAX_SPLITS = max_splits


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="*", default=["slicing", "epilogue"],
                    choices=["slicing", "epilogue", "stages", "rows", "loads", "prefetch", "occupancy", "epilogue_v",
                             "b1", "warps", "q_lat", "rows8", "early"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=2, help="policies per shape swept over the launch settings")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times kernels)")
    from optimized import mla

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = list(dict.fromkeys((SHAPES if "slicing" in args.parts else [])
                                + (EPILOGUE_SHAPES if "epilogue" in args.parts else [])
                                + (STAGES_SHAPES if {"stages", "rows", "loads"} & set(args.parts) else [])
                                + (PREFETCH_SHAPES if "prefetch" in args.parts else [])
                                + (OCCUPANCY_SHAPES if "occupancy" in args.parts else [])
                                + (EPILOGUE_V_SHAPES if "epilogue_v" in args.parts else [])
                                + (B1_SHAPES if "b1" in args.parts else [])
                                + (WARPS_SHAPES if "warps" in args.parts else [])
                                + (Q_LAT_SHAPES if "q_lat" in args.parts else [])
                                + (ROWS8_SHAPES if "rows8" in args.parts else [])
                                + (EARLY_SHAPES if "early" in args.parts else [])))
    for B, S in shapes:
        case = Case(B, S, g)
        if "slicing" in args.parts and (B, S) in SHAPES:
            sweep_slicing(case, args.top, rows)
        if "epilogue" in args.parts and (B, S) in EPILOGUE_SHAPES:
            sweep_epilogue(case, rows)
        if "stages" in args.parts and (B, S) in STAGES_SHAPES:
            sweep_launches(case, rows, "stages", [{"num_stages": n} for n in (1, 2, 3)])
        if "rows" in args.parts and (B, S) in STAGES_SHAPES:
            sweep_launches(case, rows, "rows", ROWS)
        if "loads" in args.parts and (B, S) in STAGES_SHAPES:
            sweep_launches(case, rows, "loads", LOADS)
        if "prefetch" in args.parts and (B, S) in PREFETCH_SHAPES:
            sweep_launches(case, rows, "prefetch", PREFETCH)
        if "occupancy" in args.parts and (B, S) in OCCUPANCY_SHAPES:
            sweep_launches(case, rows, "occupancy", OCCUPANCY)
        if "epilogue_v" in args.parts and (B, S) in EPILOGUE_V_SHAPES:
            sweep_launches(case, rows, "epilogue_v", EPILOGUE_V)
        if "b1" in args.parts and (B, S) in B1_SHAPES:
            for block_n in BLOCK_NS:
                mla.BLOCK_N_LATENT = block_n
                sweep_policies(case, rows, f"b1 BLOCK_N={block_n}", B1_POLICIES, B1)
            mla.BLOCK_N_LATENT = 64
        if "warps" in args.parts and (B, S) in WARPS_SHAPES:
            sweep_launches(case, rows, "warps", WARPS)
        if "q_lat" in args.parts and (B, S) in Q_LAT_SHAPES:
            sweep_launches(case, rows, "q_lat", Q_LAT)
        if "rows8" in args.parts and (B, S) in ROWS8_SHAPES:
            sweep_rows8(case, rows)
        if "early" in args.parts and (B, S) in EARLY_SHAPES:
            sweep_launches(case, rows, "early", EARLY + EARLY[::-1])
        mla._TUNE.clear()
        del case
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
