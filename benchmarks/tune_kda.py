"""Launch-configuration sweep of the chunked KDA kernels (``optimized.kda.chunk._TUNE``): per-kernel
GPU time of ``fused_chunked`` (bf16, H=32, K=V=128) for each setting, so the defaults are chosen from
measurements. None of the settings changes a row's arithmetic order except ``intra_bks`` (the key
slices of Akk/Aqk are summed in order; each setting is a valid kernel, certified by the tests).

    python benchmarks/tune_kda.py [--T 4096 65536]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_kda import prefill_inputs  # noqa: E402
from benchmarks.harness import kernel_profile  # noqa: E402

INTRA = [{"intra_bks": b, "intra_warps": w} for b in (16, 32, 64) for w in (4, 8)]
STATE = [{"state_bv": bv, "state_warps": w} for bv in (16, 32, 64) for w in (2, 4)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    args = ap.parse_args(argv)
    import optimized.kda as okda
    from optimized.kda import chunk

    for T in args.T:
        inputs = prefill_inputs(1, T)
        for settings, kernel in [(s, "_intra_kernel") for s in INTRA] + [(s, "_state_kernel") for s in STATE]:
            chunk._TUNE.clear()
            chunk._TUNE.update(settings)
            try:
                table = kernel_profile(lambda: okda.fused_chunked(*inputs), reps=3)
                us = table[kernel][1]
                total = sum(t for _, t in table.values())
                print(f"T={T} {settings}: {kernel} {us:.1f} us, all kernels {total:.1f} us", flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"T={T} {settings}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    chunk._TUNE.clear()


if __name__ == "__main__":
    main()
