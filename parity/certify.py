"""Certification of registered ops: the engine behind ``parity certify`` and the tests.

For each op and each requested dtype, hypothesis draws inputs from the record's builder (the
profile's number of examples, ``hypothesis.target`` climbing toward the worst error in bound
units). On every drawn input: the candidate is judged against the bound, every mutant is run (a
mutant is killed when some input makes it fail; its teeth ratio is the worst bound ratio it
reached), and on the first inputs the bytes checks (run-to-run, batch composition) and the two
controls (an all-zeros and an all-NaN candidate, which must fail). For a counted candidate (the
optimized ops) the launch counter must show the kernel ran on every call.

What is certified is a :class:`parity.candidate.Candidate`: the record's optimized op, the float32
stand-in, or any callable with the record's signature.

Verdict: ``certified`` when, at every dtype run, every input passed, the kernel ran, every mutant
was killed and both controls were rejected, and the bytes checks held if the record claims bytes.
Strengths reached: ``lifted`` (a float32/float64 run passed), ``production`` (a bfloat16/float16
run passed), ``bytes``.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from hypothesis import Phase, given, settings, target

from . import strategies
from .candidate import NAMES as CANDIDATES
from .candidate import named, standin
from .check import bytes_checks, check, judge, prepare, run_candidate, strength_of
from .metrics import nearer_truth
from .mutants import CONTROLS
from .platform import default_device
from .registry import OpRecord


def _fin(x):
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass
class MutantResult:
    name: str
    kind: str
    doc: str
    detected: int = 0
    cases: int = 0                # inputs it ran on: until the first that kills it
    teeth: float = 0.0            # worst ratio over those inputs (inf: shape/NaN/degenerate/raised)
    first_failure: str = ""

    @property
    def killed(self) -> bool:
        return self.detected > 0

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "doc": self.doc, "killed": self.killed,
                "teeth": _fin(self.teeth), "teeth_infinite": math.isinf(self.teeth),
                "detected": self.detected, "cases": self.cases, "first_failure": self.first_failure}


@dataclass
class DtypeRun:
    dtype: str
    strength: str
    cases: list = field(default_factory=list)
    mutants: dict = field(default_factory=dict)
    controls: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    seconds: float = 0.0
    rounding: str = "nearest"

    @property
    def worst_ratio(self) -> float:
        return max((c["ratio"] for c in self.cases), default=math.inf)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c["passed"] for c in self.cases)

    @property
    def kernel_ran(self):
        flags = [c["kernel_ran"] for c in self.cases]
        if any(f is None for f in flags):
            return None
        return bool(flags) and all(flags)

    def bytes_ok(self):
        if not self.bytes:
            return None
        vals = [v for k, v in self.bytes.items() if k in ("run_to_run", "batch") and v is not None]
        return all(vals) if vals else None

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "strength": self.strength, "rounding": self.rounding, "passed": self.passed,
                "worst_ratio": _fin(self.worst_ratio), "kernel_ran": self.kernel_ran,
                "bytes": dict(self.bytes), "controls": dict(self.controls), "seconds": round(self.seconds, 3),
                "cases": [{k: (_fin(v) if k == "ratio" else v) for k, v in c.items()} for c in self.cases],
                "mutants": [m.to_dict() for m in self.mutants.values()]}


@dataclass
class OpCertificate:
    record: OpRecord
    candidate: str                                  # the candidate's name
    runs: dict = field(default_factory=dict)        # dtype -> DtypeRun
    error: str | None = None
    counter: str | None = None                      # the launch counter that had to move

    @property
    def op(self) -> str:
        return self.record.name

    def reached(self) -> list:
        out = []
        if any(r.passed and r.strength == "lifted" for r in self.runs.values()):
            out.append("lifted")
        if any(r.passed and r.strength == "production" for r in self.runs.values()):
            out.append("production")
        b = [r.bytes_ok() for r in self.runs.values()]
        if b and all(x is True for x in b):
            out.insert(0, "bytes")
        return out

    def mutants_killed(self) -> tuple[int, int]:
        """(killed at every dtype run, total)."""
        total = len(self.record.mutants)
        killed = sum(all(r.mutants[m.name].killed for r in self.runs.values()) for m in self.record.mutants) \
            if self.runs else 0
        return killed, total

    def teeth(self) -> dict:
        """mutant -> its weakest teeth ratio over the dtypes run."""
        return {m.name: min((r.mutants[m.name].teeth for r in self.runs.values()), default=0.0)
                for m in self.record.mutants}

    def reasons(self) -> list:
        why = []
        if self.error:
            why.append(self.error)
        for d, r in self.runs.items():
            if not r.cases:
                why.append(f"{d}: no input was drawn")
            bad = [c for c in r.cases if not c["passed"]]
            if bad:
                c = bad[0]
                why.append(f"{d}: {len(bad)}/{len(r.cases)} input(s) failed, first {c['label']}: {c['summary']}")
            if self.counter is not None and r.kernel_ran is False:
                why.append(f"{d}: the optimized kernel did not record a launch (counter {self.counter})")
            for m in r.mutants.values():
                if not m.killed:
                    why.append(f"{d}: mutant {m.name} survived (teeth {m.teeth:.3g})")
            for name, rejected in r.controls.items():
                if not rejected:
                    why.append(f"{d}: the {name} control candidate passed")
            if "bytes" in self.record.strengths and r.bytes_ok() is False:
                why.append(f"{d}: bytes: {r.bytes.get('detail')}")
        return why

    @property
    def certified(self) -> bool:
        return bool(self.runs) and not self.reasons()

    @property
    def verdict(self) -> str:
        return "certified" if self.certified else "not certified"

    def shapes(self) -> list:
        seen = []
        for r in self.runs.values():
            for c in r.cases:
                if c["label"] not in seen:
                    seen.append(c["label"])
        return seen

    def to_dict(self) -> dict:
        k, n = self.mutants_killed()
        return {"op": self.op, "verdict": self.verdict, "candidate": self.candidate,
                "claimed": list(self.record.strengths), "reached": self.reached(),
                "worst_ratio": {d: _fin(r.worst_ratio) for d, r in self.runs.items()},
                "mutants_killed": k, "mutants_total": n,
                "teeth": {m: _fin(t) for m, t in self.teeth().items()},
                "shapes": self.shapes(), "reasons": self.reasons(),
                "bound_model": self.record.bound_doc, "reductions": self.record.reductions,
                "counter": self.counter,
                "runs": {d: r.to_dict() for d, r in self.runs.items()}}


def _summary(j) -> str:
    if j.error:
        return j.error
    bad = [c for c in j.outputs.values() if not c.passed]
    if not bad:
        return f"ok ({j.ratio:.3g} x bound)"
    c = bad[0]
    head = c.failures[0] if c.failures else "failed"
    worst = f"; worst {c.worst[0].describe()}" if c.worst else ""
    return f"{c.name}: {head}{worst}"


def certify_op(record: OpRecord, *, dtypes=("float32", "bfloat16"), device: str | None = None,
               candidate="optimized", examples: int | None = None, bytes_cases: int = 1,
               on_case=None) -> OpCertificate:
    """Certify one op (module docstring). ``candidate``: ``"optimized"``, ``"reference-f32"``, a
    :class:`parity.candidate.Candidate` or a callable with the record's signature. ``examples``:
    drawn inputs per dtype (default: the hypothesis profile's max_examples); ``on_case(op, dtype,
    case_dict)`` is called after each input. ``device``: where the candidate runs (None: its
    default; the optimized ops on cuda if available, else cpu; the stand-in on cpu)."""
    try:
        cand = named(record, candidate)
    except (ImportError, AttributeError) as exc:
        cert = OpCertificate(record, str(candidate), counter=record.counter_name)
        cert.error = f"optimized op unavailable: {type(exc).__name__}: {exc}"
        return cert
    device = cand.device(device)
    cert = OpCertificate(record, cand.name, counter=cand.counter)
    fn = cand.normalized(record)
    # on a failure, which of the candidate and the stand-in is nearer the float64 truth
    nearer = None if cand.rowwise else standin(record).normalized(record)
    n = examples or strategies.examples()
    for dtype in dtypes:
        run = DtypeRun(dtype, strength_of(dtype), rounding=cand.rounding(dtype, device))
        run.mutants = {m.name: MutantResult(m.name, m.kind, m.doc) for m in record.mutants}
        cert.runs[dtype] = run
        t0 = time.perf_counter()
        evaluate = _evaluator(record, dtype, device, fn, cand.counter, run, bytes_cases, on_case, nearer)
        runner = settings(settings.default, max_examples=n, database=None,
                          phases=[Phase.explicit, Phase.generate, Phase.target])(given(record.inputs())(evaluate))
        runner()
        run.seconds = time.perf_counter() - t0
    return cert


def _evaluator(record, dtype, device, cand, counter, run, bytes_cases, on_case, standin):
    def evaluate(case):
        try:
            _evaluate(record, case, dtype, device, cand, counter, run, bytes_cases, standin)
        except Exception as exc:  # the reference or the builder failed: recorded, never silent
            run.cases.append({"label": case.label, "passed": False, "ratio": math.inf, "seconds": 0.0,
                              "kernel_ran": None, "summary": f"harness error: {type(exc).__name__}: {exc}",
                              "outputs": {}})
        if on_case:
            on_case(record.name, dtype, run.cases[-1])
        r = run.cases[-1]["ratio"]
        target(min(r, 1e300) if math.isfinite(r) else 1e300, label=f"{record.name}/{dtype} error in bound units")

    return evaluate


def _evaluate(record, case, dtype, device, cand, counter, run: DtypeRun, bytes_cases: int, standin=None):
    prep = prepare(record, case, dtype, device, run.rounding)
    out, err, ran, dt = run_candidate(prep, cand, counter=counter)
    j = judge(prep, out, error=err, seconds=dt, kernel_ran=ran)
    first = len(run.cases) == 0
    summary = _summary(j)
    if not j.passed and out is not None and standin is not None:
        summary += _nearer(prep, out, standin)
    run.cases.append({"label": case.label, "passed": j.passed, "ratio": j.ratio, "seconds": round(dt, 4),
                      "kernel_ran": ran, "summary": summary,
                      "outputs": {k: c.to_dict() for k, c in j.outputs.items()}})
    if out is not None and "bytes" in record.strengths and len(run.cases) <= bytes_cases:
        b = bytes_checks(prep, cand, first=out)
        prev = run.bytes
        run.bytes = {"run_to_run": b["run_to_run"] and prev.get("run_to_run", True),
                     "batch": _and(prev.get("batch"), b["batch"]),
                     "detail": "; ".join(x for x in (prev.get("detail", ""), b["detail"]) if x)}
    for m in record.mutants:
        mr = run.mutants[m.name]
        if mr.killed:
            continue  # one kill suffices; under the interpreter each run of a kernel costs seconds
        mj = check(prep, m.build(cand, record))
        mr.cases += 1
        mr.teeth = max(mr.teeth, mj.ratio)
        if not mj.passed:
            mr.detected += 1
            if not mr.first_failure:
                mr.first_failure = f"{case.label}: {_summary(mj)}"
    if first:
        for name, make in CONTROLS.items():
            cj = check(prep, make(record, prep))
            run.controls[name] = not cj.passed


def _nearer(prep, out, standin) -> str:
    """On a failure: which of the optimized op and the float32 stand-in is nearer the float64 truth,
    per float output (a stand-in nearer the truth points at the kernel, not at the bound)."""
    try:
        alt = standin(prep.inputs(), dict(prep.case.kwargs))
    except Exception as exc:  # the stand-in failing is reported, not raised
        return f"; stand-in raised {type(exc).__name__}"
    parts = []
    for name in prep.record.outputs:
        if name in prep.record.exact:
            continue
        n = nearer_truth(prep.ref[name], out[name], alt[name])
        who = {"a": "optimized", "b": "stand-in", "tie": "tie"}[n["nearer"]]
        parts.append(f"{name}: {who} (rms err optimized {n['err_a']:.3g}, stand-in {n['err_b']:.3g})")
    return "; nearer the float64 truth: " + ", ".join(parts) if parts else ""


def _and(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a and b


@contextlib.contextmanager
def cpu_threads(device: str, n: int = 1):
    """On CPU, run with ``n`` torch threads (restored after): the test shapes are tiny, and on a shared
    machine torch's thread pool costs milliseconds per small matmul. Certificates record it."""
    if device != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def certify(records, *, dtypes=("float32", "bfloat16"), device=None, candidate="optimized",
            examples=None, on_case=None, on_op=None) -> list:
    """Certify several records (``candidate`` a name: ``optimized`` or ``reference-f32``); ``on_op(cert)``
    is called as each finishes."""
    if candidate not in CANDIDATES:
        raise ValueError(f"candidate: expected one of {CANDIDATES}, got {candidate!r}")
    device = device or ("cpu" if candidate == "reference-f32" else default_device(None))
    out = []
    with cpu_threads(device):
        for rec in records:
            c = certify_op(rec, dtypes=dtypes, device=device, candidate=candidate, examples=examples,
                           on_case=on_case)
            out.append(c)
            if on_op:
                on_op(c)
    return out
