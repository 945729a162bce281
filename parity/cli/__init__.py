"""The ``parity`` command line: one subcommand per module in this package, the only code that reads
arguments: each command checks its flags, builds its job (``parity.certify.job.CertifyJob``,
``parity.diff.job.DiffJob``, ...) and calls the library once.

Each subcommand module exposes ``register(subparsers)`` (adds its parser and sets ``func``; a
command's own subcommands, ``parity diff merge`` and ``parity certify merge``: ``NESTED``) and
raises ``parity.errors.InputError`` for unusable input; ``main`` turns that into a single line
``error: ...`` on stderr and exit code 2, never a traceback. Exit 1 means only that a bug was found.

A failure to run is exit 2 as well, each caught where it is known for what it is: an engine that
cannot load or run becomes an ``InputError`` at the engine boundary (``parity.diff.engines``), and
``main`` turns what no command can foresee into one line: running out of memory on any device
(``parity.errors.is_out_of_memory``) and a package that is not installed (a ``ModuleNotFoundError``
naming a module outside this project). Anything else is a bug of parity itself and keeps its
traceback.

``args.free_memory(device) -> bytes or None`` is what the commands ask before they allocate
(``parity.memory``): ``main``'s ``free_memory`` argument, by default the device's real free memory;
a test passes its own to see a refusal on any machine.
"""
from __future__ import annotations

import argparse
import sys

from kimi.validate import one_line
from parity import memory
from parity.errors import InputError, is_out_of_memory, memory_line

from . import capture, certify, diff, fixture, golden, judge, search, watch

SUBCOMMANDS = (diff, certify, judge, search, capture, watch, fixture, golden)   # in the order --help lists them
# a command's own subcommands: ``parity diff merge``, ``parity certify merge`` (the command's
# positionals stay free for its main form, ``parity diff CHECKPOINT``)
NESTED = {"diff": {"merge": diff.register_merge}, "certify": {"merge": certify.register_merge}}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="parity", description="Certify an optimized Kimi-Linear against a float64 reference.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def nested_parser(command: str, action: str) -> argparse.ArgumentParser:
    """The parser of ``parity COMMAND ACTION ...`` (``NESTED``)."""
    parser = _Parser(prog=f"parity {command}")
    NESTED[command][action](parser.add_subparsers(dest="action", parser_class=_Parser))
    return parser


PROJECT_PACKAGES = ("parity", "kimi", "reference", "optimized", "tests")  # a module of these missing is our bug


def main(argv: list[str] | None = None, *, free_memory=None) -> int:
    """``parity ARGV``: the exit status. ``free_memory(device) -> bytes or None`` replaces the
    devices' real free memory (``parity.memory.free_bytes``) in every check made before allocating."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["diff", *argv]  # `parity` alone is `parity diff` on the bundled checkpoint
    if len(argv) > 1 and argv[1] in NESTED.get(argv[0], ()):
        args = nested_parser(argv[0], argv[1]).parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    args.free_memory = free_memory or memory.free_bytes
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        return _error(str(exc))
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        return _error(memory_line(exc))
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if not top or top in PROJECT_PACKAGES:
            raise
        return _error(f"the package {top!r} is not installed ({exc}); install it into this environment "
                      "(pip install 'kimi-parity[peers]' for the outside implementations)")
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _error(message: str) -> int:
    print(f"error: {one_line(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
