"""Bitwise comparison of the chunked KDA across two source trees: run ``--save`` with one tree first
on PYTHONPATH (e.g. ``git archive`` of the last commit unpacked under variants/base), then
``--compare`` with the other, on the same GPU. For changes that must keep the bits but touch more
than one helper (candidates_kda.py swaps single helpers in one tree).

    PYTHONPATH=variants/base:$PWD python3 benchmarks/bits_kda.py --save /tmp/bits.pt
    PYTHONPATH=$PWD python3 benchmarks/bits_kda.py --compare /tmp/bits.pt

Prints one JSON line per shape: same_bits, and where they differ, the count of differing elements
of o and of the final state.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: its tree wins


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "1x16384", "8x4096"], help="BxT")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="PATH")
    mode.add_argument("--compare", metavar="PATH")
    args = ap.parse_args(argv)
    import torch

    import optimized.kda as okda
    from benchmarks.bench_kda import prefill_inputs

    print(f"optimized from {Path(okda.__file__).resolve().parent}", flush=True)
    saved = {} if args.save else torch.load(args.compare)
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        o, s = okda.fused_chunked(*prefill_inputs(B, T))
        if args.save:
            saved[shape] = (o.cpu(), s.cpu())
            continue
        ro, rs = saved[shape]
        do, ds = int((o.cpu() != ro).sum()), int((s.cpu() != rs).sum())
        print(json.dumps({"shape": shape, "same_bits": do == 0 and ds == 0, "o_differ": do,
                          "state_differ": ds}), flush=True)
    if args.save:
        torch.save(saved, args.save)
        print(f"saved {sorted(saved)} -> {args.save}")


if __name__ == "__main__":
    main()
