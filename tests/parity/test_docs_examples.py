"""The README's commands and the examples of docs/*.md, run as a reader runs them, so that the docs
cannot drift from the tool (conventions: ``tests/parity/doc_blocks.py``).

One working folder serves every document, as for a reader who follows them all: it holds a copy of
``fixtures/`` (nothing a doc writes reaches the repository) and every file the docs show (a python
block whose first line is ``# NAME.py``). Each unmarked ``bash``, ``python`` and ``console`` block
runs in it, in document order; a command given twice runs once. ``parity ...`` and ``python FILE.py ...`` run in
this process (the same entry points as the shell's, without the interpreter's start-up), anything
else under bash. ``CHECKPOINT`` and ``CKPT`` stand for the bundled checkpoint. A command exits 0,
or as its transcript shows; a transcript's summary has the counts it shows. Every transcript and
shown output is checked for its shape against what the tool prints.

The reader's machine is the one the docs were written on, CI's: its host memory is counted as at
most ``DOCS_HOST_MEMORY`` (24 GiB), so a transcript of a refusal (the 48B model on the CPU) is
refused on a larger host too, instead of starting a run of hours there.

Cost on a 2-core CPU: about 30 s (72 s of CPU on a machine loaded 7-fold, where the getting-started
32-step run that takes 21 s idle took 49 s), nearly all of it the Triton interpreter in a few short
runs (prompts of a few tokens, 2 to 4 steps) and the golden check of the bundled checkpoint."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest

from . import doc_blocks as db
from parity import memory
from parity.cli import main

OPERATORS = {"|", "||", ";", "<", ">", ">>", "&", "(", ")"}  # a line with one of these runs under bash,
SHELL = set("$`*")  # and one that expands these
LANGS = ("bash", "python", "console", "json", "text", "")  # any other fence could hide code from the runner
DOCS_HOST_MEMORY = 24 * memory.GIB


def _docs_machine(device: str) -> int | None:
    """The free memory ``parity`` sees while the docs run: the real one, the host's capped at CI's."""
    free = memory.free_bytes(device)
    return min(free, DOCS_HOST_MEMORY) if device == "cpu" and free is not None else free


RUN_DOCS = [d for d in db.documents() if any(b.code and not b.not_run for b in db.blocks(d))]


def _tokens(line: str) -> list[str]:
    """The words of a command line as bash splits them, its operators (``&&``, ``>``) words of their
    own, a trailing comment dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


@contextlib.contextmanager
def _inside(folder):
    before, path = os.getcwd(), list(sys.path)
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path


class Reader:
    """The working folder and what ran in it: ``done`` {command: (status, output)}, ``headers``
    {command: the header labels its ``parity diff`` printed}."""

    def __init__(self, folder):
        self.folder = folder
        shutil.copytree(db.ROOT / "fixtures", folder / "fixtures")
        for name, block in db.files().items():
            (folder / name).write_text(block.text)
        self.done: dict[str, tuple[int, str]] = {}
        self.headers: dict[str, list[str]] = {}
        self._header: list[str] | None = None
        self.namespaces: dict[str, dict] = {}

    def command(self, line: str, where: str, *, status: int = 0) -> str:
        """Run one command line (or find it run) and check it exits with ``status``; returns its
        output (stderr, then stdout)."""
        line = db.substitute(line)
        tokens = _tokens(line)
        key = " ".join(tokens)  # the same command, whatever its comment or spacing, runs once
        if key not in self.done:
            self._header = None
            self.done[key] = self._run(line, tokens)
            if self._header is not None:
                self.headers[key] = self._header
        got, output = self.done[key]
        assert got == status, f"{where}: `{line}` exited {got}, not {status}:\n{output}"
        return output

    def diff_header(self, line: str, where: str) -> list[str]:
        """The header labels the ``parity diff`` command ``line`` prints (run now or found run)."""
        self.command(line, where)
        return self.headers[" ".join(_tokens(db.substitute(line)))]

    def _run(self, line: str, tokens: list[str]) -> tuple[int, str]:
        if OPERATORS & set(tokens) or SHELL & set(line):
            status, output = self._bash(line)
        else:
            status, output, argv = 0, "", []
            for token in tokens + ["&&"]:
                if token != "&&":
                    argv.append(token)
                    continue
                status, out = self._one(argv)
                output, argv = output + out, []
                if status:
                    break
        return status, output

    def _one(self, argv: list[str]) -> tuple[int, str]:
        if argv[0] == "parity":
            return self._in_process(lambda: main(argv[1:], free_memory=_docs_machine), diff=argv[1:2] in ([], ["diff"]))
        if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
            def script():
                sys.argv = argv[1:]
                runpy.run_path(argv[1], run_name="__main__")
                return 0
            return self._in_process(script)
        return self._bash(shlex.join(argv))

    def _in_process(self, call, *, diff: bool = False) -> tuple[int, str]:
        out, err, argv = io.StringIO(), io.StringIO(), list(sys.argv)
        with _inside(self.folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = call()
            except SystemExit as exc:
                status = exc.code
            finally:
                sys.argv = argv
        if diff:
            self._header = db.header(err.getvalue())
        return int(status or 0), err.getvalue() + out.getvalue()

    def _bash(self, line: str) -> tuple[int, str]:
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        done = subprocess.run(["bash", "-c", line], cwd=self.folder, env=env, capture_output=True, text=True)
        return done.returncode, done.stderr + done.stdout

    def python(self, block: db.Block) -> str:
        """Run a python block (the blocks of one document share their names); returns its stdout."""
        scope = self.namespaces.setdefault(block.doc, {"__name__": "__main__"})
        out = io.StringIO()
        with _inside(self.folder), contextlib.redirect_stdout(out):
            exec(compile(block.text, block.where, "exec"), scope)
        return out.getvalue()


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return Reader(tmp_path_factory.mktemp("reader"))


def _shown_output(blocks: list[db.Block], i: int) -> db.Block | None:
    return blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].output else None


@pytest.mark.parity_interpreter  # the docs' examples are CPU runs: device="cpu", the Triton interpreter
@pytest.mark.parametrize("doc", RUN_DOCS)
def test_every_unmarked_example_runs_as_written(doc, reader):
    blocks = db.blocks(doc)
    for i, block in enumerate(blocks):
        if not block.code or block.not_run or block.file_name:
            continue
        if block.lang == "bash":
            for line in db.logical_lines(block.text):
                reader.command(line, block.where)
        elif block.lang == "python":
            printed = reader.python(block)
            shown = _shown_output(blocks, i)
            if shown is not None:
                _same_shape(printed, shown)
        else:
            _run_transcript(reader, block)


def _run_transcript(reader: Reader, block: db.Block) -> None:
    """Run a transcript's commands: each exits as shown (``$ echo $?``), and prints a summary line
    of the same kind with the same counts as the one shown (the numbers around them may move with
    the platform; tools/doc_outputs.py rewrites them)."""
    runs = db.transcript(block.text)
    for k, (command, shown) in enumerate(runs):
        if command == "echo $?":
            continue
        status = int(runs[k + 1][1]) if k + 1 < len(runs) and runs[k + 1][0] == "echo $?" else 0
        printed = reader.command(command, block.where, status=status)
        assert db.summary(printed) == db.summary(shown), \
            f"{block.where}: `{command}` printed\n{printed}\nthe doc shows\n{shown}"


def _same_shape(printed: str, shown: db.Block) -> None:
    """What a python block printed and what the doc shows: as many lines, the same kind of summary
    on the same lines, with the same number of steps; the shown summaries add up."""
    got, want = printed.strip().splitlines(), shown.text.strip().splitlines()
    assert len(got) == len(want), f"{shown.where}: {len(want)} lines shown, {len(got)} printed:\n{printed}"
    for a, b in zip(got, want):
        for pattern in (db.DIFF_SUMMARY, db.GOLDEN_SUMMARY):
            ma, mb = pattern.match(a), pattern.match(b)
            assert bool(ma) == bool(mb), f"{shown.where}: shown {b!r}, printed {a!r}"
            if mb:
                n = {k: int(mb[k]) for k in ("match", "near", "diverged")}
                assert sum(n.values()) == int(mb["steps"]) == int(ma["steps"]), f"{shown.where}: {b}"


def test_every_code_block_is_run_or_says_why_not():
    """Marks carry a reason; no code hides behind another fence; every file the docs show is used
    by a command or block that runs."""
    texts = []
    for b in db.all_blocks():
        assert b.lang in LANGS, f"{b.where}: fence {b.lang!r}: use bash, python, console or text"
        assert b.lang == "console" or not b.text.startswith("$ "), f"{b.where}: a transcript: fence it console"
        if b.not_run is not None:
            assert b.code and len(b.not_run.split()) >= 3, f"{b.where}: 'not run: {b.not_run}' needs a reason"
        elif b.code and not b.file_name:
            texts.append(b.text if b.lang == "python" else db.substitute(b.text))
    for name, block in db.files().items():
        if block.not_run is None:
            assert any(re.search(rf"\b{re.escape(name[:-3])}\b", t) for t in texts), \
                f"{block.where}: no block that runs uses {name}"


@pytest.mark.parity_interpreter  # the transcripts are CPU runs: their header is the interpreter's
def test_every_transcript_has_the_shape_of_what_the_tool_prints(reader):
    """Each ``$ parity ...`` output of a transcript: its counts add up and agree with its table, the
    exit status shown follows from them, and a ``parity diff`` header names every line the tool
    prints today (a short run of the bundled checkpoint shows which)."""
    # the header of this one command, whichever diffs this process ran before
    today = reader.diff_header("parity diff CHECKPOINT --prompt Kimi --steps 1", "test_docs_examples.py")
    checked = []
    for b in db.all_blocks():
        if b.lang != "console":
            continue
        runs = db.transcript(b.text)
        for k, (command, output) in enumerate(runs):
            if command == "echo $?":
                continue
            status = int(runs[k + 1][1]) if k + 1 < len(runs) and runs[k + 1][0] == "echo $?" else None
            kind = db.check_shape(command, output, status)
            report = re.search(r"--json (docs/runs/\S+)", command)
            if report:  # the committed report of the run shown: the same summary
                line = json.loads((db.ROOT / report[1]).read_text())["summary"]["line"]
                assert output.strip().splitlines()[-1] == line, f"{b.where}: {report[1]} says {line}"
            if kind == "diff":
                labels = iter(db.header(output))
                assert all(label in labels for label in today), \
                    f"{b.where}: `{command}` shows the header {db.header(output)}; the tool prints {today}"
            checked.append(kind)
    assert checked.count("diff") >= 3 and "golden check" in checked, checked


def test_every_summary_line_a_doc_shows_adds_up():
    """Summary lines shown outside transcripts (outputs, examples in prose blocks): the counts add
    up to the steps or prompts they cover."""
    seen = 0
    for b in db.all_blocks():
        if b.lang == "console" or b.code:
            continue
        for line in b.text.splitlines():
            for pattern in (db.DIFF_SUMMARY, db.GOLDEN_SUMMARY):
                m = pattern.match(line)
                if m:
                    n = [int(m[k]) for k in ("match", "near", "diverged")]
                    assert sum(n) == int(m["steps"]), f"{b.where}: {line}"
                    seen += 1
            if db.CORPUS_SUMMARY.match(line):
                db.corpus_shape(line)
                seen += 1
    assert seen >= 4, seen
