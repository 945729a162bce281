"""`parity certify`: certify registered ops against the float64 reference (docs/certificates.md).

    parity certify [--ops OP|FAMILY ...] [--device cpu|cuda] [--dtype bfloat16|float32|float64 ...]
                   [--examples N] [--json PATH] [--candidate optimized|reference-f32] [--cases FILE]
                   [--impl OP=module:function | OP=path/to/file.py:function | fla ...]
                   [--contract ieee|tf32|bf16-storage]

Prints a table per op (shapes tried, worst error in bound units, strength, mutants killed, teeth,
verdict, the contract verdict, the nearest known bug of a failure) and a summary; ``--json`` writes
the certificate (schema: parity/schemas/certificate.schema.json). ``--impl`` certifies your own
implementation of an op (a callable with the op's registered signature) instead of ``--candidate``;
without ``--ops`` only the ops given an implementation run. Exit 0 only if every op is certified, 1
otherwise, 2 for unusable arguments (an implementation that does not import, has another signature
or returns other shapes or dtypes included).
"""
from __future__ import annotations

import math
import sys
import time

from parity.bounds.core import CONTRACTS
from parity.cli.args import MAX_EXAMPLES, check_count, check_outputs, write_output
from parity.errors import CandidateError, InputError
from parity.peers import SHORTHANDS

DTYPES = ("bfloat16", "float32", "float64")


def register(sub):
    p = sub.add_parser("certify", help="certify optimized ops against the float64 reference",
                       description=__doc__.split("\n\n")[0])
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
    p.set_defaults(func=run)


def _setup_device(device):
    """Select the backend before any kernel is defined (optimized._interpreter.select: on CPU the
    Triton interpreter, made faithful for bf16 dots)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)")
    from optimized import select

    return select(device)


def run(args) -> int:
    from parity import ops, strategies

    check_outputs(("--json", args.json_path))
    check_count("--examples", args.examples, MAX_EXAMPLES, "examples")
    named, shorthands = _parse_impls(args.impl)
    try:
        records = ops.select(args.ops)
    except KeyError as exc:
        raise InputError(str(exc.args[0])) from None
    dtypes = tuple(dict.fromkeys(args.dtypes or ("float32", "bfloat16")))
    try:
        profile = strategies.load_profile()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    device = _setup_device(args.device)
    records, impls, specs = _implementations(records, bool(args.ops), named, shorthands, device, dtypes[0],
                                             args.contract)
    import optimized

    # our kernels run on the CPU only under the interpreter; outside implementations and the
    # stand-in do not need it
    if device == "cpu" and not optimized.interpreting() and args.candidate == "optimized" \
            and any(r.name not in impls for r in records):
        raise InputError("--device cpu: the Triton interpreter was not selected (TRITON_INTERPRET is unset "
                         "and optimized/ was already imported)")
    cases, cases_info = _cases(args.cases, records)

    from rich.console import Console

    from parity import certify as engine
    from parity.report import certificate, render_op, render_summary

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    n = args.examples or strategies.examples()
    who = f"candidate {args.candidate}" if not impls else \
        f"implementations {', '.join(f'{op}={s}' for op, s in specs.items())}" + \
        (f", candidate {args.candidate} for the rest" if len(impls) < len(records) else "")
    console.print(f"parity certify: {len(records)} op(s), {who}, device {device}, dtypes {', '.join(dtypes)}, "
                  f"{n} input(s) per dtype (hypothesis profile {profile})")
    if cases_info is not None:
        console.print(_cases_line(cases, cases_info), highlight=False)
    t0 = time.perf_counter()
    certs = []

    def on_op(cert):
        certs.append(cert)
        render_op(console, cert)

    with console.status("certifying...") as status:
        def on_case(op, dtype, case):
            status.update(f"{op} [{dtype}] {case['label']}: {_r(case['ratio'])} x bound")

        try:
            engine.certify(records, dtypes=dtypes, device=device, candidate=args.candidate, examples=n,
                           on_case=on_case, on_op=on_op, impls=impls, contract=args.contract, cases=cases)
        except CandidateError as exc:
            raise InputError(str(exc)) from None
    seconds = time.perf_counter() - t0
    render_summary(console, certs, seconds)
    doc = certificate(certs, device=device, dtypes=dtypes, candidate=args.candidate, examples=n,
                      seconds=seconds, argv=["parity", "certify", *sys.argv[2:]] if sys.argv[1:2] == ["certify"]
                      else None, contract=args.contract, impls=specs, cases=cases_info)
    if args.json_path is not None:
        from parity.report import write_json

        write_output(args.json_path, lambda: write_json(args.json_path, doc))
        console.print(f"certificate written to {args.json_path}")
    return 0 if doc["summary"]["verdict"] == "certified" else 1


def _parse_impls(values) -> tuple[dict, list]:
    """``--impl`` values: (op -> spec, shorthands), checked before any work."""
    from parity import ops

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


def _implementations(records, ops_given, named, shorthands, device, dtype, contract):
    """(records to run, op -> Candidate, op -> spec) for the ``--impl`` values: each loaded, its
    contract checked and probed once on the op's first input (CandidateError -> one line, exit 2).
    Without ``--ops`` the ops given an implementation run; with it, a named op outside it is an error
    and a shorthand covers the selected ops it has adapters for."""
    from parity import candidate, ops
    from parity.peers import implementations

    selected = {r.name for r in records}
    if ops_given:
        for op in named:
            if op not in selected:
                raise InputError(f"--impl {op}={named[op]}: {op} is not among --ops")
    fns, specs = {}, {}
    for name in shorthands:
        for op, fn in implementations(name, device).items():
            if (op in selected or not ops_given) and op not in named:
                fns[op], specs[op] = fn, name
    try:
        for op, spec in named.items():
            fns[op], specs[op] = candidate.load(spec), spec
        if named or shorthands:
            if not ops_given:
                records = [r for r in ops.records() if r.name in fns]
            if not fns:
                raise InputError(f"--impl {', '.join(shorthands)}: no implementation of the selected ops on {device}")
        impls = {}
        for rec in records:
            if rec.name in fns:
                impls[rec.name] = cand = candidate.of(fns[rec.name], contract=contract)
                candidate.probe(rec, cand, dtype, cand.device(device))
    except CandidateError as exc:
        raise InputError(f"--impl: {exc}") from None
    return records, impls, {op: specs[op] for op in impls}


def _cases(path, records):
    """``--cases FILE``: (op -> replayed cases of the selected ops, the certificate's ``cases``
    entry), or (None, None). The file is validated whole (an unknown op is an input error)."""
    if path is None:
        return None, None
    from parity import capture

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
