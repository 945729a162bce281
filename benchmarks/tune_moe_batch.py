"""The routed experts' GEMV form at B=64 (decode's other end): the launch settings that do not
touch a summation order (rows per program, warps; the lane widths ``gemv_d`` and ``down_f`` stay
at their defaults), each timed per kernel at B=64 and B=1 and checked bit for bit against the
defaults at both sizes. A setting whose bits differ could not be chosen by the batch size without
breaking batch invariance; one whose bits are equal can.

    python benchmarks/tune_moe_batch.py [--out tune_moe_batch.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import kernel_profile  # noqa: E402
from benchmarks.tune_moe import D, E, KE, expert_weights  # noqa: E402

GATE_UP = [{"gemv_f": f, "gemv_warps": w} for f, w in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8))]
DOWN = [{"down_d": d, "down_warps": w} for d, w in itertools.product((8, 16, 32, 64, 128), (2, 4, 8, 16))]
KERNEL = {"gate_up": "_gemv_gate_up_kernel", "down": "_gemv_down_kernel"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write every row here (JSON)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times kernels)")
    from optimized import moe

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    w1, w2, w3 = expert_weights(g)
    cases = {}
    for B in (1, 64):
        x = torch.randn((B, D), generator=g, device="cuda", dtype=bf16)
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:KE] for _ in range(B)])
        wts = torch.rand((B, KE), generator=g, device="cuda")
        cases[B] = (x, wts, ids)

    def run(B):
        x, wts, ids = cases[B]
        return moe._experts("moe.experts", x, wts, ids, w1, w2, w3, form="gemv")

    moe._TUNE.clear()
    want = {B: run(B).view(torch.int16).clone() for B in cases}
    rows = []
    for which, settings_list in (("gate_up", GATE_UP), ("down", DOWN)):
        for settings in settings_list:
            moe._TUNE.clear()
            moe._TUNE.update(settings)
            try:
                same = all(torch.equal(run(B).view(torch.int16), want[B]) for B in cases)
                us = {B: kernel_profile(lambda: run(B), reps=5)[KERNEL[which]][1] for B in cases}
            except Exception as exc:  # noqa: BLE001 - e.g. out of registers: report, go on
                print(f"{which} {settings}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            rows.append({"kernel": which, **settings, "B1_us": us[1], "B64_us": us[64], "bits_equal": same})
            print(f"{which} {settings}: B=1 {us[1]:.1f} us, B=64 {us[64]:.1f} us, "
                  f"bits {'equal' if same else 'DIFFER'}", flush=True)
    moe._TUNE.clear()
    for which in KERNEL:
        ok = [r for r in rows if r["kernel"] == which and r["bits_equal"]]
        if ok:
            b = min(ok, key=lambda r: r["B64_us"])
            print(f"fastest {which} at B=64 with the defaults' bits: {b}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
