"""Watch a running engine: record the calls of named functions in any Python program, inputs and
outputs, and judge each one against the float64 reference (docs/watch.md).

    >>> import parity
    >>> with parity.watch({"kda.chunked": "fla.ops.kda:chunk_kda"}, out="calls.safetensors"):
    ...     model.generate(...)
    $ parity judge calls.safetensors

Each watched function is wrapped where it is defined (``hook``); each call is recorded with its
call site and step, its tensors kept within a byte budget (``recorder``), and fitted to a
registered op by the reverse adapter of the function (``adapters``: fla-core's and transformers'
KDA functions in ``parity.peers``, this repository's optimized ops, a user's copy of one of them
marked with :func:`same_as`). The calls go to a safetensors file (``callfile``), written as parts
while the program runs, so a crash leaves the calls so far; ``judge`` is ``parity certify
--calls``. ``parity watch -- python prog.py`` (``parity/cli/watch.py``) does the same for a whole
program and its Python subprocesses, through ``bootstrap/sitecustomize.py``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from parity import ops

from . import adapters, callfile, hook
from .adapters import Mapping, Mismatch, same_as
from .hook import WatchError
from .recorder import Recorder, parse_bytes

__all__ = ["watch", "unwatch", "same_as", "next_step", "Mapping", "Mismatch", "WatchError", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 2 << 30


def check_targets(targets: dict) -> None:
    """``targets``: a non-empty dict of name (a registered op or family) -> ``module:function``."""
    if not isinstance(targets, dict) or not targets:
        raise WatchError("targets: expected {op: 'module:function', ...}, at least one")
    known = {r.name for r in ops.records()} | {r.family for r in ops.records()} | \
        {r.name for r in ops.kda.variants()}
    for name, spec in targets.items():
        if name not in known:
            raise WatchError(f"{name}={spec}: {name!r} is no registered op or family")
        hook.split(spec)


@contextlib.contextmanager
def watch(targets: dict, out, *, max_bytes=DEFAULT_MAX_BYTES, quiet: bool = False):
    """Record every call of the ``targets`` (``{op: "module:function"}``) made inside the block to
    ``out`` (a calls file; written whole when the block ends, even by an exception).
    ``max_bytes``: the budget of kept tensor bytes (an int or ``"2G"``; 0: shapes only). The
    functions run on their own arguments and return their own results: the engine computes the same
    bits. Yields the recorder. WatchError (one line) for a target that cannot be watched. The
    wrappers stay after the block, passing calls through, so the next block enters at once
    (:func:`unwatch` puts the functions back). A target
    never called inside the block is named on stderr with the likely reason (unless ``quiet``) and
    in the file (``run.never_called``)."""
    check_targets(targets)
    limit = parse_bytes(max_bytes) if isinstance(max_bytes, str) else int(max_bytes)
    if limit < 0:
        raise WatchError(f"max_bytes: {max_bytes!r} is negative")
    if hook.active() is not None:
        raise WatchError("a watch is running already in this process")
    out = Path(out)
    if not out.parent.is_dir():
        raise WatchError(f"{out}: folder {out.parent} does not exist")
    if callfile.parts_dir(out).exists():
        raise WatchError(f"{out}: {callfile.parts_dir(out)} holds the parts of an earlier watch; "
                         f"merge them (parity watch --merge {out}) or remove them")
    run = {"command": None, "targets": dict(targets), "cwd": os.getcwd(), "python": sys.version.split()[0]}
    rec = Recorder(out, max_bytes=limit, run=run, quiet=quiet)
    hook.install_now(targets)
    hook.activate(rec)
    try:
        yield rec
    finally:
        hook.activate(None)
        rec.close_into_file()
        if not quiet:
            for t in rec.never_called_report():
                print(f"parity watch: {t['target']} ({t['watched']}) was never called: {t['why']}", file=sys.stderr)


class _CallableModule(type(sys)):
    """``parity.watch(...)`` is :func:`watch`: the package is the context manager it names."""

    def __call__(self, *args, **kwargs):
        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


def unwatch() -> None:
    """Put back the functions the watches of this process wrapped (between watches; WatchError,
    one line, inside one). Not needed to stop recording: outside a watch the wrappers pass calls
    through. For a program that compares those functions by identity."""
    hook.uninstall()


def next_step() -> None:
    """Start a new step now (an engine whose passes the call stacks cannot tell apart)."""
    rec = hook.active()
    if rec is not None:
        rec.next_step()
