"""Candidate replacements for helpers of the chunked KDA's `_blocks_kernel` that must keep its bits:
each swapped in by module attribute before the first compile (a fresh process per candidate, as in
ablate_kda.py), its output and final state compared bitwise with the kernel on main, then timed.

    python benchmarks/candidates_kda.py [--shapes 1x4096 1x65536] [--warps 2]   # GPU: bits and time
    python benchmarks/candidates_kda.py --inspect [--warps 2 4]                  # no GPU: sm_90 builds

Candidates (a @triton.jit replacement defined here, registered in CANDIDATES): none pending.

History (H200, session 12, 2 warps, T = 65536; blocks kernel time against main's):
  diag-shared   `_diag_block` with one [BC, K] exp and one G gather per level, not two (the rows of
                a level's left factors and the columns of its right factors are complementary):
                bitwise equal, 3.93 -> 3.63 ms; now main's `_diag_block`.
  diag-stacked  each level's key and query products as one 32-row dot: bitwise equal under the
                interpreter but not on the GPU, and 2.3x slower (8.45 ms against 3.65); dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: name: (helper of optimized.kda.chunk, the replacement); none registered now (see above)
CANDIDATES: dict = {}


def swap_in(name: str) -> None:
    """Replace a helper of optimized.kda.chunk by the candidate (before any kernel compiles)."""
    if name != "main":
        from optimized.kda import chunk

        attr, fn = CANDIDATES[name]
        setattr(chunk, attr, fn)


def child(name: str, shapes: list[str], warps: int, inspect: bool, ref_dir: Path) -> None:
    swap_in(name)
    if inspect:
        from benchmarks.inspect_kda import compile_kernel, describe

        build = describe(compile_kernel("blocks", warps, 3), ref_dir)
        print(json.dumps({"name": name, "warps": warps, "build": build}))
        return
    import torch

    import optimized.kda as okda
    from benchmarks.bench_kda import prefill_inputs
    from benchmarks.harness import kernel_profile
    from optimized.kda import chunk

    chunk._TUNE["blocks_warps"] = warps
    for shape in shapes:
        B, T = (int(x) for x in shape.split("x"))
        inputs = prefill_inputs(B, T)
        o, s = okda.fused_chunked(*inputs)
        ref = ref_dir / f"{shape}.pt"
        if name == "main":
            torch.save((o.cpu(), s.cpu()), ref)
            same = None
        else:
            ro, rs = torch.load(ref)
            same = bool(torch.equal(o.cpu(), ro) and torch.equal(s.cpu(), rs))
        table = kernel_profile(lambda: okda.fused_chunked(*inputs), reps=5)
        print(json.dumps({"name": name, "warps": warps, "shape": shape, "same_bits": same,
                          "blocks_us": round(table["_blocks_kernel"][1], 1),
                          "all_us": round(sum(t for _, t in table.values()), 1)}), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "1x65536"], help="BxT")
    ap.add_argument("--warps", type=int, nargs="*", default=[2])
    ap.add_argument("--inspect", action="store_true", help="compile for sm_90 here, no GPU")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inspect:
        os.environ["TRITON_INTERPRET"] = "0"
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.child:
        return child(args.child, args.shapes, args.warps[0], args.inspect, Path(args.ref_dir))
    with tempfile.TemporaryDirectory() as tmp:
        for warps in args.warps:
            for name in ["main", *CANDIDATES]:  # main first: the reference bits
                cmd = [sys.executable, __file__, "--child", name, "--warps", str(warps), "--ref-dir", tmp,
                       "--shapes", *args.shapes] + (["--inspect"] if args.inspect else [])
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    err = out.stderr.strip().splitlines()
                    print(f"{name} ({warps} warps): failed: {err[-1] if err else out.returncode}")
                    continue
                for line in out.stdout.splitlines():
                    if line.startswith("{"):
                        print(line, flush=True)


if __name__ == "__main__":
    main()
