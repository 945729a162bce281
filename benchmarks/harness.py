"""Shared benchmark harness: CUDA-event timing through ``triton.testing.do_bench``, physical floors,
and JSON results that ``render.py`` turns into ``docs/BENCHMARKS.md``.

Timing: ``do_bench`` warms up, flushes the L2 between repetitions and times each call with CUDA
events; we keep the median and the 20th/80th percentiles. Host overhead is part of what is measured
(a decode step that waits on Python is slow for real), so nothing is graph-captured unless the
benchmark says so.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from collections import defaultdict
from pathlib import Path

from benchmarks.code_digest import code_digest

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy rate on the H200 (KINDS.md), not the datasheet 4.8
BF16_FLOPS = 7.9e14  # measured dense bf16 GEMM rate on the H200


@dataclass
class Result:
    op: str
    params: dict
    ours_ms: float | None
    ours_spread_ms: tuple[float, float] | None = None
    fla_ms: float | None = None
    baseline: str | None = None  # what fla_ms / baseline_ms is, when not fla
    baseline_ms: float | None = None
    bytes_moved: float | None = None
    flops: float | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def floor_ms(self) -> float | None:
        floors = []
        if self.bytes_moved:
            floors.append(self.bytes_moved / HBM_BYTES_PER_S * 1e3)
        if self.flops:
            floors.append(self.flops / BF16_FLOPS * 1e3)
        return max(floors) if floors else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["floor_ms"] = self.floor_ms
        return d


def bench(fn, *, warmup_ms: int = 25, rep_ms: int = 200) -> tuple[float, tuple[float, float]]:
    """Median and (p20, p80) in milliseconds of ``fn()`` on the current CUDA device."""
    import triton.testing

    p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return float(p50), (float(p20), float(p80))


def wall_per_call(fn, *, iters: int = 200) -> float:
    """Wall-clock milliseconds per call including the Python call, synchronised at the end."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream, as torch's docs do it);
    returns the replay callable, or None (the reason printed) when ``fn`` cannot be captured. A
    serving engine replays its decode step this way: what remains is the GPU time plus one launch."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking the eager path
        print(f"  CUDA graph capture failed: {type(exc).__name__}: {exc}")
        return None
    return graph.replay


def graph_timings(fn) -> dict:
    """``{"graph_ms": device ms per replay, "graph_wall_ms_per_call": wall ms per replay}`` of ``fn``
    captured by :func:`graphed` (empty when it cannot be captured)."""
    replay = graphed(fn)
    if replay is None:
        return {}
    return {"graph_ms": bench(replay)[0], "graph_wall_ms_per_call": wall_per_call(replay)}


def environment() -> dict:
    import torch
    import triton

    from optimized._pdl import enabled as pdl_enabled

    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        rev = None
    env = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_revision": rev,
        # what ran, where a copy of the tree carries a stale or no .git (a device machine's)
        "code_digest": code_digest(Path(__file__).resolve().parents[1]),
        # programmatic dependent launch of the decode kernels (optimized._pdl; sm_90 and later)
        "pdl": torch.cuda.is_available() and pdl_enabled(torch.device("cuda")),
    }
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "unknown")
    except ImportError:
        env["fla"] = None
    return env


def add_pdl_option(ap) -> None:
    """``--pdl on|off``: launch the decode kernels with programmatic dependent launch (the default)
    or without it (the A/B baseline; ``KIMI_PARITY_PDL=0``). Apply with :func:`apply_pdl`."""
    ap.add_argument("--pdl", choices=["on", "off"], default="on",
                    help="programmatic dependent launch of the decode kernels (sm_90+; default on)")


def apply_pdl(choice: str) -> None:
    from optimized import _pdl

    os.environ[_pdl.ENV] = "1" if choice == "on" else "0"


def save(results: list[Result], path: str | os.PathLike, *, command: str) -> None:
    payload = {"command": command, "environment": environment(), "results": [r.as_dict() for r in results]}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path} ({len(results)} results)")


def kernel_profile(fn, reps: int = 5) -> dict:
    """{kernel name: (launches per call, device us per call)} over ``reps`` calls after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time
    return {k: (n / reps, us / reps) for k, (n, us) in per.items()}


def show_kernel_profile(title: str, table: dict) -> None:
    total = sum(us for _, us in table.values())
    print(f"== {title}: {total:.1f} us of kernels per call")
    for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"   {us:10.1f} us  x{n:<4g} {name[:90]}")
