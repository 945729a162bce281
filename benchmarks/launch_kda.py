"""Launch settings of the chunked KDA that must keep the bits: each setting's ``fused_chunked``
output and final state compared bitwise (torch.equal) with the defaults' on the same inputs, and its
kernel time per call (bf16, H=32, K=V=128; ``optimized.kda.chunk._TUNE``). tune_kda.py picks the
fastest setting per kernel; this shows a setting is safe to make a default without re-certifying.

    python benchmarks/launch_kda.py [--shapes 1x16384 1x65536 8x4096] [--out launch_kda.jsonl]

Each line printed (and written to --out) is one (shape, setting): same_bits (null for the defaults
themselves), the sum of kernel times and each kernel's us per call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the defaults first (the comparison base), then one change at a time (session 11's settings, now
#: defaults or measured slower, are in docs/BENCHMARKS.md)
SETTINGS = [{}, {"blocks_maxnreg": 128}, {"blocks_maxnreg": 160}, {"blocks_maxnreg": 200},
            {"blocks_maxnreg": 128, "blocks_stages": 2}, {"blocks_maxnreg": 96}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["1x16384", "1x65536", "8x4096"], help="BxT")
    ap.add_argument("--out", default="launch_kda.jsonl")
    args = ap.parse_args(argv)
    import torch

    import optimized.kda as okda
    from benchmarks.bench_kda import prefill_inputs
    from benchmarks.harness import kernel_profile
    from optimized.kda import chunk

    with open(args.out, "w") as out:
        for shape in args.shapes:
            B, T = (int(x) for x in shape.split("x"))
            inputs = prefill_inputs(B, T)
            base = None
            for setting in SETTINGS:
                chunk._TUNE.clear()
                chunk._TUNE.update(setting)
                try:
                    o, s = okda.fused_chunked(*inputs)
                    same = None if base is None else bool(torch.equal(o, base[0]) and torch.equal(s, base[1]))
                    base = base or (o.clone(), s.clone())
                    table = kernel_profile(lambda: okda.fused_chunked(*inputs), reps=5)
                    row = {"B": B, "T": T, "setting": setting, "same_bits": same,
                           "all_us": round(sum(t for _, t in table.values()), 1),
                           **{k.strip("_").removesuffix("_kernel"): round(t, 1)
                              for k, (_, t) in table.items()}}
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                    row = {"B": B, "T": T, "setting": setting,
                           "failed": f"{type(exc).__name__}: {str(exc)[:150]}"}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
    chunk._TUNE.clear()


if __name__ == "__main__":
    main()
