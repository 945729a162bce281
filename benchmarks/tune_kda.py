"""Launch-configuration sweep of the chunked KDA kernels (``optimized.kda.chunk._TUNE``): per-kernel
GPU time of ``fused_chunked`` (bf16, H=32, K=V=128) for each setting, so the defaults are chosen from
measurements. None of the settings changes a row's arithmetic, except gate_warps and gate_bk: the
layout of the gate kernel's prefix sum can change its association (within the bounds; re-certify
after changing it).

    python benchmarks/tune_kda.py [--T 4096 65536]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_kda import prefill_inputs  # noqa: E402
from benchmarks.harness import kernel_profile  # noqa: E402

WY = [{"wy_warps": w, "wy_stages": st} for w in (2, 4, 8) for st in (2, 3)]
BLOCKS = [{"blocks_warps": w} for w in (1, 2, 4)]
GATE = [{"gate_warps": w, "gate_bk": bk} for bk in (32, 64, 128) for w in (2, 4, 8)]
STATE = [{"state_bv": bv, "state_warps": w} for bv in (16, 32, 64) for w in (2, 4, 8)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--kernels", nargs="*", default=["gate", "blocks", "wy", "state"],
                    choices=["gate", "blocks", "wy", "state"])
    ap.add_argument("--best-out", default=None, help="write the fastest setting per kernel here (JSON)")
    args = ap.parse_args(argv)
    best: dict = {}
    import optimized.kda as okda
    from optimized.kda import chunk

    for T in args.T:
        inputs = prefill_inputs(1, T)
        sweep = ([(s, "_gate_cumsum_kernel") for s in GATE] if "gate" in args.kernels else []) + \
                ([(s, "_blocks_kernel") for s in BLOCKS] if "blocks" in args.kernels else []) + \
                ([(s, "_wy_kernel") for s in WY] if "wy" in args.kernels else []) + \
                ([(s, "_state_kernel") for s in STATE] if "state" in args.kernels else [])
        for settings, kernel in sweep:
            chunk._TUNE.clear()
            chunk._TUNE.update(settings)
            try:
                table = kernel_profile(lambda: okda.fused_chunked(*inputs), reps=3)
                us = table[kernel][1]
                total = sum(t for _, t in table.values())
                compiled = chunk._LAUNCHED.get(kernel.strip("_").removesuffix("_kernel"))
                regs = (f", {compiled.n_regs} registers, {compiled.n_spills} spills"
                        if hasattr(compiled, "n_regs") else "")
                print(f"T={T} {settings}: {kernel} {us:.1f} us{regs}, all kernels {total:.1f} us", flush=True)
                if kernel not in best or us < best[kernel][0]:
                    best[kernel] = (us, settings)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"T={T} {settings}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    chunk._TUNE.clear()
    if args.best_out:
        merged = {k: v for _, st in best.values() for k, v in st.items()}
        Path(args.best_out).write_text(json.dumps(merged))
        print(f"fastest: {merged} -> {args.best_out}")


if __name__ == "__main__":
    main()
