"""Launch-configuration sweep of the conv decode step (``optimized.conv._TUNE``) as the 48B decode
step runs it: a 64-row tile (``decode_tile``) with one real row (B=1) and 63 padding rows, C = 3 *
4096 channels, W = 4, bf16, the state pool of 64 slots; GPU time per call from the profiler.

    python benchmarks/tune_decode.py
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import kernel_profile  # noqa: E402

SETTINGS = [{"step_block_c": c, "step_warps": w} for c, w in itertools.product((128, 256, 512, 1024), (1, 2, 4))]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("tune_decode.py: needs a CUDA GPU (it times kernels)")
    from optimized import conv

    tile, C, W, real = 64, 3 * 4096, 4, 1
    g = torch.Generator(device="cuda").manual_seed(0)
    y_in = torch.randn((tile, C + 288), generator=g, device="cuda", dtype=torch.bfloat16)
    x = y_in[:, :C]  # a column slice of the projection's output, as in the model
    weight = torch.randn((C, W), generator=g, device="cuda", dtype=torch.bfloat16)
    state = torch.randn((tile, C, W - 1), generator=g, device="cuda", dtype=torch.bfloat16)
    slots = torch.full((tile,), -1, dtype=torch.int64, device="cuda")
    slots[:real] = torch.arange(real, device="cuda")
    best = None
    for st in SETTINGS:
        conv._TUNE.clear()
        conv._TUNE.update(st)
        us = sum(t for name, (_, t) in kernel_profile(lambda: conv.short_conv_step_(x, weight, state, slots),
                                                      reps=50).items() if "short_conv_step" in name)
        print(f"conv step {st}: {us:.2f} us", flush=True)
        best = min(best or (us, st), (us, st), key=lambda p: p[0])
    conv._TUNE.clear()
    print(f"fastest conv step: {best[1]} {best[0]:.2f} us")


if __name__ == "__main__":
    main()
