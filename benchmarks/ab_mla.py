"""A/B of ``mla.paged_decode`` across source trees: CUDA-graph replay time (tune_mla's setup and
timing: the 48B model's sizes, pages of 64, L2 flushed before each replay) of the default policy
and launch settings at B in {1, 64} x S in {4096, 32768}, for the tree at ROOT (default: this one).
One process per tree (a process imports one ``optimized``), so interleave them to see drift:

    for i in 1 2; do python3 benchmarks/ab_mla.py base/; python3 benchmarks/ab_mla.py .; done

where ``base/`` holds another commit's ``optimized/`` and ``benchmarks/`` (``git archive``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--repeats", type=int, default=3, help="timings per shape (each its own do_bench)")
    args = ap.parse_args(argv)
    if not (Path(args.root) / "optimized" / "mla").is_dir():
        ap.error(f"{args.root}: no optimized/mla there")
    if args.repeats < 1:
        ap.error(f"--repeats: expected a count >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it times kernels)")
    sys.path.insert(0, str(Path(args.root).resolve()))
    from benchmarks.tune_mla import SHAPES, Case  # the tree's own setup and timing

    g = torch.Generator(device="cuda").manual_seed(0)
    for B, S in SHAPES:
        case = Case(B, S, g)
        us = [case.timed(None, {})[0] * 1e3 for _ in range(args.repeats)]
        print(f"{args.root} B={B} S={S}: " + " ".join(f"{u:.1f}" for u in us) + " us", flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
