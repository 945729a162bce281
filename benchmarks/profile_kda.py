"""Per-kernel GPU time of one KDA call (torch.profiler), to see where a prefill or decode spends it.

    python benchmarks/profile_kda.py [--T 4096 65536] [--B8]

Prints one line per kernel: name, calls per KDA call, microseconds per KDA call.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_kda import prefill_inputs  # noqa: E402
from benchmarks.harness import kernel_profile, show_kernel_profile  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--B", type=int, default=1)
    args = ap.parse_args(argv)
    import optimized.kda as okda

    for T in args.T:
        q, k, v, g_raw, beta, A_log, dt_bias = prefill_inputs(args.B, T)
        show_kernel_profile(f"fused_chunked B={args.B} T={T}",
             kernel_profile(lambda: okda.fused_chunked(q, k, v, g_raw, beta, A_log, dt_bias)))


if __name__ == "__main__":
    main()
