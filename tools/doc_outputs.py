"""Rewrite the outputs the docs show by running them again: every transcript (a ```console block)
and every ``<!-- output -->`` block after a python block, of the blocks the test suite runs and
those whose ``<!-- not run: ... -->`` mark names this script.

    python tools/doc_outputs.py                       # every document
    python tools/doc_outputs.py docs/cli.md           # one
    python tools/doc_outputs.py --check               # rewrite nothing; exit 1 where an output differs

Each document runs in a fresh folder holding a copy of fixtures/ and the docs' files (as the test
suite runs them, tests/parity/test_docs_examples.py): its unmarked bash and python blocks in order,
each transcript's commands under bash when its turn comes (stdout and stderr together, as a pipe
gets them: tables 140 columns wide, no progress bar), ``CHECKPOINT`` and ``CKPT`` standing for the
bundled checkpoint. ``docs/`` in that folder is the repository's (a copy with ``--check``), so a
transcript that writes ``docs/runs/...`` refreshes the committed report too. The repository's path
is shown as ``~/kimi-parity``, the folder's as ``.``. Prints the wall and CPU time of every
transcript: the docs quote them. The shown outputs are CPU runs: run it on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.parity import doc_blocks as db  # noqa: E402

SHOWN_ROOT = "~/kimi-parity"
ME = "tools/doc_outputs.py"


class Folder:
    """A document's working folder and the shell state its commands share (the last exit status)."""

    def __init__(self, path: Path, *, check: bool):
        self.path, self.status = path, 0
        shutil.copytree(ROOT / "fixtures", path / "fixtures")
        if check:
            shutil.copytree(ROOT / "docs", path / "docs")
        else:
            (path / "docs").symlink_to(ROOT / "docs")
        for name, block in db.files().items():
            (path / name).write_text(block.text)
        self.scope = {"__name__": "__main__"}

    def shell(self, line: str) -> str:
        if line == "echo $?":
            return f"{self.status}\n"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        done = subprocess.run(["bash", "-c", db.substitute(line)], cwd=self.path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.status = done.returncode
        return self.shown(done.stdout)

    def python(self, block: db.Block) -> str:
        out, before = io.StringIO(), os.getcwd()
        sys.path.insert(0, str(self.path))
        os.chdir(self.path)
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(block.text, block.where, "exec"), self.scope)
        finally:
            os.chdir(before)
            sys.path.remove(str(self.path))
        return self.shown(out.getvalue())

    def shown(self, text: str) -> str:
        text = text.replace(str(self.path.resolve()) + "/", "").replace(str(self.path) + "/", "")
        return text.replace(str(ROOT), SHOWN_ROOT)


def _children_cpu() -> float:
    """CPU seconds of the finished child processes (a wall time on a busy machine overstates a run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _regenerated(blocks: list[db.Block], i: int) -> bool:
    """Whether this script rewrites block ``i``: a transcript it runs, or a shown output."""
    b = blocks[i]
    return b.output or (b.lang == "console" and _runs(b))


def _runs(block: db.Block) -> bool:
    """Whether this script runs the block: the suite runs it, or its mark names this script."""
    return block.not_run is None or ME in block.not_run


def regenerate(doc: str, *, check: bool) -> list[str]:
    """The document's text with its outputs rerun; prints what ran. Returns the blocks that changed."""
    lines = (ROOT / doc).read_text().splitlines(keepends=True)
    blocks = db.blocks(doc)
    last = max((i for i, b in enumerate(blocks) if _regenerated(blocks, i)), default=-1)
    changed, replace = [], []
    if last < 0:
        return changed
    with tempfile.TemporaryDirectory() as tmp:
        folder = Folder(Path(tmp), check=check)
        for i, block in enumerate(blocks[:last + 1]):
            if block.file_name or block.output:
                continue
            if block.lang == "bash" and not block.not_run:
                for line in db.logical_lines(block.text):
                    folder.shell(line)
                    assert folder.status == 0, f"{block.where}: `{line}` exited {folder.status}"
            elif block.lang == "python" and _runs(block):
                printed = folder.python(block)
                shown = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].output else None
                if shown is not None:
                    replace.append((shown, printed))
            elif block.lang == "console" and _runs(block):
                start, cpu = time.time(), _children_cpu()
                text = "".join(f"$ {command}\n" + folder.shell(command) for command, _ in db.transcript(block.text))
                print(f"{block.where}: {time.time() - start:.1f} s wall, {_children_cpu() - cpu:.1f} s CPU",
                      file=sys.stderr)
                replace.append((block, text))
    for block, text in sorted(replace, key=lambda r: -r[0].line):
        if block.text != text:
            changed.append(block.where)
        end = block.line + block.text.count("\n")
        lines[block.line:end] = [text]
    if not check:
        (ROOT / doc).write_text("".join(lines))
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", nargs="*", default=list(db.documents()))
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 where an output differs")
    args = parser.parse_args(argv)
    changed = [where for doc in args.docs for where in regenerate(doc, check=args.check)]
    for where in changed:
        print(f"{where}: {'differs' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
