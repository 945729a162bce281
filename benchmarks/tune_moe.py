"""Launch-configuration sweep of the MoE decode kernels (``optimized.moe._TUNE``): the routed
experts' GEMV form (one layer's 8 experts and its shared expert, as the model runs them, at B=1 and
B=64) and ``router_logits`` (at B=1 and B=64; a 64-copy rotation of router weights keeps them in
HBM), per-kernel GPU time at the 48B model's sizes (bf16, E=256, D=2304, F=1024) for each setting,
so the defaults are chosen from measurements.

Each call routes the token to the next 8 of 256 experts (a fixed random permutation): one expert's
weights are read once per 32 calls, so they come from HBM as in a decode step, not from the L2.
BLOCK_D (gate/up) and BLOCK_F (down) set the lane sums of each dot product (its summation order):
a new default changes bits and is re-certified (``parity certify --device cuda``); nothing here
depends on the number of rows.

    python benchmarks/tune_moe.py [--kernels gate_up down router] [--best-out best.json]
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
           for f, d, w in itertools.product((8, 16, 32, 64), (128, 256, 512), (1, 2, 4, 8))]
DOWN = [{"down_d": d, "down_f": f, "down_warps": w}
        for d, f, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8))]
ROUTER = [{"router_t": t, "router_e": e, "router_d": d, "router_warps": w}
          for t, e, d, w in itertools.product((1, 8), (1, 2), (1024, 2048, 4096), (4, 8))]
KERNEL = {"gate_up": "_gemv_gate_up_kernel", "down": "_gemv_down_kernel", "router": "_router_logits_kernel"}
SETTINGS = {"gate_up": GATE_UP, "down": DOWN, "router": ROUTER}
#: the decode tile's rows (optimized.model): router_logits runs on the real rows, timed at B = 1 and 64
TILE = 64


#: the 48B model's routed experts: count, hidden size, expert width, experts per token
E, D, F, KE = 256, 2304, 1024, 8


def expert_weights(g: torch.Generator):
    """Random bf16 routed-expert weights at the 48B sizes on the GPU: (w1, w2, w3), stacked."""
    w1, w3 = (torch.randn((E, F, D), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w2 = torch.randn((E, D, F), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    return w1, w2, w3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="*", default=list(KERNEL), choices=list(KERNEL))
    ap.add_argument("--best-out", default=None, help="write the fastest setting per kernel here (JSON)")
    ap.add_argument("--no-shared", action="store_true",
                    help="the routed experts alone (default: with the shared expert as a ninth pair, as in the model)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times kernels)")
    from optimized import moe

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    w1, w2, w3 = expert_weights(g)
    x = torch.randn((TILE, D), generator=g, device="cuda", dtype=bf16)
    wts = torch.rand((1, KE), generator=g, device="cuda")
    perm = torch.randperm(E, generator=g, device="cuda").view(E // KE, 1, KE)
    out = torch.zeros((1, D), device="cuda", dtype=bf16)
    routers = torch.randn((64, E, D), generator=g, device="cuda") * 0.02  # 151 MB, taken in turn: from HBM
    call = itertools.count()

    groups = perm.shape[0]
    # the shared expert, as the model runs it (one more GEMV pair per token): an expert of the group
    # half a rotation away, so it too comes from HBM
    shared = [(w1[i], w3[i], w2[i]) for i in perm[:, 0, 0].roll(groups // 2).tolist()]

    gcpu = torch.Generator().manual_seed(1)  # B = 64: each token's 8 experts drawn at random
    ids64 = torch.stack([torch.randperm(E, generator=gcpu)[:KE] for _ in range(4 * TILE)]).view(4, TILE, KE).cuda()
    wts64 = torch.rand((TILE, KE), generator=g, device="cuda")
    out64 = torch.zeros((TILE, D), device="cuda", dtype=bf16)

    def layer(B):
        c = next(call) % groups
        ids, w, o = (perm[c], wts, out) if B == 1 else (ids64[c % 4], wts64, out64)
        if args.no_shared:
            moe._experts("moe.experts", x[:B], w, ids, w1, w2, w3, form="gemv", add_to=o)
        else:
            moe._experts("moe.experts", x[:B], w, ids, w1, w2, w3, form="gemv", shared=shared[c], out=o)

    def router(B):
        moe.router_logits(x[:B], routers[next(call) % routers.shape[0]])

    run = {"gate_up": layer, "down": layer, "router": router}
    sizes = {"gate_up": (1, TILE), "down": (1, TILE), "router": (1, TILE)}
    pairs = KE if args.no_shared else KE + 1
    floor_us = {"gate_up": 2 * pairs * F * D * 2 / HBM_BYTES_PER_S * 1e6,
                "down": pairs * D * F * 2 / HBM_BYTES_PER_S * 1e6,
                "router": E * D * 4 / HBM_BYTES_PER_S * 1e6}
    best: dict = {}
    for which in args.kernels:
        for settings in SETTINGS[which]:
            moe._TUNE.clear()
            moe._TUNE.update(settings)
            times = []
            try:
                for B in sizes[which]:
                    times.append(kernel_profile(lambda: run[which](B), reps=32)[KERNEL[which]][1])
            except Exception as exc:  # noqa: BLE001 - e.g. out of registers: report, go on
                print(f"{which} {settings}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            shown = ", ".join(f"B={B} {us:.2f} us" for B, us in zip(sizes[which], times))
            print(f"{which} {settings}: {shown} ({floor_us[which] / times[0]:.0%} of the HBM floor "
                  f"{floor_us[which]:.2f} us at B=1)", flush=True)
            us = times[0]  # chosen by B = 1; B = 64 printed to see what it costs there
            if which not in best or us < best[which][0]:
                best[which] = (us, settings)
    moe._TUNE.clear()
    for which, (us, settings) in best.items():
        print(f"fastest {which}: {settings} {us:.2f} us")
    if args.best_out:
        Path(args.best_out).write_text(json.dumps({k: {"us": us, **st} for k, (us, st) in best.items()}))


if __name__ == "__main__":
    main()
