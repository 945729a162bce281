"""Argument checks every subcommand shares, run before any work starts: output files
(``kimi.validate.output_file``: not empty, not a directory, a folder that exists and is
writable, a name the file system takes), bounded counts and seeds, and writes whose OS errors become
one-line input errors."""
from __future__ import annotations

from parity.errors import InputError, check_outputs, write_output  # noqa: F401  (this module's interface)

MAX_STEPS = 100_000       # decode steps of diff / golden (a golden file holds at most this many)
MAX_EXAMPLES = 10_000     # certify inputs per op and dtype (each runs a kernel and its mutants)
MAX_TOP_K = 4096          # logits a golden keeps per step
MAX_SEED = 2 ** 32 - 1


def check_count(flag: str, value: int | None, hi: int, noun: str) -> None:
    """``value`` (None: not given) is a positive count no larger than ``hi``."""
    if value is None:
        return
    if value < 1:
        raise InputError(f"{flag} {value}: expected a positive number of {noun}")
    if value > hi:
        raise InputError(f"{flag} {value}: more than the limit of {hi} {noun}")


def check_seed(flag: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise InputError(f"{flag}: expected 0 <= S < 2**32, got {value}")


def check_text(flag: str, text: str | None) -> None:
    """Text from the command line is valid UTF-8 (undecodable argv bytes arrive as lone surrogates)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{flag}: not valid UTF-8 text (bad byte at character {exc.start})") from None


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` -> ``(i, n)`` with ``1 <= i <= n`` (None: no sharding)."""
    if value is None:
        return None
    i, slash, n = value.partition("/")
    if not (slash and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise InputError(f"--shard {value}: expected I/N with 1 <= I <= N")
    return int(i), int(n)
