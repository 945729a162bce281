"""Certification of registered ops: the engine behind ``parity certify`` and the tests.

For each op and each requested dtype, hypothesis draws inputs from the record's builder (the
profile's number of examples, ``hypothesis.target`` climbing toward the worst error in bound
units). On every drawn input: the candidate is judged against the bound, every mutant is run (a
mutant is killed when some input makes it fail; its teeth ratio is the worst bound ratio it
reached), and on the first drawn input the repeat (two runs compared byte for byte: a difference
is a ``nondeterminism`` finding), the batch-composition check, the two controls (an all-zeros and
an all-NaN candidate, which must fail) and, for an op that takes a buffer (``OpRecord.dirty``), the
same input with the buffer's unused memory holding NaN, Inf and stale values. For a counted
candidate (the optimized ops) the launch counter must show the kernel ran on every call.

Where the candidate runs: in this process (parity.certify.check.InProcess), or in worker processes
(parity.certify.pool.Worker, ``workers=``), where a call that kills its process or CUDA context is a
``fault`` of that input only. The inputs are drawn, rounded and judged here either way, so the
draws are the same. The results are the typed dataclasses of parity.certify.results.

What is certified is a :class:`parity.certify.candidate.Candidate`: the record's optimized op, the float32
stand-in, or any callable with the record's signature (an outside implementation: its calls and
outputs are witnessed instead of a launch counter, and the certificate names it). The bounds are
those of the arithmetic contract the candidate claims (``ieee`` unless it declares or is given
another, parity.bounds.core.CONTRACTS). When an input fails, two diagnoses are added: the bound
ratios of the same input under each weaker contract (the certificate says which weaker contract,
if any, the failures are consistent with), and the error's similarity to each mutant's, run around
the stand-in on the same input (parity.certify.fingerprint: the nearest known bug).

Verdict: ``certified`` when, at every dtype run, every input passed, the kernel ran, every mutant
was killed and both controls were rejected, and the bytes checks held if the record claims bytes.
Strengths reached: ``lifted`` (a float32/float64 run passed), ``production`` (a bfloat16/float16
run passed), ``bytes``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import HealthCheck, Phase, example, given, reject, settings, target
from hypothesis.errors import Unsatisfiable

from .. import strategies
from ..bounds.core import weaker_contracts
from ..errors import Unsupported
from ..metrics import nearer_truth
from ..mutants import CONTROLS
from ..platform import default_device
from ..registry import FILLS, Case, OpRecord
from . import fingerprint, repro
from .candidate import NAMES as CANDIDATES
from .candidate import Candidate, gate_mismatch, named, probe, standin
from .check import (BATCH, CANDIDATE, MUTANT, REPEAT, Call, CallResult, check, differing, half_batch, judge, prepare,
                    strength_of, witness)
from .job import CertifyJob, Impl
from .pool import InProcess, Job, Worker, visible_devices
from .results import CaseResult, DtypeRun, MutantResult, OpCertificate, merge  # noqa: F401  (merge: re-exported)


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


@dataclass
class _Unit:
    """What one (op, dtype) run needs: the record, the candidate and its normalized stand-ins, where
    user code runs (a parity.certify.pool runner), the run being filled and the caller's hooks."""

    record: OpRecord
    cand: Candidate
    dtype: str
    runner: object                  # parity.certify.pool.InProcess or Worker
    run: DtypeRun
    bytes_cases: int = 1
    on_case: Callable | None = None
    nearer: Callable | None = None  # the stand-in, to say which is nearer the truth (None: rowwise)
    alt: Callable | None = None     # the stand-in the mutants are built around (fingerprints)
    repro: str | None = None        # write a repro folder per failing input here
    drawn: int = 0                  # drawn inputs evaluated so far
    checked: int = 0                # drawn inputs the candidate ran on (repeat, batch, dirty memory)


def _new_cert(record: OpRecord, candidate, contract):
    """(OpCertificate, Candidate or None): None when the optimized op is unavailable or the
    candidate declares another KDA gate than the op's (the certificate says why)."""
    try:
        cand = named(record, candidate, contract)
    except (ImportError, AttributeError) as exc:
        cert = OpCertificate(record, str(candidate), counter=record.counter_name)
        cert.error = f"optimized op unavailable: {type(exc).__name__}: {exc}"
        return cert, None
    cert = OpCertificate(record, cand.name, counter=cand.counter, contract=cand.contract,
                         implementation=cand.implementation(), outside=cand.outside)
    mismatch = gate_mismatch(record, cand.fn)
    if mismatch:
        cert.error = f"gate: {mismatch}"
        return cert, None
    return cert, cand


def certify_op(record: OpRecord, *, dtypes=("float32", "bfloat16"), device: str | None = None,
               candidate="optimized", examples: int | None = None, bytes_cases: int = 1,
               on_case=None, contract: str | None = None, cases=(), runner=None,
               repro: str | None = None) -> OpCertificate:
    """Certify one op (module docstring). ``candidate``: ``"optimized"``, ``"reference-f32"``, a
    :class:`parity.certify.candidate.Candidate` or a callable with the record's signature (probed first:
    a wrong signature or wrong output shapes or dtypes raise ``parity.errors.CandidateError``).
    ``contract``: the arithmetic claimed (default: the candidate's own, ``ieee`` unless declared).
    ``examples``: drawn inputs per dtype (default: the hypothesis profile's max_examples);
    ``on_case(op, dtype, CaseResult)`` is called after each input. ``device``: where the candidate
    runs (None: its default; the optimized ops on cuda if available, else cpu; the stand-in on cpu).
    ``cases``: :class:`parity.registry.Case` replayed before the draws (hypothesis' explicit
    examples, e.g. ``parity capture``'s): judged and run against the mutants like a draw, their
    ``source`` kept in the case's entry; the bytes checks and controls run on the drawn inputs.
    ``runner``: where user code runs (parity.certify.pool: default in this process). ``repro``: a folder
    for a repro of each failing input (parity.certify.repro)."""
    cert, cand = _new_cert(record, candidate, contract)
    if cand is None:
        return cert
    device = cand.device(device)
    runner = runner or InProcess(device)
    if cand.outside:
        probe(record, cand, dtypes[0], device, runner)
    for dtype in dtypes:
        _certify_dtype(cert, cand, dtype, runner, examples=examples, bytes_cases=bytes_cases,
                       on_case=on_case, cases=cases, repro=repro)
    return cert


def _certify_dtype(cert: OpCertificate, cand: Candidate, dtype: str, runner, *, examples=None,
                   bytes_cases=1, on_case=None, cases=(), repro=None, base=None) -> None:
    """One (op, dtype) run: hypothesis draws the inputs here, ``runner`` calls the candidate."""
    record = cert.record
    run = DtypeRun(dtype, strength_of(dtype), contract=cand.contract)
    run.mutants = {m.name: MutantResult(m.name, m.kind, m.doc) for m in record.mutants}
    cert.runs[dtype] = run
    # on a failure: which of the candidate and the stand-in is nearer the float64 truth, and which
    # mutant (run around the stand-in) errs the same way
    alt = standin(record).normalized(record)
    unit = _Unit(record, cand, dtype, runner, run, bytes_cases, on_case, None if cand.rowwise else alt, alt, repro)
    t0 = time.perf_counter()
    runner_fn = given(record.inputs())(_evaluator(unit))
    for case in reversed(cases):  # the outermost example runs first: the file's order
        runner_fn = example(case)(runner_fn)
    runner_fn = settings(base or settings.default, max_examples=examples or strategies.examples(), database=None,
                         phases=[Phase.explicit, Phase.generate, Phase.target],
                         suppress_health_check=[*settings.default.suppress_health_check,
                                                HealthCheck.filter_too_much])(runner_fn)
    try:
        runner_fn()
    except Unsatisfiable:
        pass  # every drawn input was unsupported: the run has no case, its reasons say so
    run.seconds = time.perf_counter() - t0


def _evaluator(unit: _Unit):
    def evaluate(case):
        try:
            ratio = _evaluate(unit, case)
        except Unsupported as exc:  # an input the implementation does not take: counted, not judged
            unit.run.unsupported[str(exc)] = unit.run.unsupported.get(str(exc), 0) + 1
            reject()
        target(min(ratio, 1e300) if math.isfinite(ratio) else 1e300,
               label=f"{unit.record.name}/{unit.dtype} error in bound units")

    return evaluate


def _evaluate(unit: _Unit, case: Case, dirty: str | None = None) -> float:
    """Judge the candidate on ``case`` (and its mutants; on the first drawn input the controls; on
    the first drawn inputs it ran on, not faulting, its repeat, batch half and dirty-memory variants);
    append its CaseResult; return its ratio. Unsupported when the implementation refuses the input."""
    record, run = unit.record, unit.run
    prep = prepare(record, case, unit.dtype, unit.runner.prep_device, contract=run.contract)
    drawn = case.source is None and dirty is None
    checks = drawn and unit.checked < unit.bytes_cases   # repeat, batch half: the first drawn inputs it ran on
    calls = [Call(CANDIDATE)]
    if checks:
        calls.append(Call(REPEAT))
        if "bytes" in record.strengths and half_batch(record, prep.tensors) is not None:
            calls.append(Call(BATCH))
    results = _run(unit, prep, calls)
    res = results[Call(CANDIDATE)]
    if res.unsupported is not None:
        raise Unsupported(res.unsupported)
    if drawn:
        unit.drawn += 1
    entry = _judged(unit, prep, res, dirty)
    run.cases.append(entry)
    ran = res.outputs is not None and not res.fault
    if ran:
        if checks:
            unit.checked += 1
            _bytes(unit, prep, res, results)
        _mutants(unit, prep, case)
    if drawn and unit.drawn == 1 and case.source is None:
        for name, make in CONTROLS.items():
            run.controls[name] = not check(prep, make(record, prep)).passed
    if not entry.passed and unit.repro is not None:
        repro.write(unit.repro, record, unit.cand, prep, entry, res.outputs, unit.runner.device)
    if unit.on_case:
        unit.on_case(record.name, unit.dtype, entry)
    if checks and ran and unit.checked == 1 and record.dirty is not None:
        for fill in FILLS:
            d = record.dirty(case, fill)
            try:
                _evaluate(unit, dataclasses.replace(d, label=f"{case.label} dirty={fill}"), dirty=fill)
            except Unsupported as exc:
                run.unsupported[str(exc)] = run.unsupported.get(str(exc), 0) + 1
    return entry.ratio


def _run(unit: _Unit, prep, calls) -> dict:
    job = Job(unit.record.name, prep.tensors, dict(prep.case.kwargs), prep.aux, calls)
    return {r.call: r for r in unit.runner.run(unit.record, unit.cand, job, ref=prep.ref)}


def _judged(unit: _Unit, prep, res: CallResult, dirty: str | None) -> CaseResult:
    case = prep.case
    if res.fault is not None:
        why = res.fault if res.error is None or res.error == res.fault else f"{res.error} ({res.fault})"
        shapes = {k: list(v.shape) for k, v in prep.tensors.items() if hasattr(v, "shape")}
        return CaseResult(case.label, False, math.inf, round(res.seconds, 4), None, f"fault: {why}",
                          source=case.source and dict(case.source), fault=why, shapes=shapes, dirty=dirty)
    ran, why = witness(prep, res)
    j = judge(prep, res.outputs, error=res.error, seconds=res.seconds, kernel_ran=ran)
    summary = _summary(j) + (f"; {why}" if why else "")
    if not j.passed and res.outputs is not None and unit.nearer is not None:
        summary += _nearer(prep, res.outputs, unit.nearer)
    entry = CaseResult(case.label, j.passed, j.ratio, round(res.seconds, 4), ran, summary,
                       {k: c.to_dict() for k, c in j.outputs.items()}, why,
                       case.source and dict(case.source), dirty=dirty)
    if not j.passed and res.outputs is not None and not j.error:
        _diagnose(prep, res.outputs, unit.run, entry, unit.alt)
    return entry


def _bytes(unit: _Unit, prep, res: CallResult, results: dict) -> None:
    """Run-to-run (every record: nondeterminism is a finding of its own) and, for a record that
    claims bytes, batch composition."""
    record, run = unit.record, unit.run
    rep = results.get(Call(REPEAT))
    if rep is None:
        return
    if rep.outputs is None:
        bad, detail = list(record.outputs), f"the repeat {'faulted' if rep.fault else 'raised'}: {rep.fault or rep.error}"
    else:
        bad = differing(record, res.outputs, rep.outputs)
        detail = f"run-to-run differs in {bad}" if bad else ""
    if bad:
        run.nondeterminism.append({"label": prep.case.label, "outputs": bad, "detail": detail})
    if "bytes" not in record.strengths:
        return
    batch, bdetail = None, ""
    half = results.get(Call(BATCH))
    if half is not None:
        _, m, n = half_batch(record, prep.tensors)
        if half.outputs is None:
            batch, bdetail = False, f"batch of {m} of {n}: {half.fault or half.error}"
        else:
            worse = differing(record, res.outputs, half.outputs, record.batch["outputs"], m)
            batch, bdetail = not worse, (f"batch of {m} of {n} differs in {worse}" if worse else "")
    prev = run.bytes
    run.bytes = {"run_to_run": not bad and prev.get("run_to_run", True),
                 "batch": _and(prev.get("batch"), batch),
                 "detail": "; ".join(x for x in (prev.get("detail", ""), detail, bdetail) if x)}


def _mutants(unit: _Unit, prep, case: Case) -> None:
    """Every mutant not killed yet, on this input (one kill suffices: under the interpreter each
    run of a kernel costs seconds)."""
    run = unit.run
    live = [m for m in unit.record.mutants if not run.mutants[m.name].killed]
    if not live:
        return
    results = _run(unit, prep, [Call(MUTANT, m.name) for m in live])
    for m in live:
        res = results.get(Call(MUTANT, m.name))
        if res is None:   # a fault earlier in the job: this one runs on a later input
            continue
        error = f"fault: {res.fault}" if res.fault else res.error
        mj = judge(prep, None if res.fault else res.outputs, error=error)
        mr = run.mutants[m.name]
        mr.cases += 1
        mr.teeth = max(mr.teeth, mj.ratio)
        if not mj.passed:
            mr.detected += 1
            if not mr.first_failure:
                mr.first_failure = f"{case.label}: {_summary(mj)}"


def _diagnose(prep, out, run: DtypeRun, entry: CaseResult, alt) -> None:
    """A failing input with outputs: its ratio under each weaker contract, and (the first
    fingerprint.MAX_CASES of the run) its similarity to each mutant around the stand-in ``alt``."""
    entry.contracts = {c: judge(prep, out, contract=c).ratio for c in weaker_contracts(run.contract)}
    done = sum(1 for c in run.cases if c.bug_similarity is not None)
    if alt is not None and done < fingerprint.MAX_CASES:
        entry.bug_similarity = fingerprint.similarities(prep, out, alt)


def _nearer(prep, out, standin) -> str:
    """On a failure: which of the candidate and the float32 stand-in is nearer the float64 truth,
    per float output (a stand-in nearer the truth points at the kernel, not at the bound)."""
    alt = standin(prep.inputs(), dict(prep.case.kwargs))
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


def units(records, dtypes, shard: tuple[int, int] | None = None) -> list:
    """The (record, dtype) runs of a certification, in order; ``shard`` ``(i, n)``: the i-th of n
    (1-based) shares, every n-th run from the i-th (``parity certify --shard i/n``)."""
    every = [(r, d) for r in records for d in dtypes]
    if shard is None:
        return every
    i, n = shard
    if not 1 <= i <= n:
        raise ValueError(f"shard {i}/{n}: expected 1 <= i <= n")
    return every[i - 1::n]


def runners(device: str, workers: int | None) -> list:
    """Where user code runs: ``workers`` worker processes (parity.certify.pool.Worker; on CUDA each pinned
    to one visible device, round robin), or this process (``workers`` 0; None: one worker per
    visible GPU on CUDA, this process on the CPU)."""
    if workers is None:
        workers = max(1, len(visible_devices())) if device.startswith("cuda") else 0
    if workers < 0:
        raise ValueError(f"workers: expected a count >= 0, got {workers}")
    if workers == 0:
        return [InProcess(device)]
    gpus = visible_devices() if device.startswith("cuda") else []
    return [Worker(device, gpus[i % len(gpus)] if gpus else None) for i in range(workers)]


def certify(records, *, dtypes=("float32", "bfloat16"), device=None, candidate="optimized",
            examples=None, on_case=None, on_op=None, impls=None, contract=None, cases=None,
            workers: int | None = None, shard: tuple[int, int] | None = None, repro: str | None = None) -> list:
    """Certify several records: :func:`run_job` of the :class:`parity.certify.job.CertifyJob` of
    these arguments (``impls``: op name -> a callable or Candidate certified instead for that op;
    the rest as the job's fields)."""
    job = CertifyJob(tuple(records), tuple(dtypes), device, candidate, examples,
                     tuple(Impl(op, None, c) for op, c in (impls or {}).items()), contract, cases, workers, shard,
                     repro)
    return run_job(job, on_case=on_case, on_op=on_op)


def run_job(job: CertifyJob, *, on_case=None, on_op=None) -> list:
    """Certify ``job.records`` (``job.candidate`` a name: ``optimized`` or ``reference-f32``; each
    ``job.impls`` certified instead for its op); ``job.contract`` replaces every candidate's claimed
    contract; ``on_op(cert)`` is called as each finishes, in the records' order, ``on_case(op,
    dtype, CaseResult)`` after each input; ``job.cases``: op name -> replayed cases
    (``certify_op``). ``job.workers``/``job.shard``: see :func:`runners` and :func:`units` (with
    workers, the (op, dtype) runs go to them in parallel, one thread each drawing its inputs here);
    ``job.repro``: a folder for the repros of failures."""
    if job.candidate not in CANDIDATES:
        raise ValueError(f"candidate: expected one of {CANDIDATES}, got {job.candidate!r}")
    dtypes, examples, cases, repro = job.dtypes, job.examples, job.cases or {}, job.repro
    device = job.device or ("cpu" if job.candidate == "reference-f32" and not job.impls else default_device(None))
    todo = units(job.records, dtypes, job.shard)
    order = list(dict.fromkeys(r.name for r, _ in todo))
    certs, cands = {}, {}
    for rec in {r.name: r for r, _ in todo}.values():
        impl = job.impl(rec.name)
        certs[rec.name], cands[rec.name] = _new_cert(rec, job.candidate if impl is None else impl.candidate,
                                                     job.contract)
    pool = runners(device, job.workers)
    try:   # outside implementations probed before any work (CandidateError: one line)
        for name, cand in cands.items():
            if cand is not None and cand.outside:
                probe(certs[name].record, cand, dtypes[0], cand.device(device), pool[0])
    except BaseException:
        for r in pool:
            r.close()
        raise
    base = settings.default      # the profile in force (settings.default is per thread)
    done: dict = {name: 0 for name in order}
    total = {name: sum(1 for r, _ in todo if r.name == name) for name in order}
    lock = threading.Lock()
    flushed = [0]

    def finish(name):
        with lock:
            done[name] += 1
            while flushed[0] < len(order) and done[order[flushed[0]]] == total[order[flushed[0]]]:
                if on_op:
                    on_op(certs[order[flushed[0]]])
                flushed[0] += 1

    def work(rec, dtype, runner):
        cand, cert = cands[rec.name], certs[rec.name]
        if cand is not None:
            _certify_dtype(cert, cand, dtype, runner, examples=examples, on_case=on_case,
                           cases=cases.get(rec.name, ()), repro=repro, base=base)
        finish(rec.name)

    try:
        with cpu_threads(device):
            if len(pool) == 1:
                for rec, dtype in todo:
                    work(rec, dtype, pool[0])
            else:
                _parallel(todo, pool, work)
    finally:
        for r in pool:
            r.close()
    for name, cert in certs.items():   # the runs in the order of dtypes, whatever order they finished in
        cert.runs = {d: cert.runs[d] for d in dtypes if d in cert.runs}
    return [certs[name] for name in order]


def _parallel(todo, pool, work) -> None:
    """Each runner takes the next (record, dtype) in its own thread; the first exception is raised
    here once every thread has stopped (a harness bug is a traceback, never a row)."""
    queue = list(todo)
    lock = threading.Lock()
    errors = []

    def loop(runner):
        while True:
            with lock:
                if not queue or errors:
                    return
                rec, dtype = queue.pop(0)
            try:
                work(rec, dtype, runner)
            except BaseException as exc:  # re-raised in the caller's thread below
                with lock:
                    errors.append(exc)
                return

    threads = [threading.Thread(target=loop, args=(r,), name=f"certify-{i}") for i, r in enumerate(pool)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
