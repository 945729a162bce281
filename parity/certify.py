"""Certification of registered ops: the engine behind ``parity certify`` and the tests.

For each op and each requested dtype, hypothesis draws inputs from the record's builder (the
profile's number of examples, ``hypothesis.target`` climbing toward the worst error in bound
units). On every drawn input: the candidate is judged against the bound, every mutant is run (a
mutant is killed when some input makes it fail; its teeth ratio is the worst bound ratio it
reached), and on the first inputs the bytes checks (run-to-run, batch composition) and the two
controls (an all-zeros and an all-NaN candidate, which must fail). For a counted candidate (the
optimized ops) the launch counter must show the kernel ran on every call.

What is certified is a :class:`parity.candidate.Candidate`: the record's optimized op, the float32
stand-in, or any callable with the record's signature (an outside implementation: its calls and
outputs are witnessed instead of a launch counter, and the certificate names it). The bounds are
those of the arithmetic contract the candidate claims (``ieee`` unless it declares or is given
another, parity.bounds.core.CONTRACTS). When an input fails, two diagnoses are added: the bound
ratios of the same input under each weaker contract (the certificate says which weaker contract,
if any, the failures are consistent with), and the error's similarity to each mutant's, run around
the stand-in on the same input (parity.fingerprint: the nearest known bug).

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
from hypothesis import HealthCheck, Phase, example, given, reject, settings, target
from hypothesis.errors import Unsatisfiable

from . import strategies
from . import fingerprint
from .bounds.core import weaker_contracts
from .candidate import NAMES as CANDIDATES
from .candidate import named, probe, standin
from .check import bytes_checks, check, judge, prepare, run_candidate, strength_of
from .errors import Unsupported
from .metrics import nearer_truth
from .mutants import CONTROLS
from .platform import default_device
from .registry import OpRecord


def _fin(x):
    return None if x is None or not math.isfinite(x) else float(x)


def _r(x) -> str:
    return "inf" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _case_dict(c: dict) -> dict:
    out = {k: (_fin(v) if k == "ratio" else v) for k, v in c.items()}
    if "contracts" in out:
        out["contracts"] = {k: _fin(v) for k, v in out["contracts"].items()}
    return out


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
    contract: str = "ieee"
    unsupported: dict = field(default_factory=dict)   # why -> inputs the implementation refused

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

    def contract_verdict(self) -> dict:
        """The claimed contract at this dtype: ``holds`` (every input within its bounds), the worst
        ratio, and on a failure the worst ratio of the failing inputs under each weaker contract
        and the strongest weaker one they all fit (``consistent_with``; None if none does, or if
        an input failed without outputs to judge). Inputs that passed the claimed contract pass
        every weaker one: bounds grow with every unit roundoff."""
        out = {"name": self.contract, "holds": self.passed, "worst_ratio": _fin(self.worst_ratio),
               "weaker": {}, "consistent_with": None}
        failing = [c for c in self.cases if not c["passed"]]
        if not failing:
            return out
        weaker = {}
        for c in failing:
            for k, r in c.get("contracts", {}).items():
                weaker[k] = max(weaker.get(k, 0.0), r)
        out["weaker"] = {k: _fin(v) for k, v in weaker.items()}
        if all("contracts" in c for c in failing):
            fits = [k for k, v in weaker.items() if v <= 1.0]
            if fits:
                out["consistent_with"] = {"contract": fits[0], "ratio": _fin(weaker[fits[0]])}
        return out

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "strength": self.strength, "rounding": self.rounding, "passed": self.passed,
                "contract": self.contract_verdict(), "unsupported": dict(self.unsupported),
                "worst_ratio": _fin(self.worst_ratio), "kernel_ran": self.kernel_ran,
                "bytes": dict(self.bytes), "controls": dict(self.controls), "seconds": round(self.seconds, 3),
                "cases": [_case_dict(c) for c in self.cases],
                "mutants": [m.to_dict() for m in self.mutants.values()]}


@dataclass
class OpCertificate:
    record: OpRecord
    candidate: str                                  # the candidate's name
    runs: dict = field(default_factory=dict)        # dtype -> DtypeRun
    error: str | None = None
    counter: str | None = None                      # the launch counter that had to move
    contract: str = "ieee"                          # the arithmetic the candidate claims
    implementation: dict | None = None              # an outside candidate: who it is
    outside: bool = False

    @property
    def op(self) -> str:
        return self.record.name

    def nearest_bug(self) -> tuple[dict | None, dict]:
        """(``{"mutant", "similarity"}`` or None, mutant -> mean score) over the fingerprinted
        failing inputs of every dtype (parity.fingerprint)."""
        return fingerprint.nearest([c["bug_similarity"] for r in self.runs.values() for c in r.cases
                                    if c.get("bug_similarity")])

    def contract_summary(self) -> str:
        """One line per dtype: ``fails ieee at float32 by 86x; consistent with tf32 at 0.4 units``."""
        parts = []
        for d, r in self.runs.items():
            v = r.contract_verdict()
            w = r.worst_ratio
            if not r.cases:
                parts.append(f"{v['name']} at {d}: no input judged")
            elif v["holds"]:
                parts.append(f"holds {v['name']} at {d} ({_r(w)} units)")
            else:
                line = f"fails {v['name']} at {d} by {_r(w)}x"
                if v["consistent_with"]:
                    c = v["consistent_with"]
                    line += f"; consistent with {c['contract']} at {_r(c['ratio'])} units"
                elif weaker_contracts(v["name"]):
                    line += "; consistent with no weaker contract"
                parts.append(line)
        return "; ".join(parts)

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
            if self.outside and r.kernel_ran is False:
                c = next(c for c in r.cases if c["kernel_ran"] is False)
                why.append(f"{d}: the implementation did not return its own, honest outputs on every input, "
                           f"first {c['label']}: {c.get('witness')}")
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

    def replayed(self) -> list:
        """The replayed cases (``certify_op(cases=)``), once each: their source, label, whether they
        passed at every dtype and their worst ratio."""
        out: dict = {}
        for r in self.runs.values():
            for c in r.cases:
                if "source" in c:
                    e = out.setdefault(c["source"]["case"], {**c["source"], "label": c["label"], "passed": True,
                                                             "ratio": 0.0})
                    e["passed"] = e["passed"] and c["passed"]
                    e["ratio"] = max(e["ratio"], c["ratio"])
        return list(out.values())

    def to_dict(self) -> dict:
        k, n = self.mutants_killed()
        bug, scores = self.nearest_bug()
        replayed = [{**e, "ratio": _fin(e["ratio"])} for e in self.replayed()]
        return {"op": self.op, "verdict": self.verdict, "candidate": self.candidate,
                "claimed": list(self.record.strengths), "reached": self.reached(),
                "worst_ratio": {d: _fin(r.worst_ratio) for d, r in self.runs.items()},
                "mutants_killed": k, "mutants_total": n,
                "teeth": {m: _fin(t) for m, t in self.teeth().items()},
                "shapes": self.shapes(), "reasons": self.reasons(),
                "bound_model": self.record.bound_doc, "reductions": self.record.reductions,
                "counter": self.counter, "contract": self.contract, "contract_verdict": self.contract_summary(),
                "implementation": self.implementation, "nearest_bug": bug, "bug_similarity": scores,
                **({"replayed": replayed} if replayed else {}),
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
               on_case=None, contract: str | None = None, cases=()) -> OpCertificate:
    """Certify one op (module docstring). ``candidate``: ``"optimized"``, ``"reference-f32"``, a
    :class:`parity.candidate.Candidate` or a callable with the record's signature (probed first:
    a wrong signature or wrong output shapes or dtypes raise ``parity.errors.CandidateError``).
    ``contract``: the arithmetic claimed (default: the candidate's own, ``ieee`` unless declared).
    ``examples``: drawn inputs per dtype (default: the hypothesis profile's max_examples);
    ``on_case(op, dtype, case_dict)`` is called after each input. ``device``: where the candidate
    runs (None: its default; the optimized ops on cuda if available, else cpu; the stand-in on cpu).
    ``cases``: :class:`parity.registry.Case` replayed before the draws (hypothesis' explicit
    examples, e.g. ``parity capture``'s): judged and run against the mutants like a draw, their
    ``source`` kept in the case's entry; the bytes checks and controls run on the drawn inputs."""
    try:
        cand = named(record, candidate, contract)
    except (ImportError, AttributeError) as exc:
        cert = OpCertificate(record, str(candidate), counter=record.counter_name)
        cert.error = f"optimized op unavailable: {type(exc).__name__}: {exc}"
        return cert
    device = cand.device(device)
    if cand.outside:
        probe(record, cand, dtypes[0], device)
    cert = OpCertificate(record, cand.name, counter=cand.counter, contract=cand.contract,
                         implementation=cand.implementation(), outside=cand.outside)
    fn = cand.normalized(record)
    # on a failure: which of the candidate and the stand-in is nearer the float64 truth, and which
    # mutant (run around the stand-in) errs the same way
    alt = standin(record).normalized(record)
    nearer = None if cand.rowwise else alt
    n = examples or strategies.examples()
    for dtype in dtypes:
        run = DtypeRun(dtype, strength_of(dtype), rounding=cand.rounding(dtype, device), contract=cand.contract)
        run.mutants = {m.name: MutantResult(m.name, m.kind, m.doc) for m in record.mutants}
        cert.runs[dtype] = run
        t0 = time.perf_counter()
        evaluate = _evaluator(record, dtype, device, fn, cand.counter, run, bytes_cases, on_case, nearer, alt)
        runner = given(record.inputs())(evaluate)
        for case in reversed(cases):  # the outermost example runs first: the file's order
            runner = example(case)(runner)
        runner = settings(settings.default, max_examples=n, database=None,
                          phases=[Phase.explicit, Phase.generate, Phase.target],
                          suppress_health_check=[*settings.default.suppress_health_check,
                                                 HealthCheck.filter_too_much])(runner)
        try:
            runner()
        except Unsatisfiable:
            pass  # every drawn input was unsupported: the run has no case, its reasons say so
        run.seconds = time.perf_counter() - t0
    return cert


def _evaluator(record, dtype, device, cand, counter, run, bytes_cases, on_case, nearer, alt):
    def evaluate(case):
        try:
            _evaluate(record, case, dtype, device, cand, counter, run, bytes_cases, nearer, alt)
        except Unsupported as exc:  # an input the implementation does not take: counted, not judged
            run.unsupported[str(exc)] = run.unsupported.get(str(exc), 0) + 1
            reject()
        except Exception as exc:  # the reference or the builder failed: recorded, never silent
            lost = _context_fault(device) is not None
            why = "the CUDA context was lost (a kernel faulted)" if lost else "harness error"
            run.cases.append({"label": case.label, "passed": False, "ratio": math.inf, "seconds": 0.0,
                              "kernel_ran": None, "summary": f"{why}: {_first_line(exc)}",
                              "outputs": {}, **({"source": dict(case.source)} if case.source else {})})
        if on_case:
            on_case(record.name, dtype, run.cases[-1])
        r = run.cases[-1]["ratio"]
        target(min(r, 1e300) if math.isfinite(r) else 1e300, label=f"{record.name}/{dtype} error in bound units")

    return evaluate


def _evaluate(record, case, dtype, device, cand, counter, run: DtypeRun, bytes_cases: int, standin_=None,
              alt=None):
    prep = prepare(record, case, dtype, device, run.rounding, run.contract)
    out, err, ran, dt, why = run_candidate(prep, cand, counter=counter)
    j = judge(prep, out, error=err, seconds=dt, kernel_ran=ran)
    drawn = sum("source" not in c for c in run.cases) + (case.source is None)  # replayed: no bytes/controls
    first = case.source is None and drawn == 1
    summary = _summary(j)
    if why:
        summary += f"; {why}"
    if not j.passed and out is not None and standin_ is not None:
        summary += _nearer(prep, out, standin_)
    entry = {"label": case.label, "passed": j.passed, "ratio": j.ratio, "seconds": round(dt, 4),
             "kernel_ran": ran, "summary": summary,
             "outputs": {k: c.to_dict() for k, c in j.outputs.items()}}
    if why:
        entry["witness"] = why
    if case.source is not None:
        entry["source"] = dict(case.source)
    if not j.passed and out is not None and not j.error:
        _diagnose(prep, out, run, entry, alt)
    run.cases.append(entry)
    if out is not None and "bytes" in record.strengths and case.source is None and drawn <= bytes_cases:
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


def _diagnose(prep, out, run: DtypeRun, entry: dict, alt) -> None:
    """A failing input with outputs: its ratio under each weaker contract, and (the first
    fingerprint.MAX_CASES of the run) its similarity to each mutant around the stand-in ``alt``."""
    entry["contracts"] = {c: judge(prep, out, contract=c).ratio for c in weaker_contracts(run.contract)}
    done = sum(1 for c in run.cases if c.get("bug_similarity") is not None)
    if alt is not None and done < fingerprint.MAX_CASES:
        entry["bug_similarity"] = fingerprint.similarities(prep, out, alt)


def _nearer(prep, out, standin) -> str:
    """On a failure: which of the candidate and the float32 stand-in is nearer the float64 truth,
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
        who = {"a": "candidate", "b": "stand-in", "tie": "tie"}[n["nearer"]]
        parts.append(f"{name}: {who} (rms err candidate {n['err_a']:.3g}, stand-in {n['err_b']:.3g})")
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
            examples=None, on_case=None, on_op=None, impls=None, contract=None, cases=None) -> list:
    """Certify several records (``candidate`` a name: ``optimized`` or ``reference-f32``; ``impls``:
    op name -> a callable or Candidate certified instead for that op); ``contract`` replaces every
    candidate's claimed contract; ``on_op(cert)`` is called as each finishes; ``cases``: op name ->
    replayed cases (``certify_op``)."""
    if candidate not in CANDIDATES:
        raise ValueError(f"candidate: expected one of {CANDIDATES}, got {candidate!r}")
    impls = dict(impls or {})
    device = device or ("cpu" if candidate == "reference-f32" and not impls else default_device(None))
    out, lost = [], None
    with cpu_threads(device):
        for rec in records:
            cand = impls.get(rec.name, candidate)
            if lost is None:
                try:
                    c = certify_op(rec, dtypes=dtypes, device=device, candidate=cand, examples=examples,
                                   on_case=on_case, contract=contract, cases=(cases or {}).get(rec.name, ()))
                except RuntimeError as exc:  # a fault outside the candidate's own call (torch.AcceleratorError)
                    if _context_fault(device) is None:
                        raise
                    c = OpCertificate(rec, getattr(cand, "__name__", str(cand)), counter=rec.counter_name)
                    c.error = f"the CUDA context was lost: {_first_line(exc)}"
                fault = _context_fault(device)
                if fault is not None:
                    lost = (f"not run: the CUDA context was lost after {rec.name}'s candidate faulted ({fault}); "
                            "certify this op in a fresh process (--ops OP)")
            else:
                c = OpCertificate(rec, getattr(cand, "__name__", str(cand)), counter=rec.counter_name)
                c.error = lost.replace("--ops OP", f"--ops {rec.name}")
            out.append(c)
            if on_op:
                on_op(c)
    return out


def _context_fault(device) -> str | None:
    """Why ``device``'s CUDA context is unusable, or None. A kernel that faults (a misaligned or
    illegal address) poisons the context: every later CUDA call in the process fails, so the ops
    after it cannot be certified here."""
    if not str(device).startswith("cuda"):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return _first_line(exc)
    return None


def _first_line(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
