"""Key-slice policy and launch-setting sweep of ``mla.paged_decode`` (absorbed MLA decode over the
paged latent cache) at the 48B model's sizes (bf16, N=32, L=512, R=64, P=Vh=128, block 64), at
B in {1, 64} and S in {4096, 32768}: CUDA-graph replay time per call against the memory floor.

Policies set a sequence's key slices (``split_keys`` keys per slice, at most ``max_splits``; or a
fixed count) and BLOCK_N the keys per online-softmax step: both are part of the reduction order,
so a new default changes bits and is re-certified. Launch settings (``mla._TUNE``: BLOCK_M,
num_stages, merge_unroll) must not: each setting's output is compared bit for bit with the default
setting's under the same policy, which is what lets ``_block_m`` choose rows per program from the
batch.

    python benchmarks/tune_mla.py [--out tune_mla.json]
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
#: (split_keys, max_splits); split_keys None = the fixed count max_splits (the old default: 8)
POLICIES = [(None, 8), (128, 32), (256, 32), (256, 64), (512, 32), (512, 64), (1024, 32)]
#: keys per step of the online softmax (part of the reduction order, like the policy)
BLOCK_NS = (32, 64)
LAUNCH = [dict(BLOCK_M=m, num_stages=s, merge_unroll=u) for m, s, u in itertools.product((16, 32), (2, 3), (2, 8))]

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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=2, help="policies per shape swept over the launch settings")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times kernels)")
    from optimized import mla

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B, S in SHAPES:
        cache, tables, lens, q, w_kvb, floor_ms = setup(B, S, g)

        def run(policy):
            keys, most = policy
            if keys is None:
                return lambda: mla.paged_decode(q, cache, tables, lens, w_kvb, num_splits=most)
            mla.DECODE_MAX_SPLITS = most
            return lambda: mla.paged_decode(q, cache, tables, lens, w_kvb, split_keys=keys)

        def timed(policy, launch):
            mla._TUNE.clear()
            mla._TUNE.update(launch)
            fn = run(policy)
            out = fn().clone()
            replay = graphed(fn)
            ms = bench(replay, warmup_ms=10, rep_ms=60)[0]
            return ms, out, replay

        for block_n in BLOCK_NS:
            mla.BLOCK_N_LATENT = block_n
            first = []
            for policy in POLICIES:
                ms, _, _ = timed(policy, {})
                first.append((ms, policy))
                rows.append(dict(B=B, S=S, block_n=block_n, policy=policy, launch={}, graph_ms=ms,
                                 floor_ms=floor_ms, x_floor=ms / floor_ms))
                print(f"B={B} S={S} BLOCK_N={block_n} {policy}: {ms * 1e3:.1f} us {ms / floor_ms:.2f}x", flush=True)
            first.sort()
            for _, policy in first[: args.top]:
                _, ref_out, _ = timed(policy, {})
                best = None
                for launch in LAUNCH:
                    try:
                        ms, out, replay = timed(policy, launch)
                    except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                        print(f"  {launch}: failed {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    same = bool(torch.equal(out, ref_out))
                    rows.append(dict(B=B, S=S, block_n=block_n, policy=policy, launch=launch, graph_ms=ms,
                                     floor_ms=floor_ms, x_floor=ms / floor_ms, same_bits=same))
                    if not same:
                        print(f"  {policy} {launch}: BITS DIFFER", flush=True)
                    if best is None or ms < best[0]:
                        best = (ms, launch, replay)
                if best is not None:
                    prof = kernel_profile(best[2])
                    print(f"  best BLOCK_N={block_n} {policy} {best[1]}: {best[0] * 1e3:.1f} us "
                          f"{best[0] / floor_ms:.2f}x;", ", ".join(
                              f"{k.split('(')[0][5:20]} {us:.1f}" for k, (n, us) in
                              sorted(prof.items(), key=lambda kv: -kv[1][1])), flush=True)
        mla.BLOCK_N_LATENT = 64
        mla._TUNE.clear()
        del cache
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
