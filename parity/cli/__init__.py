"""The ``parity`` command line: one subcommand per module in this package.

Each subcommand module exposes ``register(subparsers)`` (adds its parser and sets ``func``) and
raises ``parity.errors.InputError`` for unusable input; ``main`` turns that into a single line
``error: ...`` on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from parity.errors import InputError

SUBCOMMANDS = ("diff", "certify", "search", "capture", "watch", "fixture", "golden")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="parity", description="Certify an optimized Kimi-Linear against a float64 reference.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"parity.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["diff", *argv]  # `parity` alone is `parity diff` on the bundled checkpoint
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        from reference.validate import one_line

        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
