"""Candidate replacements for helpers of the chunked KDA's `_blocks_kernel`: each swapped in by
module attribute before the first compile (a fresh process per candidate, as in ablate_kda.py), its
output and final state compared bitwise with the kernel on main (required of a bit-keeping
candidate, informative for the others), then timed.

    python benchmarks/candidates_kda.py [--shapes 1x4096 1x65536] [--warps 2]   # GPU: bits and time
    python benchmarks/candidates_kda.py --inspect [--warps 2 4]                  # no GPU: sm_90 builds

Candidates (@triton.jit replacements defined here, registered in CANDIDATES with whether they must
keep the bits; one that need not is checked against test_kda's bound by tests/benchmarks and, if
promoted, re-certified): none pending.

History (H200, session 12, 2 warps, T = 65536; blocks kernel time against main's):
  diag-shared   `_diag_block` with one [BC, K] exp and one G gather per level, not two (the rows of
                a level's left factors and the columns of its right factors are complementary):
                bitwise equal, 3.93 -> 3.63 ms; now main's `_diag_block`.
  diag-stacked  each level's key and query products as one 32-row dot: bitwise equal under the
                interpreter but not on the GPU, and 2.3x slower (8.45 ms against 3.65); dropped.
  l2norm-rcp    the fused l2norm as x * (1 / sqrt(sum x^2 + eps)), one division per row, not per
                element (`_load_rows`, `_cols_through_ref`): 3.62 -> 3.56 ms, the same bits at
                1x16384 and 1x65536 (other bits possible: not exact by construction); now main's.
  inverse-halves  `_unit_lower_inverse` by 8x8 halves, the two halves by forward substitution side
                by side (7 steps, not 15), the lower-left block as -X22 (A21 X11) in two fp32 dots:
                3.62 -> 3.59 ms (the same output bits at those shapes); not kept for 1%.
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

#: name: (((helper of optimized.kda.chunk, replacement), ...), keeps the bits)
CANDIDATES: dict = {}


def swap_in(name: str) -> None:
    """Replace a helper of optimized.kda.chunk by the candidate (before any kernel compiles)."""
    if name != "main":
        from optimized.kda import chunk

        for attr, fn in CANDIDATES[name][0]:
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
