"""Write a cases file (``parity certify --cases``) with the long near-collinear input that turned FlashKDA
1ce47ea's output and state NaN on an H100: bf16, K = V = 128, every key of the sequence identical,
raw gate -12 (decay ~1), raw beta 8, A_log = 0, dt_bias = 0, lower bound -5. The records draw that
combination too (``parity.ops.kda.inputs.HOSTILE``, ``neumann``), at the short lengths a CPU can
judge; FlashKDA's NaN needs thousands of chunks of it, so the GPU run replays this one beside the draws.

    python benchmarks/flashkda_cases.py OUT.safetensors [--tokens 16384] [--heads 2]
"""
from __future__ import annotations

import argparse
import sys

import torch

from parity.ops.kda.inputs import core_case
from parity.record.capture import casefile, tensors
from parity.record.capture.recorder import Captured

OP = "kda.fused_chunked+lower_bound"


def long_case(T: int, H: int, seed: int = 0):
    """The case: ``core_case`` of the bounded gate made ``neumann`` over all T tokens."""
    return core_case(1, T, H, H, 128, 128, seed, chunk=64, fused=True, has_state=False, lower_bound=-5.0,
                     hostile="neumann", run=T)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=2)
    args = p.parse_args(argv)
    case = long_case(args.tokens, args.heads)
    frozen = {}
    for name, arr in case.arrays.items():
        if arr is None:
            frozen[name] = None
            continue
        t = torch.from_numpy(arr).to(torch.float32)
        frozen[name] = tensors.freeze(t, limit=1 << 40, seed=0, what=name)
    cap = Captured(OP, "benchmarks/flashkda_cases.py:long_case", "hostile", dict(case.kwargs), frozen,
                   note=f"FlashKDA 1ce47ea's NaN: {case.label}")
    run = {"checkpoint": {"kind": "none", "describe": "no checkpoint: a hostile input built by "
                                                      "benchmarks/flashkda_cases.py"},
           "dtype": "bfloat16", "device": "cuda", "prompt_ids": [], "steps": 0, "store_limit": 1 << 40, "seed": 0,
           "uncaptured": {}}
    casefile.write(args.out, [cap], run=run)
    print(f"wrote {args.out}: {OP} {case.label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
