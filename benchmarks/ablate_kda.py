"""Where `_blocks_kernel` (the chunked KDA's costliest kernel) spends its time: the kernel timed with
one of its parts swapped for a cheap stand-in, each variant in a fresh process. The stand-ins
compute garbage (timing only, never for results) but depend on runtime values, so the compiler
cannot fold away what follows them.

    python benchmarks/ablate_kda.py [--T 4096 65536] [--parts none diag inverse cols]
    python benchmarks/ablate_kda.py --inspect      # no GPU: the sm_90 build of each variant

Parts (each a @triton.jit helper of optimized/kda/chunk.py, replaced by module attribute before the
first compile):
  diag     `_diag_block`: the diagonal block's pairs through reference rows (4 levels of exps and dots)
  inverse  `_unit_lower_inverse`: the diagonal block's 15 forward-substitution steps
  cols     `_cols_through_ref`: the earlier sub-blocks' column loads, l2norm and exps (their dots stay)
  none     the kernel as built
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PARTS = ("none", "diag", "inverse", "cols")


@triton.jit
def _diag_stand_in(Gc, kt, qt, Gm, t0, r0, c16, last, i_hv, HV: tl.constexpr, K: tl.constexpr, dk, mk,
                   BC: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
    A = tl.where(c16[:, None] > c16[None, :], 1e-3 * r0.to(ACC), 0.0)
    return A, A


@triton.jit
def _inverse_stand_in(A, c16, BC: tl.constexpr, ACC: tl.constexpr):
    return A + tl.where(c16[:, None] == c16[None, :], 1.0, 0.0).to(ACC)


@triton.jit
def _cols_stand_in(k, Gc, tokT, okT, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   dk, mk, last, Gr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    return (dk[:, None] + tokT[None, :]).to(ACC) * 1e-6


STAND_INS = {"diag": ("_diag_block", _diag_stand_in), "inverse": ("_unit_lower_inverse", _inverse_stand_in),
             "cols": ("_cols_through_ref", _cols_stand_in)}


def swap_in(part: str) -> None:
    """Replace one helper of optimized.kda.chunk by its stand-in (before any kernel compiles)."""
    from optimized.kda import chunk

    if part != "none":
        name, fn = STAND_INS[part]
        setattr(chunk, name, fn)


def child(part: str, T: list[int], inspect: bool) -> None:
    swap_in(part)
    if inspect:
        from benchmarks.inspect_kda import compile_kernel, describe

        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        print(json.dumps({"part": part, "build": describe(compile_kernel("blocks", 4, 2), tmp)}))
        return
    import optimized.kda as okda
    from benchmarks.bench_kda import prefill_inputs
    from benchmarks.harness import kernel_profile

    for t in T:
        inputs = prefill_inputs(1, t)
        table = kernel_profile(lambda: okda.fused_chunked(*inputs), reps=3)
        print(json.dumps({"part": part, "T": t, "blocks_us": round(table["_blocks_kernel"][1], 1)}), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    ap.add_argument("--inspect", action="store_true", help="compile each variant for sm_90 here, no GPU")
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inspect:
        os.environ["TRITON_INTERPRET"] = "0"
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.child:
        return child(args.child, args.T, args.inspect)
    if not args.inspect:
        import torch

        if not torch.cuda.is_available():
            sys.exit("ablate_kda.py: timing needs a CUDA GPU (none here); --inspect compiles the variants without one")
    base = None
    for part in args.parts:  # a fresh process each: a compiled kernel never sees a swapped helper
        cmd = [sys.executable, __file__, "--child", part, "--T", *map(str, args.T)] + (["--inspect"] if args.inspect else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{part}: failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
            continue
        for line in out.stdout.splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "build" in r:
                print(f"{part:8s} {r['build']}")
                continue
            if part == "none":
                base = base or {}
                base[r["T"]] = r["blocks_us"]
            saved = f" (saves {base[r['T']] - r['blocks_us']:.1f} us)" if base and part != "none" and r["T"] in base else ""
            print(f"{part:8s} T={r['T']}: _blocks_kernel {r['blocks_us']:.1f} us{saved}", flush=True)


if __name__ == "__main__":
    main()
