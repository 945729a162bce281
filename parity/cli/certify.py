"""`parity certify`: certify registered ops against the float64 reference (docs/certificates.md).

    parity certify [--ops OP|FAMILY ...] [--device cpu|cuda] [--dtype bfloat16|float32|float64 ...]
                   [--examples N] [--json PATH] [--candidate optimized|reference-f32] [--cases FILE]
                   [--impl OP=module:function | OP=path/to/file.py:function | fla ...]
                   [--contract ieee|tf32|bf16-storage] [--workers N] [--shard I/N] [--repro DIR]
                   [--variant kda_gate=softplus|lower_bound:B]
    parity certify merge SHARD.json ... --json PATH
    parity certify --calls FILE [--ops OP|FAMILY ...] [--json PATH]     (the older spelling of parity judge)

Prints a table per op (shapes tried, worst error in bound units, strength, mutants killed, teeth,
verdict, the contract verdict, the nearest known bug of a failure) and a summary; ``--json`` writes
the certificate (schema: parity/schemas/certificate.schema.json). ``--impl`` certifies your own
implementation of an op (a callable with the op's registered signature) instead of ``--candidate``;
without ``--ops`` only the ops given an implementation run. Exit 0 only if every op is certified, 1
otherwise, 2 for unusable arguments (an implementation that does not import, has another signature
or returns other shapes or dtypes included).

``--workers N`` runs the candidates in N worker processes (default: one per visible GPU on CUDA; on
the CPU one when an ``--impl`` comes from outside the project, else none: this process): a
candidate that kills its process or faults its CUDA context fails only the input it faulted on. ``--shard I/N`` certifies every N-th (op, dtype)
from the I-th; ``merge`` combines the shards' certificates into the one the unsharded run writes.
``--repro DIR`` writes a standalone repro of each failing input (docs/certificates.md).
``--variant kda_gate=softplus|lower_bound:B`` certifies every selected op that computes the KDA
gate as that gate's record (``kda.fused_chunked`` <-> ``kda.fused_chunked+lower_bound``; a bound B:
every input drawn with it); a shorthand's adapters then apply to the selected ops whatever gate
they declare (a kernel of the other gate fails, the certificate naming its gate).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from rich.console import Console

from kimi.config import kda_gate_name
from parity import certify as engine
from parity import ops, schema, strategies
from parity.bounds.core import CONTRACTS
from parity.certify import CertifyJob, Impl, candidate, merge, runners, units
from parity.certify.report import certificate, merged, render_op, render_summary, write_json
from parity.cli import judge
from parity.cli.args import MAX_EXAMPLES, check_count, check_outputs, parse_shard, write_output
from parity.cli.impls import DTYPES, select_runs, setup_device
from parity.errors import CandidateError, InputError
from parity.ops.kda import under_gate
from parity.peers import SHORTHANDS, implementations, missing
from parity.record import capture
from reference.checks import kda_gate_bound


def register(sub):
    p = sub.add_parser("certify", help="certify optimized ops against the float64 reference",
                       description=__doc__.split("\n\n")[0],
                       epilog="parity certify merge SHARD.json ... --json PATH: combine the certificates of "
                              "--shard I/N runs into the unsharded run's")
    p.add_argument("action", nargs="?", choices=("merge",), default=None,   # merge after options: kept a release
                   help=argparse.SUPPRESS)
    p.add_argument("files", nargs="*", metavar="FILES", help=argparse.SUPPRESS)
    p.add_argument("--ops", nargs="+", metavar="OP", help="ops (kda.chunked) or families (kda); default: all")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the candidate runs (default: cuda if available, else cpu)")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=None, dest="dtypes",
                   help="run dtypes: float32/float64 certify 'lifted', bfloat16 'production' (default: float32 bfloat16)")
    p.add_argument("--examples", type=int, default=None,
                   help=f"drawn inputs per op and dtype, at most {MAX_EXAMPLES} (default: the hypothesis profile's)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the certificate here")
    p.add_argument("--candidate", choices=("optimized", "reference-f32"), default="optimized",
                   help="what is certified: the optimized ops, or the float32 stand-in (parity.emulate)")
    p.add_argument("--impl", action="append", default=[], metavar="OP=SPEC",
                   help="certify your implementation of OP instead (repeatable): OP=module:function or "
                        "OP=path/to/file.py:function, a callable with the op's signature; or a shorthand "
                        f"for a set of adapters ({', '.join(SHORTHANDS)})")
    p.add_argument("--contract", choices=tuple(CONTRACTS), default=None,
                   help="the arithmetic every candidate claims (default: what each declares, else ieee): "
                        "ieee, tf32 (matrix-product operands read as TF32), bf16-storage")
    p.add_argument("--cases", metavar="FILE", default=None,
                   help="replay the cases parity capture wrote, beside the drawn inputs (cases of ops "
                        "--ops leaves out are skipped, with a line)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes running the candidates, each pinned to one GPU (default: one per "
                        "visible GPU on cuda; on cpu one for an --impl from outside the project, else none); "
                        "0: in this process")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="certify the I-th of N shares of the (op, dtype) runs (merge the certificates after)")
    p.add_argument("--repro", default=None, metavar="DIR",
                   help="write a standalone repro (inputs, reference, script) of each failing input here")
    p.add_argument("--variant", action="append", default=[], metavar="kda_gate=VALUE",
                   help="certify the ops that compute the KDA gate under this gate: kda_gate=softplus or "
                        "kda_gate=lower_bound:B (B in [-5, 0))")
    p.add_argument("--calls", metavar="FILE", default=None,
                   help="the older spelling of: parity judge FILE (judge the calls parity watch recorded)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.calls is not None:
        return _judge_calls(args)
    if args.action == "merge":
        return _merge(args)
    if args.files:
        raise InputError(f"unexpected argument {args.files[0]!r} (certificates are given to: parity certify merge)")
    job, variants, cases_info = _job(args)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    n, device, records, shard = job.examples, job.device, job.records, job.shard
    who = f"candidate {job.candidate}" if not job.impls else \
        f"implementations {', '.join(f'{i.op}={i.spec}' for i in job.impls)}" + \
        (f", candidate {job.candidate} for the rest" if len(job.impls) < len(records) else "")
    workers = sum(r.isolated for r in runners(device, job.workers))
    where = f", {workers} worker process(es)" if workers else ""
    if job.workers != args.workers:
        where += " (outside code runs isolated on the CPU by default; --workers 0: in this process)"
    part = f", shard {shard[0]}/{shard[1]} ({len(units(records, job.dtypes, shard))} (op, dtype) runs)" if shard else ""
    console.print(f"parity certify: {len(records)} op(s), {who}, device {device}, dtypes {', '.join(job.dtypes)}, "
                  f"{n} input(s) per dtype (hypothesis profile {strategies.profile_name()}){where}{part}")
    if cases_info is not None:
        console.print(_cases_line(job.cases, cases_info), highlight=False)
    t0 = time.perf_counter()
    certs = []

    def on_op(cert):
        certs.append(cert)
        render_op(console, cert)

    with console.status("certifying...") as status:
        def on_case(op, dtype, case):
            status.update(f"{op} [{dtype}] {case.label}: {_r(case.ratio)} x bound")

        try:
            engine.run_job(job, on_case=on_case, on_op=on_op)
        except CandidateError as exc:
            raise InputError(f"--impl: {exc}") from None
    seconds = time.perf_counter() - t0
    render_summary(console, certs, seconds)
    parts = None if shard is None else {"index": shard[0], "count": shard[1], "ops": [r.name for r in records],
                                        "units": [[r.name, d] for r, d in units(records, job.dtypes, shard)]}
    doc = certificate(certs, device=device, dtypes=job.dtypes, candidate=job.candidate, examples=n,
                      seconds=seconds, argv=_argv(), contract=job.contract, impls=job.specs(), cases=cases_info,
                      workers=workers, variants=variants, shard=parts)
    if job.repro is not None and any(not c.certified for c in certs):
        console.print(f"repros of the failing inputs written under {job.repro}")
    if args.json_path is not None:
        write_output(args.json_path, lambda: write_json(args.json_path, doc))
        console.print(f"certificate written to {args.json_path}")
    return 0 if doc["summary"]["verdict"] == "certified" else 1


def parse_impls(values) -> tuple[dict, list]:
    """``--impl`` values: (op -> spec, shorthands), checked before any work."""
    named, shorthands = {}, []
    for value in values:
        op, eq, spec = value.partition("=")
        if not eq:
            if value not in SHORTHANDS:
                raise InputError(f"--impl {value}: expected OP=module:function, OP=path/to/file.py:function "
                                 f"or one of {', '.join(SHORTHANDS)}")
            shorthands.append(value)
            continue
        try:
            ops.get(op)
        except KeyError:
            raise InputError(f"--impl {value}: unknown op {op!r}") from None
        if op in named:
            raise InputError(f"--impl {value}: {op} has an implementation already ({named[op]})")
        named[op] = spec
    return named, shorthands


def select_impls(values, records, *, ops_given: bool, device: str, contract: str | None,
                 gate_given: bool = False) -> tuple[list, tuple[Impl, ...]]:
    """(records to run, their ``Impl``s in the records' order) for the ``--impl`` ``values``: each
    loaded and its contract checked (CandidateError -> one line, exit 2; certify probes them before
    any work). Without ``--ops`` (``ops_given``) the ops given an implementation run; with it, a
    named op outside it is an error and a shorthand covers the selected ops it has adapters for. An
    adapter that declares the one KDA gate it computes covers, unless the ops or the gate were
    chosen (``--ops``, ``--variant kda_gate``; ``gate_given``), only the ops of that gate: asked, it
    is certified as the other's too, and fails naming its gate."""
    named, shorthands = parse_impls(values)
    selected = {r.name for r in records}
    if ops_given:
        for op in named:
            if op not in selected:
                raise InputError(f"--impl {op}={named[op]}: {op} is not among --ops")
    found = {}   # op -> (what was written, the callable)
    chosen = ops_given or gate_given
    for name in shorthands:
        why = missing(name)
        if why is not None:
            raise InputError(why)
        for op, fn in implementations(name, device).items():
            if op not in selected or op in named:
                continue
            if not chosen and candidate.gate_mismatch(ops.get(op), fn):
                continue   # not the gate it computes, and nobody asked
            found[op] = (name, fn)
    try:
        for op, spec in named.items():
            found[op] = (spec, candidate.load(spec))
        if named or shorthands:
            if not ops_given:
                records = [r for r in records if r.name in found]
            if not found:
                raise InputError(f"--impl {', '.join(shorthands)}: no implementation of the selected ops on {device}")
        impls = tuple(Impl(r.name, found[r.name][0],   # probed by certify, where the candidates run
                           candidate.of(found[r.name][1], contract=contract, spec=named.get(r.name)))
                      for r in records if r.name in found)
    except CandidateError as exc:
        raise InputError(f"--impl: {exc}") from None
    return records, impls


def _job(args) -> tuple[CertifyJob, dict, dict | None]:
    """(the ``CertifyJob`` of ``args``, the ``--variant`` values, the certificate's ``cases`` entry
    or None), every argument checked before any work."""
    check_outputs(("--json", args.json_path))
    check_count("--examples", args.examples, MAX_EXAMPLES, "examples")
    if args.workers is not None and args.workers < 0:
        raise InputError(f"--workers {args.workers}: expected a count >= 0")
    shard = parse_shard(args.shard)
    if args.repro is not None and os.path.exists(args.repro) and not os.path.isdir(args.repro):
        raise InputError(f"--repro {args.repro}: not a folder")
    parse_impls(args.impl)   # unusable --impl values: refused before anything loads
    records, dtypes = select_runs(args.ops, args.dtypes)
    variants = _variants(args.variant)
    if "kda_gate" in variants:
        records = under_gate(records, kda_gate_bound(variants["kda_gate"]))
    try:
        strategies.load_profile()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    device = setup_device(args.device)
    records, impls = select_impls(args.impl, records, ops_given=bool(args.ops), device=device,
                                  contract=args.contract, gate_given="kda_gate" in variants)
    cases, cases_info = _cases(args.cases, records)
    job = CertifyJob(tuple(records), dtypes, device, args.candidate, args.examples or strategies.examples(), impls,
                     args.contract, cases, _workers(args.workers, device, impls), shard, args.repro)
    return job, variants, cases_info


def _argv() -> list | None:
    """The command line, as the certificate records it (None when not run as ``parity certify``)."""
    return ["parity", "certify", *sys.argv[2:]] if sys.argv[1:2] == ["certify"] else None


def _judge_calls(args) -> int:
    """``parity certify --calls FILE [--ops ...] [--json PATH]``: ``parity judge``'s older spelling."""
    given = [f for f, v in (("--impl", args.impl), ("--cases", args.cases), ("--dtype", args.dtypes),
                            ("--examples", args.examples), ("--contract", args.contract), ("--device", args.device))
             if v]
    if given:
        raise InputError(f"--calls judges the recorded outputs on their own inputs; {given[0]} does not apply")
    return judge.judge_calls(args.calls, ops=args.ops, json_path=args.json_path, command="parity certify --calls")


def _workers(workers: int | None, device: str, impls) -> int | None:
    """``--workers`` as given; not given on the CPU with an implementation from outside the project
    (``candidate.in_project``): one worker, so that a candidate that ends its process fails only its
    own inputs (on CUDA the default is a worker per GPU already)."""
    if workers is None and device == "cpu" and not all(candidate.in_project(i.candidate) for i in impls):
        return 1
    return workers
def _variants(items) -> dict:
    """``--variant`` values: ``{"kda_gate": "softplus" | "lower_bound:<b>"}`` (the only variant an op
    certification has: the gate of the ops that compute one)."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if name != "kda_gate" or not eq:
            raise InputError(f"--variant {item}: expected kda_gate=softplus or kda_gate=lower_bound:B")
        try:
            out["kda_gate"] = kda_gate_name(kda_gate_bound(value))
        except ValueError:
            raise InputError(f"--variant {item}: expected kda_gate=softplus or kda_gate=lower_bound:B with B in "
                             "[-5, 0)") from None
    return out


def register_merge(sub):
    """``parity certify merge SHARD.json ... --json PATH``."""
    p = sub.add_parser("merge", help="combine the certificates of --shard I/N runs",
                       description="Combine the certificates of the shards of one certification (parity certify "
                                   "--shard I/N) into the one the unsharded run writes.")
    p.add_argument("files", nargs="*", metavar="SHARD.json", help="the shard certificates")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="where the merged certificate goes (required)")
    p.set_defaults(func=_merge)


def _merge(args) -> int:
    """``parity certify merge SHARD.json ... --json PATH``: the shards' certificates combined."""
    if not args.files:
        raise InputError("merge: give the shard certificates (parity certify merge a.json b.json --json out.json)")
    if args.json_path is None:
        raise InputError("merge: --json PATH is required (where the merged certificate goes)")
    check_outputs(("--json", args.json_path))
    docs = []
    for path in args.files:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise InputError(f"merge: {path}: {type(exc).__name__}: {exc}") from None
        errs = schema.errors(doc)
        if errs:
            raise InputError(f"merge: {path}: not a certificate: {errs[0]}")
        docs.append(doc)
    try:
        certs = merge(docs)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    doc = merged(docs, certs, argv=["parity", "certify", *sys.argv[2:]] if sys.argv[1:2] == ["certify"] else None)
    write_output(args.json_path, lambda: write_json(args.json_path, doc))
    s = doc["summary"]
    print(f"merged {len(docs)} shard(s): {s['certified']}/{s['ops']} op(s) certified; written to {args.json_path}")
    return 0 if s["verdict"] == "certified" else 1


def _cases(path, records):
    """``--cases FILE``: (op -> replayed cases of the selected ops, the certificate's ``cases``
    entry), or (None, None). The file is validated whole (an unknown op is an input error)."""
    if path is None:
        return None, None
    cf = capture.casefile.read(path)
    by_op, skipped = capture.replay_cases(cf, [r.name for r in records])
    info = {"file": str(cf.path), "sha256": cf.sha256, "replayed": sum(map(len, by_op.values())),
            "skipped": dict(skipped)}
    return by_op, info


def _cases_line(by_op, info) -> str:
    kinds = [c.source["kind"] for cs in by_op.values() for c in cs]
    line = (f"cases: {info['replayed']} replayed from {info['file']} ({kinds.count('captured')} captured, "
            f"{kinds.count('regenerated')} regenerated)")
    if info["skipped"]:
        line += (f"; skipped {sum(info['skipped'].values())} case(s) of ops not selected by --ops: "
                 + ", ".join(f"{op} ({k})" for op, k in info["skipped"].items()))
    return line


def _r(x):
    return "inf" if not math.isfinite(x) else f"{x:.3g}"
