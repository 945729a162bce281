"""Candidate replacements for helpers of the chunked KDA's `_blocks_kernel` that must keep its bits:
each swapped in by module attribute before the first compile (a fresh process per candidate, as in
ablate_kda.py), its output and final state compared bitwise with the kernel on main, then timed.

    python benchmarks/candidates_kda.py [--shapes 1x4096 1x65536] [--warps 2]   # GPU: bits and time
    python benchmarks/candidates_kda.py --inspect [--warps 2 4]                  # no GPU: sm_90 builds

Candidates:
  diag-stacked  `_diag_block` with each level's key and query products stacked into one 32-row
                tl.dot ([kt*left; qt*left] @ right): on 2 warps each warp one 16-row tile, where
                two 16-row dots repeat every product on both warps. Offline (triton 3.9, 2 warps):
                216 registers and no stack against 255 and 128 B, mma 96 against 160, bar.sync 79
                against 41. Bitwise equal under the interpreter (tests/benchmarks).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optimized.kda._common import SUM, dot  # noqa: E402


@triton.jit
def _stack_rows(a, b, N: tl.constexpr, K: tl.constexpr):
    """[2N, K]: the rows of a, then those of b."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * N, K))


@triton.jit
def _diag_block_stacked(Gc, kt, qt, Gm, t0, r0, c16, last, i_hv, HV: tl.constexpr, K: tl.constexpr, dk,
                        mk, BC: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
    """optimized.kda.chunk._diag_block with the two products of a level as one 32-row dot."""
    tl.static_assert(BC == 16)
    BK: tl.constexpr = kt.shape[1]
    A = tl.zeros([BC, BC], dtype=ACC)
    Qm = tl.zeros([BC, BC], dtype=ACC)
    for lvl in tl.static_range(0, 4):
        s = BC >> (lvl + 1)
        row_in = (c16 & s) != 0
        col_in = (c16 & s) == 0
        ref_r = tl.where(row_in, (c16 // s) * s, c16)
        ref_c = tl.where(col_in, (c16 // s + 1) * s, c16)
        Gq = tl.load(Gc + (tl.minimum(t0 + r0 + ref_c, last) * HV + i_hv)[:, None] * K + dk[None, :],
                     mask=mk[None, :], other=0.0).to(ACC)
        right = tl.trans(kt * tl.exp(Gq - Gm))
        sq = ((c16 // (2 * s))[:, None] == (c16 // (2 * s))[None, :]) & row_in[:, None] & col_in[None, :]
        if s == 1:
            lk = kt
            lq = qt
        else:
            Gr = tl.load(Gc + (tl.minimum(t0 + r0 + ref_r, last) * HV + i_hv)[:, None] * K + dk[None, :],
                         mask=mk[None, :], other=0.0).to(ACC)
            left = tl.exp(Gm - Gr)
            lk = kt * left
            lq = qt * left
        both = dot(_stack_rows(lk.to(DT), lq.to(DT), BC, BK), right, DT, ACC)  # [2 BC, BC]
        a_l, q_l = tl.split(tl.permute(tl.reshape(both, (2, BC, BC)), (1, 2, 0)))
        A = tl.where(sq, a_l, A)
        Qm = tl.where(sq, q_l, Qm)
    qk = tl.reduce(qt * kt, 1, SUM)
    Qm = tl.where(c16[:, None] == c16[None, :], qk[:, None], Qm)
    return A, Qm


CANDIDATES = {"diag-stacked": ("_diag_block", _diag_block_stacked)}


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
