"""Run the chunked KDA pipeline once on one shape and dtype with given launch settings, synchronously
(CUDA_LAUNCH_BLOCKING=1 is set here), and say which launch fails, if one does: a GPU fault shows
up at its own kernel. One process per setting (a fault poisons the CUDA context).

    python benchmarks/diag_kda.py --dtype bfloat16 --shape 2 65 1 2 32 64 [--tune blocks_stages=1]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", type=int, nargs=6, default=[2, 65, 1, 2, 32, 64], metavar="B T H HV K V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--tune", nargs="*", default=[], help="chunk._TUNE settings, key=int")
    args = ap.parse_args(argv)
    import torch

    import optimized.kda as okda
    from optimized.kda import chunk

    chunk._TUNE.update({k: int(v) for k, v in (t.split("=") for t in args.tune)})
    B, T, H, HV, K, V = args.shape
    dt = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
    v = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dt)
    gg = -torch.rand(B, T, HV, K, device="cuda", generator=g)
    beta = torch.rand(B, T, HV, device="cuda", generator=g)
    h0 = torch.randn(B, HV, K, V, device="cuda", generator=g)
    label = f"{args.dtype} B,T,H,HV,K,V={args.shape} chunk={args.chunk} tune={chunk._TUNE}"
    try:
        o, s = okda.chunked(q, k, v, gg, beta, initial_state=h0, chunk_size=args.chunk)
        torch.cuda.synchronize()
        print(f"ok    {label}: o finite {bool(torch.isfinite(o).all())}")
    except Exception as exc:  # noqa: BLE001 - the point is to name the failing launch
        where = [f for f in traceback.extract_tb(exc.__traceback__) if "optimized" in f.filename]
        at = f"{where[-1].filename.split('optimized/')[-1]}:{where[-1].lineno} {where[-1].line}" if where else "?"
        print(f"FAULT {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} at {at}")


if __name__ == "__main__":
    main()
