"""KDA prefill forms side by side: ``kda.fused_chunked`` under several ``ChunkLaunch`` settings (the
forms a setting picks, e.g. the state pass with or without the output fused into it) on the same
inputs, each checked against the first setting (bit for bit, else the largest difference in units
of the first's largest output) before it is timed; both gates; per-kernel profile too.

    python benchmarks/kda_forms.py --out forms.json [--shapes 1x4096x32 8x4096x32 1x8192x96]
        [--launches '{"fused_output": false}' '{}' '{"fused_block_v": 16}'] [--chunk-sizes 64 16]

Prints one line per (shape, gate, setting): median ms (``harness.bench``), the byte floor, the
kernels' device us, bits against the first setting.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402
from benchmarks.bench_kda import K, LOWER_BOUND, V, bounded_inputs  # noqa: E402
from benchmarks.harness import HBM_BYTES_PER_S, bench, environment, kernel_profile  # noqa: E402
from benchmarks.tune import same_bits  # noqa: E402

SHAPES = ["1x4096x32", "1x16384x32", "1x65536x32", "8x4096x32", "1x8192x96"]
LAUNCHES = ['{"fused_output": false}', "{}"]


def floor_ms(B, T, Hn) -> float:
    """Read q, k, v, g_raw, beta (bf16), write o (bf16) and the final state (fp32), at HBM_BYTES_PER_S."""
    nbytes = B * T * Hn * (3 * K + V) * 2 + B * T * Hn * K * 2 + B * T * Hn * 2 + B * Hn * K * V * 4
    return nbytes / HBM_BYTES_PER_S * 1e3


def main(argv=None):
    import optimized.kda as okda

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="forms.json")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="BxTxH")
    ap.add_argument("--launches", nargs="+", default=LAUNCHES, help="JSON of ChunkLaunch fields; the first is "
                    "the baseline")
    ap.add_argument("--gates", nargs="+", default=["softplus", "bounded"], choices=["softplus", "bounded"])
    ap.add_argument("--chunk-sizes", nargs="+", type=int, default=[64], choices=[16, 32, 64],
                    help="chunk sizes, each run under every launch (the first launch at the first size is "
                         "the baseline)")
    args = ap.parse_args(argv)
    optimized.use("cuda")
    launches = [replace(okda.ChunkLaunch(), **json.loads(s)) for s in args.launches]
    rows = []
    for shape in args.shapes:
        B, T, Hn = (int(x) for x in shape.split("x"))
        x = bounded_inputs(B, T, Hn)
        for gate in args.gates:
            lb = LOWER_BOUND if gate == "bounded" else None
            q, k, v, g_raw, beta, A_log, dt_bias = x
            base = None
            forms = [(spec, launch, c) for c in args.chunk_sizes for spec, launch in zip(args.launches, launches)]
            for spec, launch, chunk in forms:
                fn = lambda: okda.fused_chunked(q, k, v, g_raw, beta, A_log, dt_bias, launch=launch,  # noqa: E731
                                                lower_bound=lb, chunk_size=chunk)
                out = fn()
                if base is None:
                    base, bits, diff = out, True, 0.0
                else:
                    bits = same_bits(out, base)
                    diff = float((out[0].float() - base[0].float()).abs().max() / base[0].float().abs().max())
                finite = bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())
                ms = bench(fn)[0]
                prof = {k.split("_kernel")[0].lstrip("_"): round(us, 1) for k, (_, us) in kernel_profile(fn, reps=3).items()}
                row = dict(B=B, T=T, H=Hn, gate=gate, launch=json.loads(spec), chunk_size=chunk, ms=ms,
                           floor_ms=floor_ms(B, T, Hn),
                           bits_equal_first=bits, max_diff_rel_first=diff, finite=finite, kernels_us=prof)
                rows.append(row)
                print(f"{shape} {gate:8s} {spec:40s} chunk {chunk} {ms:.3f} ms (floor {row['floor_ms']:.3f}) bits "
                      f"{'equal' if bits else f'differ by {diff:.2e}'}{'' if finite else ' NOT FINITE'} {prof}",
                      flush=True)
                Path(args.out).write_text(json.dumps(dict(environment=environment(), rows=rows), indent=1) + "\n")
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
