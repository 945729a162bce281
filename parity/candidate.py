"""What is judged against an op's record: a :class:`Candidate`, any callable with the record's
signature. The registered optimized op is one candidate (``optimized``), the float32 stand-in
another (``reference-f32``); :func:`of` makes one of any other callable (an adapter fitting an
outside kernel to the record's signature).

A candidate says how it is called (normalized: ``cand(inputs, kwargs) -> {output: tensor}``),
which launch counter must move on every call (the repository's kernels only), whether the bounds
take the platform's measured store rounding (Triton kernels: parity.platform) or IEEE round to
nearest, and where it runs by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .platform import NEAREST, default_device, store_rounding
from .registry import OpRecord, describe

NAMES = ("optimized", "reference-f32")


@dataclass(frozen=True)
class Candidate:
    name: str                      # "optimized", "reference-f32", or the callable's module:qualname
    fn: Callable                   # the op's signature
    counter: str | None = None     # optimized._counters name that must move on every call
    rowwise: bool = False          # evaluated one batch row at a time (see :func:`rowwise`)
    triton: bool = False           # runs this repository's Triton kernels (rounding measured)
    home: str | None = None        # default device (None: cuda if available, else cpu)

    def normalized(self, record: OpRecord) -> Callable:
        cand = record.candidate(self.fn)
        return rowwise(record, cand) if self.rowwise else cand

    def device(self, device: str | None = None) -> str:
        return device or self.home or default_device(None)

    def rounding(self, dtype: str, device: str) -> str:
        """How the candidate's stores round at ``dtype`` on ``device``."""
        return store_rounding(dtype, device) if self.triton else NEAREST


def optimized(record: OpRecord) -> Candidate:
    """The record's optimized op; on CPU the interpreter is made faithful for bf16 dots (what the
    GPU computes: optimized/_interpreter.py). ImportError / AttributeError if it is unavailable."""
    import optimized as opt  # here, not at the top: importing optimized picks the Triton backend

    if opt.interpreting():
        opt.install_faithful_bf16_dot()
    return Candidate("optimized", record.optimized_callable(), counter=record.counter_name, triton=True)


def standin(record: OpRecord) -> Candidate:
    """The float32 stand-in (parity.emulate), on the CPU, row by row."""
    return Candidate("reference-f32", record.emulated, rowwise=True, home="cpu")


def of(fn: Callable, *, name: str | None = None, triton: bool = False) -> Candidate:
    """Any callable with the record's signature: no launch counter; IEEE rounding, or the rounding
    measured for this repository's Triton kernels (``triton=True``: a kernel test calling one of
    them another way)."""
    return Candidate(name or describe(fn), fn, triton=triton)


def named(record: OpRecord, candidate) -> Candidate:
    """``candidate`` as a :class:`Candidate`: itself, ``"optimized"``, ``"reference-f32"``, or a
    callable (:func:`of`)."""
    if isinstance(candidate, Candidate):
        return candidate
    if candidate == "optimized":
        return optimized(record)
    if candidate == "reference-f32":
        return standin(record)
    if callable(candidate):
        return of(candidate)
    raise ValueError(f"candidate: expected one of {NAMES}, a Candidate or a callable, got {candidate!r}")


def rowwise(record: OpRecord, cand):
    """``cand`` evaluated one batch row at a time (rows concatenated), so that its outputs do not
    depend on the batch composition: torch's CPU matmuls and reductions pick their blocking from the
    shapes, which no kernel contract forbids, but the bytes strength asks the stand-in for it."""
    spec = record.batch
    if not spec:
        return cand

    def run(inp, kw):
        if inp.get("cu_seqlens") is not None:
            return cand(inp, kw)
        axes = {k: a for k, a in spec["inputs"].items() if inp.get(k) is not None}
        n = inp[next(iter(axes))].shape[next(iter(axes.values()))]
        parts = []
        for i in range(n):
            sub = dict(inp)
            for k, a in axes.items():
                sub[k] = inp[k].narrow(a, i, 1)
            parts.append(cand(sub, kw))
        # outputs without a batch axis (an in-place pool shared by the rows) come from the last call
        return {o: torch.cat([p[o] for p in parts], dim=spec["outputs"][o]) if o in spec["outputs"]
                else parts[-1][o] for o in record.outputs}

    return run
