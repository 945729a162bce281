"""`parity watch`: run a Python program unchanged and record the calls of named functions in it and
in its Python subprocesses, for ``parity judge`` (docs/watch.md).

    parity watch --op OP=module:function [--op ...] --out FILE [--max-bytes N] -- python prog.py ...
    parity watch --merge FILE

The program runs with ``parity/record/watch/bootstrap`` first on PYTHONPATH (its ``sitecustomize`` starts
the watch in every Python process) and the targets in ``PARITY_WATCH``. Each process writes its
calls as parts while it runs; when the program ends, however it ends (an exception, Ctrl-C, a
signal), the parts are merged into FILE. The exit code is the program's (128 + N for a signal N).
``--merge FILE`` merges the parts a run left when ``parity watch`` itself was killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from parity.cli.args import check_outputs
from parity.errors import InputError
from parity.record.watch import callfile, check_targets
from parity.record.watch.recorder import parse_bytes


def register(sub):
    p = sub.add_parser("watch", help="record the calls of named functions in a running Python program",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--op", action="append", default=[], metavar="OP=module:function", dest="ops",
                   help="watch this function as OP (an op or family: kda.chunked, kda); repeatable")
    p.add_argument("--out", default=None, metavar="FILE", help="the calls file to write")
    p.add_argument("--max-bytes", default="2G", metavar="N",
                   help="tensor bytes kept per process (2G, 512M, 0: shapes only); past it calls are sampled, "
                        "the first and the largest of each op always kept (default 2G)")
    p.add_argument("--merge", default=None, metavar="FILE", help="merge the parts an interrupted run left")
    p.add_argument("command", nargs="*", help="the program, after --: python prog.py ...")
    p.set_defaults(func=run)


def _targets(values) -> dict:
    targets = {}
    for v in values:
        name, eq, spec = v.partition("=")
        if not eq:
            raise InputError(f"--op {v}: expected OP=module:function")
        if name in targets:
            raise InputError(f"--op {v}: {name} is watched already ({targets[name]})")
        targets[name] = spec
    check_targets(targets)
    return targets


def _env(targets: dict, out: Path, max_bytes: int, command: list) -> dict:
    package = Path(__file__).parent.parent   # parity/
    boot = package / "record" / "watch" / "bootstrap"
    root = package.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), str(root), env.get("PYTHONPATH", "")) if p)
    run = {"command": command, "targets": targets, "cwd": os.getcwd(), "python": sys.version.split()[0]}
    env["PARITY_WATCH"] = json.dumps({"targets": targets, "out": str(out), "max_bytes": max_bytes, "run": run})
    return env


def run(args) -> int:
    if args.merge is not None:
        if args.ops or args.out or args.command:
            raise InputError("--merge FILE takes no other arguments")
        done = callfile.merge(Path(args.merge).resolve())
        if done is None:
            raise InputError(f"--merge {args.merge}: no parts to merge ({callfile.parts_dir(args.merge)})")
        print(f"parity watch: merged into {done}", file=sys.stderr)
        return 0
    if not args.ops:
        raise InputError("--op OP=module:function: at least one function to watch")
    if args.out is None:
        raise InputError("--out FILE: where to write the calls")
    if not args.command:
        raise InputError("no program to run: parity watch --op ... --out FILE -- python prog.py ...")
    check_outputs(("--out", args.out))
    try:
        max_bytes = parse_bytes(args.max_bytes)
    except ValueError as exc:
        raise InputError(f"--max-bytes {exc}") from None
    targets = _targets(args.ops)
    out = Path(args.out).resolve()
    if callfile.parts_dir(out).exists():
        raise InputError(f"--out {args.out}: {callfile.parts_dir(out)} holds the parts of an earlier run; "
                         f"parity watch --merge {args.out}, or remove it")
    env = _env(targets, out, max_bytes, list(args.command))
    try:
        child = subprocess.Popen(args.command, env=env)
    except OSError as exc:
        raise InputError(f"{args.command[0]}: {exc.strerror or exc}") from None
    # Ctrl-C reaches the program too (one process group): it flushes its calls as it exits, and
    # this process merges them once it has; SIGTERM is passed on
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, lambda s, f: child.send_signal(signal.SIGTERM))
    try:
        rc = child.wait()
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    code = rc if rc >= 0 else 128 - rc
    run_info = json.loads(env["PARITY_WATCH"])["run"]
    callfile.merge(out, run={**run_info, "max_bytes": max_bytes, "exit_code": code}, empty=True)
    head = callfile.read(out).header
    kept = sum(c["kept"] for c in head["calls"])
    print(f"parity watch: {len(head['calls'])} call(s), {kept} kept, from {len(head['run'].get('processes', []))} "
          f"process(es) in {args.out} (the program exited {code}); judge them: parity judge {args.out}",
          file=sys.stderr)
    for t in head["run"].get("never_called", []):
        print(f"parity watch: {t['target']} ({t['watched']}) was never called: {t['why']}", file=sys.stderr)
    return code
