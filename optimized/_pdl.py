"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (sm_90 and later).

A kernel launched with PDL may be placed on the SMs while the kernel before it in the stream still
runs, so its launch and ramp-up overlap that kernel's tail instead of following it. A decode step
at B = 1 is hundreds of short kernels, where that gap is a large share (what it saves:
docs/BENCHMARKS.md, "MLA decode" and "MoE layer").

One rule keeps it exact, and every kernel that takes a ``PDL`` flag keeps it: ``pdl_wait(PDL)``
comes before any store and before any load of data the kernel just before it may write, in every
program (also those that then exit). It waits until that kernel has finished and its stores are
visible. What it writes is all that must wait: every kernel lets the next one launch only after
its own wait (``pdl_wait`` triggers the launch after waiting; ``pdl_launch_next`` comes later
still), and a kernel launched without PDL (cuBLAS, torch) lets it launch only as it finishes, so
when a kernel starts, every kernel before the one just before it has finished, its stores
visible. Weights and data written two or more kernels back may be read before the wait (a
decode's attention reads the sequence lengths and block tables there: the q_lat kernel between
them writes neither). An L2 prefetch (``prefetch_l2``) is a hint that feeds no value, so its
addresses may be computed from anything, e.g. a block table the kernel before may still be
writing. As no kernel can finish before the one before it, the order holds down the whole stream,
CUDA graphs included (a PDL launch is captured as a programmatic edge). The arithmetic is
untouched: PDL never changes a bit, only when a kernel starts.

Off on CPU, under the Triton interpreter, before sm_90, and with ``KIMI_PARITY_PDL=0`` (for an
A/B measurement, ``benchmarks/bench_ops.py --pdl off``).
"""
from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

from ._jit import jit
from ._interpreter import interpreting

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

ENV = "KIMI_PARITY_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (read per launch: the environment switch
    takes effect at once, e.g. between two captures of a benchmark)."""
    if device.type != "cuda" or gdc_wait is None or interpreting():
        return False
    if os.environ.get(ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@jit
def pdl_wait(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """Wait for the previous kernel in the stream (its stores visible), then (``LAUNCH_NEXT``) let
    the next one launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@jit
def pdl_launch_next(PDL: tl.constexpr):
    """Let the next kernel launch (for a kernel that waited with ``LAUNCH_NEXT=False``: its
    programs then reach this late, so the next kernel's programs do not sit on the SMs through its
    whole run). A no-op without PDL."""
    if PDL:
        gdc_launch_dependents()


@jit
def prefetch_l2(ptrs, ENABLE: tl.constexpr):
    """Ask L2 for the 128-byte lines holding ``ptrs`` (any shape; one ``prefetch.global.L2`` per
    element), then go on without waiting. A hint: it returns nothing and changes no value, so it
    may precede ``pdl_wait`` and its addresses may come from data another kernel is still writing
    (the stale line is a wasted fetch; L2 is where the GPU's writes meet, so the loads after the
    wait see the written data). A no-op unless ENABLE (GPU launches with PDL only: the interpreter
    has no inline PTX)."""
    if ENABLE:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
