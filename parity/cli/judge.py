"""`parity judge`: judge the op calls `parity watch` recorded, each on its own recorded inputs and
outputs against the float64 reference (the kernel is not run again; docs/watch.md).

    parity judge FILE [--ops OP|FAMILY ...] [--json PATH]

``parity certify --calls FILE`` is the older spelling of the same command. Prints the first bad call,
a row per call and the per-op summary; ``--json`` writes the certificate with its ``calls`` object.
Exit 0 when every judged call is clean, 1 otherwise, 2 for unusable input.
"""
from __future__ import annotations

import sys
import time

from rich.console import Console

from parity.certify.report import write_json
from parity.cli.args import check_outputs, write_output
from parity.record.watch import judge, report


def register(sub):
    p = sub.add_parser("judge", help="judge the op calls parity watch recorded (each on its own inputs)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("calls", metavar="FILE", help="the recorded calls (parity watch --out FILE)")
    p.add_argument("--ops", nargs="+", metavar="OP", help="judge only these ops (kda.chunked) or families (kda)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the certificate here")
    p.set_defaults(func=lambda args: judge_calls(args.calls, ops=args.ops, json_path=args.json_path,
                                                 command="parity judge"))


def judge_calls(path: str, *, ops, json_path: str | None, command: str) -> int:
    """Judge the calls recorded in ``path`` (``ops``: only these), print the report, write the
    certificate to ``json_path``; ``command`` the spelling that ran (its header and the certificate's
    ``command``). The exit status."""
    check_outputs(("--json", json_path))
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    console.print(f"{command} {path}: each recorded call's outputs against the float64 reference "
                  "on its recorded inputs (the kernel is not run again)", soft_wrap=True)
    t0 = time.perf_counter()
    with console.status("judging...") as status:
        def on_call(c):
            status.update(f"{c.entry['id']} {c.entry['op']}: {c.verdict}")

        v = judge.judge_file(path, ops=ops, on_call=on_call)
    v.seconds = time.perf_counter() - t0
    report.render(console, v)
    d = report.certificate(v, argv=_argv())
    if json_path is not None:
        write_output(json_path, lambda: write_json(json_path, d))
        console.print(f"certificate written to {json_path}")
    return 0 if v.certified else 1


def _argv() -> list | None:
    """The command line as the certificate records it (None when not run as ``parity``'s judge)."""
    name = sys.argv[1:2]
    return ["parity", *name, *sys.argv[2:]] if name in (["certify"], ["judge"]) else None
