"""Launch-configuration sweep of the routed experts' GEMV form (``optimized.moe._TUNE``), the decode
path of ``moe.experts``: per-kernel GPU time of one MoE layer's 8 routed experts at B=1 (bf16, the
48B model's E=256, D=2304, F=1024) for each setting, so the defaults are chosen from measurements.

Each call routes the token to the next 8 of 256 experts (a fixed random permutation): one expert's
weights are read once per 32 calls, so they come from HBM as in a decode step, not from the L2.
BLOCK_D (gate/up) and BLOCK_F (down) set the lane sums of each dot product (its summation order):
a new default changes bits and is re-certified (``parity certify --device cuda``); nothing here
depends on the number of rows.

    python benchmarks/tune_moe.py [--kernels gate_up down] [--best-out best.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import HBM_BYTES_PER_S, kernel_profile  # noqa: E402

GATE_UP = [{"gemv_f": f, "gemv_d": d, "gemv_warps": w}
           for f, d, w in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8))]
DOWN = [{"down_d": d, "down_f": f, "down_warps": w}
        for d, f, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8))]
KERNEL = {"gate_up": "_gemv_gate_up_kernel", "down": "_gemv_down_kernel"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="*", default=["gate_up", "down"], choices=list(KERNEL))
    ap.add_argument("--best-out", default=None, help="write the fastest setting per kernel here (JSON)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times kernels)")
    from optimized import moe

    E, D, F, KE = 256, 2304, 1024, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (torch.randn((E, F, D), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w2 = torch.randn((E, D, F), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn((1, D), generator=g, device="cuda", dtype=torch.bfloat16)
    wts = torch.rand((1, KE), generator=g, device="cuda")
    perm = torch.randperm(E, generator=g, device="cuda").view(E // KE, 1, KE)
    out = torch.zeros((1, D), device="cuda", dtype=torch.bfloat16)
    call = itertools.count()

    def layer():
        ids = perm[next(call) % perm.shape[0]]
        moe._experts("moe.experts", x, wts, ids, w1, w2, w3, form="gemv", add_to=out)

    floor_us = {"gate_up": 2 * KE * F * D * 2 / HBM_BYTES_PER_S * 1e6,
                "down": KE * D * F * 2 / HBM_BYTES_PER_S * 1e6}
    best: dict = {}
    for which in args.kernels:
        for settings in (GATE_UP if which == "gate_up" else DOWN):
            moe._TUNE.clear()
            moe._TUNE.update(settings)
            try:
                us = kernel_profile(layer, reps=64)[KERNEL[which]][1]
            except Exception as exc:  # noqa: BLE001 - e.g. out of registers: report, go on
                print(f"{which} {settings}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            print(f"{which} {settings}: {us:.2f} us ({floor_us[which] / us:.0%} of the HBM floor "
                  f"{floor_us[which]:.2f} us)", flush=True)
            if which not in best or us < best[which][0]:
                best[which] = (us, settings)
    moe._TUNE.clear()
    for which, (us, settings) in best.items():
        print(f"fastest {which}: {settings} {us:.2f} us")
    if args.best_out:
        Path(args.best_out).write_text(json.dumps({k: {"us": us, **st} for k, (us, st) in best.items()}))


if __name__ == "__main__":
    main()
