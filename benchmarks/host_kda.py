"""Our own Python in one eager KDA prefill call, on the CPU: ``kda.fused_chunked`` under the bounded
gate at chunk 16 with every kernel launch stubbed out, so what is timed is the host work a GPU
call does before and around its launches (input checks, the plan, the launches' arguments and
allocations), not Triton's launcher nor any kernel.

    python benchmarks/host_kda.py [--shape 1x1024x32] [--calls 3000] [--repeats 5] [--out host.json]

Prints microseconds a call, each the fastest of ``--repeats`` timings (a shared machine's speed
varies by up to 2x from one second to the next): the whole call, the call with its allocations
taken from a cache (what the rest costs), the input checks and the plan alone, and the functions
with the most time of their own (cProfile, allocations cached). A machine's figures depend on its
CPU: compare rows of one machine only.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_kda import LOWER_BOUND, bounded_inputs  # noqa: E402
from benchmarks.harness import environment  # noqa: E402


def per_call_us(fn, calls: int, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``calls`` calls, in us a call."""
    for _ in range(max(10, calls // 30)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


@contextmanager
def launches_stubbed():
    """Every optimized/ kernel launch returns at once (nothing compiled, nothing run)."""
    from optimized import _jit

    run = _jit.Kernel.run
    _jit.Kernel.run = lambda self, *a, grid, warmup, **kw: None
    try:
        yield
    finally:
        _jit.Kernel.run = run


@contextmanager
def allocations_cached():
    """``torch.empty`` / ``empty_like`` hand back one tensor per (shape, dtype), made once."""
    empty, empty_like, cache = torch.empty, torch.empty_like, {}

    def cached(*size, dtype=None, device=None, **_):
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        key = (size, dtype or torch.get_default_dtype())
        if key not in cache:
            cache[key] = empty(*size, dtype=key[1])
        return cache[key]

    torch.empty = cached
    torch.empty_like = lambda t, **kw: cached(*t.shape, dtype=kw.get("dtype", t.dtype))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1x1024x32", help="BxTxH (K = V = 128)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5, help="timings of --calls calls; the fastest is kept")
    ap.add_argument("--top", type=int, default=12, help="functions listed by their own time")
    ap.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        sys.exit("error: --calls and --repeats: expected at least 1")
    try:
        B, T, Hn = (int(n) for n in args.shape.split("x"))
    except ValueError:
        sys.exit(f"error: --shape: expected BxTxH, got {args.shape!r}")
    import optimized
    import optimized.kda as okda
    from optimized.kda import chunk

    optimized.use("cpu")
    q, k, v, g, b, A_log, dt_bias = bounded_inputs(B, T, Hn, dev="cpu")

    def call():
        okda.fused_chunked(q, k, v, g, b, A_log, dt_bias, lower_bound=LOWER_BOUND, chunk_size=16)

    sizes = (B, T, Hn, Hn, q.shape[-1], v.shape[-1])
    figures = {}
    with launches_stubbed():
        n, r = args.calls, args.repeats
        figures["call_us"] = per_call_us(call, n, r)
        with allocations_cached():
            figures["call_allocations_cached_us"] = per_call_us(call, n, r)
            figures["checks_us"] = per_call_us(lambda: chunk._check_inputs(
                "kda.fused_chunked", q, k, v, g, b, A_log, dt_bias, 16, True, LOWER_BOUND), n, r)
            figures["plan_us"] = per_call_us(lambda: chunk._plan(
                "kda.fused_chunked", sizes, 16, q.dtype, None, q.device), n, r)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                call()
            prof.disable()
    for name, us in figures.items():
        print(f"{name:28s} {us:8.1f} us")
    stats = pstats.Stats(prof)
    own = sorted(((st[2] / args.calls * 1e6, f"{Path(fn[0]).name}:{fn[1]} {fn[2]}")
                  for fn, st in stats.stats.items()), reverse=True)[:args.top]
    print("own time a call (cProfile, allocations cached; the profiler's cost included):")
    for us, where in own:
        print(f"  {us:7.1f} us  {where}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/host_kda.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "shape": args.shape, **figures, "own_time_us": [{"us": us, "function": w} for us, w in own],
            "environment": environment()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
