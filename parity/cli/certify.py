"""`parity certify`: certify registered ops against the float64 reference (docs/certificates.md).

    parity certify [--ops OP|FAMILY ...] [--device cpu|cuda] [--dtype bfloat16|float32|float64 ...]
                   [--examples N] [--json PATH] [--candidate optimized|reference-f32]

Prints a table per op (shapes tried, worst error in bound units, strength, mutants killed, teeth,
verdict) and a summary; ``--json`` writes the certificate (schema: parity/schemas/certificate.schema.json).
Exit 0 only if every op is certified, 1 otherwise, 2 for unusable arguments.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings

from parity.cli.args import MAX_EXAMPLES, check_count, check_outputs, write_output
from parity.errors import InputError

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
    p.set_defaults(func=run)


def _setup_device(device):
    """Select the backend before optimized/ is imported: on CPU the Triton interpreter, made faithful
    for bf16 dots."""
    if device == "cpu" and "optimized" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and "optimized" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)")
    import optimized

    if device == "cpu" and not optimized.interpreting():
        raise InputError("--device cpu: the Triton interpreter was not selected (TRITON_INTERPRET is unset "
                         "and optimized/ was already imported)")
    if optimized.interpreting():
        optimized.install_faithful_bf16_dot()
        # numpy evaluates masked-off padding lanes too (0/0 there is discarded by the store mask)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    return device


def run(args) -> int:
    from parity import ops, strategies

    check_outputs(("--json", args.json_path))
    check_count("--examples", args.examples, MAX_EXAMPLES, "examples")
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

    from rich.console import Console

    from parity import certify as engine
    from parity.report import certificate, render_op, render_summary

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    n = args.examples or strategies.examples()
    console.print(f"parity certify: {len(records)} op(s), candidate {args.candidate}, device {device}, "
                  f"dtypes {', '.join(dtypes)}, {n} input(s) per dtype (hypothesis profile {profile})")
    t0 = time.perf_counter()
    certs = []

    def on_op(cert):
        certs.append(cert)
        render_op(console, cert)

    with console.status("certifying...") as status:
        def on_case(op, dtype, case):
            status.update(f"{op} [{dtype}] {case['label']}: {_r(case['ratio'])} x bound")

        engine.certify(records, dtypes=dtypes, device=device, candidate=args.candidate, examples=n,
                       on_case=on_case, on_op=on_op)
    seconds = time.perf_counter() - t0
    render_summary(console, certs, seconds)
    doc = certificate(certs, device=device, dtypes=dtypes, candidate=args.candidate, examples=n,
                      seconds=seconds, argv=["parity", "certify", *sys.argv[2:]] if sys.argv[1:2] == ["certify"]
                      else None)
    if args.json_path is not None:
        from parity.report import write_json

        write_output(args.json_path, lambda: write_json(args.json_path, doc))
        console.print(f"certificate written to {args.json_path}")
    return 0 if doc["summary"]["verdict"] == "certified" else 1


def _r(x):
    return "inf" if not math.isfinite(x) else f"{x:.3g}"
