"""``parity judge FILE``: each recorded call judged against the float64 reference.

The recorded output is the evidence: the kernel is not run again. For each kept call of the file
(``callfile``), the float64 reference of its op runs on the call's recorded inputs exactly as the
kernel received them (no rounding: the bound takes the lowest precision among the inputs the record
rounds to the run dtype), and every recorded output is compared with it within the op's bound under
the contract the target's adapter declares. A call past its bound is compared with each mutant of
the op run around the float32 stand-in on the same inputs (``parity.certify.fingerprint``): the nearest
known bug. Per op, the check's teeth are shown on the recorded inputs: each mutant, and an all-zeros
and an all-NaN control, must fail on some recorded call (a mutant that cannot show on any, such as a
transposed initial state in a prefill without one, meets one input the record draws).

Verdict per call: ``clean`` (within the bound), ``past its bound``, ``not kept`` (the budget kept
its shapes only: not judged), ``unmapped`` (no adapter fits it: the file says which argument).
A file is certified when every op's calls are clean, at least one call was judged, no call is
unmapped, and every mutant and control was caught.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from parity import metrics, ops
from parity.bounds.core import UNIT_ROUNDOFF, weaker_contracts
from parity.certify import fingerprint
from parity.certify.candidate import first_case, standin
from parity.certify.check import Prepared, check, prepare, strength_of
from parity.certify.results import CaseResult, DtypeRun, MutantResult, OpCertificate
from parity.mutants import CONTROLS
from parity.registry import Case

from ..capture import sites
from . import callfile


@dataclass
class CallResult:
    """One call of the file, judged: ``verdict`` (module docstring), ``ratio`` (worst error in bound
    units over its outputs; None when not judged), ``nearest_bug`` (a failure's nearest mutant)."""

    entry: dict
    verdict: str
    ratio: float | None = None
    dtype: str | None = None
    summary: str = ""
    nearest_bug: dict | None = None
    bug_similarity: dict = field(default_factory=dict)
    case: CaseResult | None = None

    @property
    def bad(self) -> bool:
        return self.verdict in ("past its bound", "unmapped")

    def to_dict(self) -> dict:
        e = self.entry
        return {"id": e["id"], "op": e["op"], "target": e["target"], "watched": e["watched"], "pid": e["pid"],
                "index": e["index"], "step": e["step"], "call_site": e["call_site"], "verdict": self.verdict,
                "ratio": None if self.ratio is None or not math.isfinite(self.ratio) else float(self.ratio),
                "dtype": self.dtype, "summary": self.summary, "nearest_bug": self.nearest_bug}


@dataclass
class CallsVerdict:
    """The judged file: per call results in file order, per op certificates."""

    file: callfile.CallFile
    calls: list
    certs: list
    seconds: float = 0.0

    @property
    def first_bad(self) -> CallResult | None:
        return next((c for c in self.calls if c.bad), None)

    @property
    def certified(self) -> bool:
        judged = [c for c in self.calls if c.ratio is not None]
        return bool(judged) and self.first_bad is None and all(c.certified for c in self.certs)

    @property
    def never_called(self) -> list:
        """``[{"watched", "target", "why"}]``: each watched target the file holds no call of, with
        the reason the watch gave (``run.never_called``; a file from before it was recorded: the
        targets of ``run.targets`` without calls, the reason unknown)."""
        run = self.file.header["run"]
        if isinstance(run.get("never_called"), list):
            return run["never_called"]
        return [dict(t, why=callfile.UNKNOWN_WHY) for t in
                callfile.never_called(run.get("targets") or {}, self.file.calls, [])]

    def calls_entry(self) -> dict:
        """The certificate's ``calls`` object (parity/schemas/certificate.schema.json)."""
        counts = {}
        for c in self.calls:
            counts[c.verdict] = counts.get(c.verdict, 0) + 1
        fb = self.first_bad
        return {"file": str(self.file.path), "sha256": self.file.sha256, "total": len(self.calls),
                "verdicts": counts, "dropped": list(self.file.header.get("dropped", [])),
                "run": {k: v for k, v in self.file.header["run"].items() if k in ("command", "targets", "max_bytes",
                                                                                  "processes", "exit_code")},
                "first_bad": None if fb is None else fb.to_dict(), "never_called": self.never_called,
                "entries": [c.to_dict() for c in self.calls]}


def records() -> dict:
    return {r.name: r for r in (*ops.records(), *ops.kda.variants())}


def _dtype(record, inputs: dict) -> str:
    """The run dtype: the least precise float among the inputs the record rounds to it ("io")."""
    names = [callfile.dtype_name(t) for n, t in inputs.items()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and record.policy.get(n, "io") == "io"]
    names = names or [callfile.dtype_name(t) for t in inputs.values()
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max(names, key=lambda d: UNIT_ROUNDOFF[d]) if names else "float64"


def _f64(t):
    if t is None:
        return None
    return t.to(torch.float64 if t.is_floating_point() else torch.int64).numpy()


def prepared(record, entry: dict, inputs: dict, *, label: str) -> Prepared:
    """The call's inputs as recorded (tensors, float64 values) and the reference on them."""
    f64 = {n: _f64(t) for n, t in inputs.items()}
    aux = sites.aux(record.name, f64)
    first = inputs[record.args[0]]
    aux_t = {n: torch.from_numpy(np.asarray(a)).to(first.dtype) for n, a in aux.items()}
    kwargs = dict(entry["kwargs"])
    ref = {k: np.asarray(v) for k, v in record.call(record.reference, f64, kwargs).items()}
    return Prepared(record, Case(f64, kwargs, aux=aux, label=label), _dtype(record, inputs), "cpu", dict(inputs),
                    f64, ref, entry["contract"] or "ieee", aux_t)


def _compare(prep: Prepared, outputs: dict):
    """Every recorded output within its bound: (passed, ratio, {name: Comparison})."""
    out_dtypes = {n: metrics.dtype_of(t) for n, t in outputs.items() if metrics.dtype_of(t)}
    bounds = prep.bound(out_dtypes)
    comps = {n: metrics.compare(n, prep.ref[n], t, bounds[n]) for n, t in outputs.items() if n in prep.ref}
    ratio = max((c.ratio for c in comps.values()), default=math.inf)
    return bool(comps) and all(c.passed for c in comps.values()), ratio, comps


def _summary(passed, ratio, comps) -> str:
    if passed:
        return f"ok ({ratio:.3g} x bound)"
    bad = [c for c in comps.values() if not c.passed]
    if not bad:
        return "no output to judge"
    c = bad[0]
    worst = f"; worst {c.worst[0].describe()}" if c.worst else ""
    return f"{c.name}: {c.failures[0] if c.failures else 'failed'}{worst}"


def _label(entry: dict) -> str:
    shapes = " ".join(f"{n}={'x'.join(map(str, s['shape'])) or 'scalar'}" for n, s in entry["inputs"].items() if s)
    return f"{entry['id']} step {entry['step']} {shapes}"


def judge_call(cf: callfile.CallFile, entry: dict, table: dict) -> tuple[CallResult, Prepared | None]:
    if entry["op"] is None:
        return CallResult(entry, "unmapped", summary=entry["error"] or "no adapter maps this call"), None
    if not entry["kept"]:
        return CallResult(entry, "not kept", summary=entry["dropped"] or ""), None
    record = table[entry["op"]]
    inputs, outputs = cf.tensors(entry, "in"), cf.tensors(entry, "out")
    outputs = {n: t for n, t in outputs.items() if t is not None}
    label = _label(entry)
    t0 = time.perf_counter()
    prep = prepared(record, entry, inputs, label=label)
    passed, ratio, comps = _compare(prep, outputs)
    res = CallResult(entry, "clean" if passed else "past its bound", ratio, prep.dtype,
                     _summary(passed, ratio, comps))
    case = CaseResult(label, passed, ratio, seconds=round(time.perf_counter() - t0, 4), kernel_ran=True,
                      summary=res.summary, outputs={k: c.to_dict() for k, c in comps.items()})
    if not passed:
        case.contracts = {c: _compare_under(prep, outputs, c) for c in weaker_contracts(prep.contract)}
        if set(outputs) == set(record.outputs):
            sims = fingerprint.similarities(prep, outputs, standin(record).normalized(record))
            case.bug_similarity = sims
            res.bug_similarity = sims
            res.nearest_bug, _ = fingerprint.nearest([sims])
    res.case = case
    return res, prep


def _compare_under(prep, outputs, contract) -> float:
    out_dtypes = {n: metrics.dtype_of(t) for n, t in outputs.items() if metrics.dtype_of(t)}
    b = prep.bound(out_dtypes, contract)
    return max(metrics.compare(n, prep.ref[n], t, b[n]).ratio for n, t in outputs.items())


def _teeth(record, preps: list, run: DtypeRun) -> None:
    """Each mutant around the stand-in, on the recorded inputs until one catches it, then (if none
    did) on the record's first drawn input; the controls on the first recorded input."""
    alt = standin(record).normalized(record)
    # a dirty-memory mutant only shows on memory certify fills: a recorded call holds what the
    # engine's memory held, and its kernel is not run again
    mutants = [m for m in record.mutants if not m.dirty]
    run.mutants = {m.name: MutantResult(m.name, m.kind, m.doc) for m in mutants}
    drawn = None
    for m in mutants:
        mr = run.mutants[m.name]
        pool = list(preps)
        for i, prep in enumerate(pool + [None]):
            if prep is None:
                if drawn is None:
                    drawn = prepare(record, first_case(record), run.dtype, "cpu", contract=run.contract)
                prep = drawn
            j = check(prep, m.build(alt, record))
            mr.cases += 1
            mr.teeth = max(mr.teeth, j.ratio)
            if not j.passed:
                mr.detected += 1
                mr.first_failure = f"{prep.case.label}: {j.error or _summary(j.passed, j.ratio, j.outputs)}"
                break
    for name, make in CONTROLS.items():
        run.controls[name] = not check(preps[0], make(record, preps[0])).passed


def judge_file(path, *, ops: list | None = None, on_call=None) -> CallsVerdict:
    """Judge every call of the calls file ``path`` (module docstring); ``ops``: only these ops or
    families (the others' calls are left out); ``on_call(CallResult)`` after each call.
    CallsError (one line) for an unusable file."""
    t0 = time.perf_counter()
    cf = callfile.read(path)
    table = records()
    for e in cf.calls:
        if e["op"] is not None and e["op"] not in table:
            raise callfile.CallsError(f"{cf.path}: call {e['id']}: unknown op {e['op']!r}")
    want = None if not ops else {n for n, r in table.items() if n in ops or r.family in ops}
    results, by = [], {}
    with torch.inference_mode():
        for e in cf.calls:
            if want is not None and e["op"] not in want:
                continue
            res, prep = judge_call(cf, e, table)
            results.append(res)
            if prep is not None:
                by.setdefault((e["op"], res.dtype, e["target"], e["contract"]), []).append((res, prep))
            if on_call:
                on_call(res)
        certs = _certificates(by, table)
    return CallsVerdict(cf, results, certs, time.perf_counter() - t0)


def _certificates(by: dict, table: dict) -> list:
    certs: dict = {}
    for (op, dtype, target, contract), items in by.items():
        record = table[op]
        key = (op, target)
        cert = certs.get(key)
        if cert is None:
            cert = certs[key] = OpCertificate(record, target, counter=None, contract=contract or "ieee")
        run = DtypeRun(dtype, strength_of(dtype), contract=contract or "ieee")
        run.cases = [r.case for r, _ in items]
        t0 = time.perf_counter()
        _teeth(record, [p for _, p in items], run)
        run.seconds = time.perf_counter() - t0 + sum(c.seconds for c in run.cases)
        cert.runs[dtype] = run
    return list(certs.values())
