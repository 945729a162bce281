"""The CLI's own subcommands and their older spellings: `parity diff merge`, `parity certify merge`
and `parity judge` each parse as a command of their own, and the spellings they replace (`merge`
after options, `parity certify --calls`) still reach the same code; only `parity/cli/` reads
argparse. Cost: under a second (argument errors only, nothing decodes or certifies)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..diff_helpers import one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("argv, needle", [
    (["diff", "merge", "--json", "{d}/m.json"], "merge: give the shard reports"),
    (["diff", "--json", "{d}/m.json", "merge"], "merge: give the shard reports"),          # merge after options
    (["diff", "merge", "{d}/r1.json"], "merge: --json PATH is required"),
    (["certify", "merge", "--json", "{d}/m.json"], "merge: give the shard certificates"),
    (["certify", "--json", "{d}/m.json", "merge"], "merge: give the shard certificates"),  # merge after options
    (["certify", "merge", "{d}/s1.json"], "merge: --json PATH is required"),
    (["judge", "{d}/missing.safetensors"], "no such calls file"),
    (["certify", "--calls", "{d}/missing.safetensors"], "no such calls file"),           # the older spelling
    (["diff", "merge", "--steps", "2"], "unrecognized arguments: --steps"),               # merge takes its own flags
])
def test_each_subcommand_and_its_older_spelling_reach_the_same_checks(tmp_path, capsys, argv, needle):
    rc, out, err = run_cli(capsys, *[a.format(d=tmp_path) for a in argv])
    one_line_error(rc, out, err, needle)
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("argv, prog", [
    (["diff", "merge", "--help"], "usage: parity diff merge"),
    (["certify", "merge", "--help"], "usage: parity certify merge"),
    (["judge", "--help"], "usage: parity judge"),
    (["--help"], "judge"),
])
def test_the_subcommands_have_their_own_help(capsys, argv, prog):
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and prog in out


def test_only_the_cli_reads_argparse():
    imports = re.compile(r"^\s*(import argparse|from argparse import)", re.M)
    readers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "parity").rglob("*.py"))
               if p.relative_to(ROOT).parts[:2] != ("parity", "cli") and imports.search(p.read_text())]
    assert readers == []
