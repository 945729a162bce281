"""The start of a watch in every Python process of a program run by ``parity watch``: read the
targets from the environment, install the import hook, and flush the calls at exit (a normal exit,
an exception, Ctrl-C, SIGTERM) and in a forked child start afresh. Called by
``bootstrap/sitecustomize.py``."""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys

from . import hook
from .recorder import Recorder

ENV = "PARITY_WATCH"


def start() -> None:
    cfg = json.loads(os.environ[ENV])
    rec = Recorder(cfg["out"], max_bytes=int(cfg["max_bytes"]), run=cfg["run"])
    hook.activate(rec)

    def on_error(line: str) -> None:
        print(f"parity watch: {line}", file=sys.stderr)

    hook.install_on_import(cfg["targets"], on_error)
    atexit.register(rec.close)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def on_term(signum, frame):
            rec.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        try:
            signal.signal(signal.SIGTERM, on_term)
        except ValueError:   # not the main thread
            pass

    def in_child() -> None:
        # the parent flushes what it recorded (the child's copy of it is dropped, so an exit of the
        # child never writes it twice); the child records its own calls under its own pid
        rec._entries, rec._tensors, rec._events, rec.closed = [], {}, [], True   # no lock: another thread may have held it
        child = Recorder(cfg["out"], max_bytes=int(cfg["max_bytes"]), run=cfg["run"])
        hook.activate(child)
        atexit.register(child.close)

    os.register_at_fork(after_in_child=in_child)
