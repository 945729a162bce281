"""Searching for a correct implementation past its bound (``parity search``; docs/certificates.md,
"Searching for a counterexample").

A bound must hold for every correct implementation on every input, not only on the few shape
buckets an op's record draws for certification. The search draws the record's wide inputs
(``OpRecord.search_cases``: the KDA ops draw any head shape, long and varlen sequences, decays from
long memory to e^-12 per step, read-outs that cancel; an op without wide inputs draws its own
builder's) and lets ``hypothesis.target`` climb toward the worst error in bound units. Each input
is judged exactly as certification judges it (``parity.certify.check``: inputs rounded to the run dtype,
the float64 reference run on the rounded values, every output held to the record's bound under the
candidate's arithmetic contract). Any :class:`parity.certify.candidate.Candidate` is searched: the
registered kernels (``optimized``), the float32 stand-in (``reference-f32``), or an outside
implementation (``candidate.of``, ``--impl``).

A result past its bound means one of two things, and telling them apart is the point: the
implementation is wrong, or the bound is missing a term (docs/error-bounds.md).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings, target
from hypothesis.reporting import with_reporter

from ..atomic import atomic_write
from ..errors import Unsupported
from ..registry import SEARCH_SPACES, Case, OpRecord
from .candidate import Candidate, named
from .check import check, prepare

RATIO_CAP = 1e6   # hypothesis.target needs a finite score: an infinite ratio counts as this
FORMAT = "kimi-parity/search"


@dataclass
class SearchResult:
    """The worst one candidate reached on one op and dtype."""

    op: str
    candidate: str
    dtype: str
    device: str
    contract: str = "ieee"       # the arithmetic it was judged under (parity.bounds.core.CONTRACTS)
    space: str = "full"
    worst_ratio: float = 0.0
    worst_label: str = ""
    worst_output: str = ""
    examples: int = 0
    past_bound: int = 0          # inputs past their bound
    unsupported: int = 0         # inputs the implementation refused (parity.errors.Unsupported)
    errors: list = field(default_factory=list)   # what it raised or why its outputs were not its own (first 3)
    seconds: float = 0.0
    worst_case: Case | None = field(default=None, repr=False)   # the input that reached worst_ratio

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "worst_case"}
        d["worst_ratio"] = self.worst_ratio if math.isfinite(self.worst_ratio) else None  # null: inf
        return d


def judge_case(record: OpRecord, case: Case, cand: Candidate, dtype: str, device: str):
    """The ``parity.certify.check.Judgement`` of ``cand`` on ``case`` at ``dtype`` on ``device``, as
    certification judges it. Raises ``Unsupported`` when the implementation refuses the input."""
    prepared = prepare(record, case, dtype, device, contract=cand.contract)
    j = check(prepared, cand.normalized(record), counter=cand.counter)
    if j.kernel_ran is False and not j.error:   # not its own work: past any bound
        j.passed, j.ratio = False, math.inf
        j.error = j.witness or "the kernel did not run (its launch counter did not move)"
    return j


def search(record: OpRecord, candidate, dtype: str, *, device: str | None = None, examples: int = 10,
           seconds: float = math.inf, space: str = "full", derandomize: bool = True,
           fail: bool = False) -> SearchResult:
    """Draw up to ``examples`` wide inputs of ``record`` (stopping after ``seconds``), climbing
    toward the worst ratio of ``candidate`` (a :class:`Candidate`, ``"optimized"``,
    ``"reference-f32"`` or a callable with the op's signature) at ``dtype``. ``fail``: assert every
    ratio <= 1 (hypothesis then shrinks a failure to a simpler input); else report the worst."""
    if space not in SEARCH_SPACES:
        raise ValueError(f"space: expected one of {SEARCH_SPACES}, got {space!r}")
    cand = named(record, candidate)
    device = cand.device(device)
    res = SearchResult(record.name, cand.name, dtype, device, contract=cand.contract, space=space)
    t0 = time.monotonic()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(record.search_cases(space))
    def body(case):
        if time.monotonic() - t0 > seconds:
            raise _OutOfTime  # not an Exception: hypothesis stops at once instead of shrinking
        try:
            j = judge_case(record, case, cand, dtype, device)
        except Unsupported:
            res.unsupported += 1
            return
        worst = max(j.outputs, key=lambda n: j.outputs[n].ratio) if j.outputs else ""
        res.examples += 1
        if j.error and len(res.errors) < 3:
            res.errors.append(f"{case.label}: {j.error}")
        res.past_bound += j.ratio > 1.0
        if j.ratio >= res.worst_ratio:
            res.worst_ratio, res.worst_label, res.worst_output, res.worst_case = j.ratio, case.label, worst, case
        target(min(j.ratio, RATIO_CAP), label=f"{record.name} {cand.name} {dtype}")
        if fail:
            assert j.ratio <= 1.0, (f"{cand.name} {record.name} {dtype} {case.label}: {j.ratio:.3g}x its bound\n"
                                    f"{j.report()}")

    try:
        if fail:
            body()
        else:  # a search that reports its worst has no failure to print (not even the time-out's seed)
            with with_reporter(lambda *a, **k: None):
                body()
    except _OutOfTime:
        pass
    res.seconds = time.monotonic() - t0
    return res


class _OutOfTime(BaseException):
    """Raised inside a search's hypothesis test when its time is up (see ``search``)."""


# -- inputs past their bound, kept for replay -------------------------------------------------------
def save_case(case: Case, path) -> None:
    """``case`` as an .npz (arrays; ``kwargs`` and ``label`` as JSON): ``load_case`` reads it back."""
    arrays = {f"a_{k}": v for k, v in case.arrays.items() if v is not None}
    meta = json.dumps({"kwargs": case.kwargs, "label": case.label})

    def write(f):
        np.savez(f, meta=np.array(meta), **arrays)

    atomic_write(path, writer=write)


def load_case(path, record: OpRecord) -> Case:
    """The ``Case`` that ``save_case`` wrote for ``record``."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {n: (z[f"a_{n}"] if f"a_{n}" in z else None) for n in (*record.args, *record.kwarg_arrays)}
    return Case(arrays, meta["kwargs"], label=meta["label"])
