"""The code blocks of README.md and docs/*.md, and the shape of the outputs they show.

Every fenced block is one of:

- ```` ```bash ````: commands the suite runs (``tests/parity/test_docs_examples.py``), line by line;
- ```` ```python ````: code the suite runs; a block whose first line is ``# NAME.py`` is that file,
  written into the working folder for the commands that use it;
- ```` ```console ````: a transcript, ``$ COMMAND`` lines and what they printed (``$ echo $?``: the
  exit status); the suite runs it unless marked, ``python tools/doc_outputs.py`` reruns and rewrites it;
- a block right after ``<!-- output -->``: what the python block before it prints (rewritten by the
  same script);
- anything else (a synopsis, a formula, a JSON header): text.

A code block the suite does not run says why, on the line before its fence:
``<!-- not run: needs a GPU -->`` (a mark that names ``tools/doc_outputs.py``: that script still
runs it). Transcripts and outputs are checked for their shape here:
the counts of a summary line add up and agree with the table above it, the header names what the
tool names today, the exit status shown follows from the verdicts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("bash", "python", "console")
NOT_RUN = re.compile(r"<!-- not run: (?P<why>.*?) -->")
FILE_BLOCK = re.compile(r"# (?P<name>[\w.-]+\.py)\b")
# what stands for the user's checkpoint folder in commands: the bundled one when the suite runs them
PLACEHOLDERS = ("CHECKPOINT", "CKPT")
BUNDLED = "fixtures/default"


@dataclass
class Block:
    """One fenced block: ``doc`` (relative to the repository), ``line`` (of its opening fence,
    1-based), ``lang`` (the fence's info string), ``text``, the reason it is not run (``None``: it is
    run, or it is text), and whether it is the shown output of the python block before it."""
    doc: str
    line: int
    lang: str
    text: str
    not_run: str | None = None
    output: bool = False

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def code(self) -> bool:
        return self.lang in CODE and not self.output

    @property
    def file_name(self) -> str | None:
        """``NAME.py`` for a python block that is a file the docs name (first line ``# NAME.py``)."""
        first = self.text.split("\n", 1)[0]
        m = FILE_BLOCK.match(first)
        return m["name"] if self.lang == "python" and m else None


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of ``doc`` in order, with the marks on the lines just above each fence."""
    lines = (ROOT / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start, lang = i, lines[i][3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marks = []
        k = start - 1
        while k >= 0 and lines[k].startswith("<!--"):
            marks.append(lines[k])
            k -= 1
        why = [m["why"] for m in map(NOT_RUN.fullmatch, marks) if m]
        out.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                         not_run=why[0] if why else None, output="<!-- output -->" in marks))
        i = end + 1
    return out


def documents() -> list[str]:
    """README.md and every page of docs/, relative to the repository."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for doc in documents() for b in blocks(doc)]


def files() -> dict[str, Block]:
    """Every file block of the docs, by name (a name given twice is an error of the docs)."""
    found: dict[str, Block] = {}
    for b in all_blocks():
        name = b.file_name
        if name:
            assert name not in found, f"{b.where}: {name} is also {found[name].where}"
            found[name] = b
    return found


def logical_lines(text: str) -> list[str]:
    """A bash block's command lines: continuations joined, blank lines and comment lines dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def transcript(text: str) -> list[tuple[str, str]]:
    """A console block as ``[(command, its output)]``."""
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], ""))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + line + "\n")
        else:
            raise AssertionError(f"a transcript starts with '$ COMMAND', not {line!r}")
    return out


def substitute(command: str) -> str:
    """``command`` with the checkpoint placeholders replaced by the bundled checkpoint."""
    return re.sub(r"\b(%s)\b" % "|".join(PLACEHOLDERS), BUNDLED, command)


# -- the shape of what the tool prints --------------------------------------------------------------

DIFF_SUMMARY = re.compile(r"^(?P<match>\d+)/(?P<steps>\d+) tokens match, (?P<near>\d+) near-ties?"
                          r"(?: \(steps? (?P<near_steps>(?:\d+, )*\d+))?.*?, (?P<diverged>\d+) diverged")
GOLDEN_SUMMARY = re.compile(r"^golden: (?P<match>\d+)/(?P<steps>\d+) steps match, (?P<near>\d+) near-tie, "
                            r"(?P<diverged>\d+) diverged")
CORPUS_SUMMARY = re.compile(r"^(?P<prompts>\d+) prompts, (?P<steps>\d+) steps: (?P<match>\d+) match, "
                            r"(?P<near>\d+) near-tie, (?P<past>\d+) past-bound, (?P<diverged>\d+) diverged")
ROW = re.compile(r"^│\s+(?P<step>\d+) │ (?P<ref>[^│]+)│ (?P<opt>[^│]+)│ (?P<verdict>[a-z-]+(?: \(\w+\))?)\s+│")
TABLE_LONG = 64  # longer runs print only the steps that did not match or had a router flip


def table(output: str) -> list[list[str]]:
    """The cells of every step row of a ``parity diff`` table: step, ref, opt, verdict,
    max|dlogit|, KL, ref gap, margin, bound, router flips."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in output.splitlines() if ROW.match(line)]


def header(output: str) -> list[str]:
    """The header lines of a ``parity diff`` output: those before its table, by their label (the
    text before the first ':')."""
    out = []
    for line in output.splitlines():
        if line.lstrip().startswith(("parity diff (", "┏")):
            break
        out.append(line.split(":", 1)[0])
    return out


def diff_shape(output: str, *, status: int | None = None) -> dict:
    """Check a ``parity diff`` output for its shape and return its counts: the summary line (last)
    adds up, agrees with the table's rows (all of them up to 64 steps, else those shown) and with
    the near-tie steps it lists, and ``status`` (the exit status shown, if any) follows from it."""
    lines = output.strip().splitlines()
    m = DIFF_SUMMARY.match(lines[-1])
    assert m, f"the last line is no summary line: {lines[-1]!r}"
    n = {k: int(m[k]) for k in ("match", "steps", "near", "diverged")}
    assert n["match"] + n["near"] + n["diverged"] == n["steps"], lines[-1]
    rows = [r for r in map(ROW.match, lines) if r]
    verdicts = [r["verdict"].split()[0] for r in rows]
    assert [int(r["step"]) for r in rows] == sorted(int(r["step"]) for r in rows), "rows out of order"
    for r in rows:
        same = r["ref"].strip() == r["opt"].strip()
        assert same == (r["verdict"] == "match"), f"step {r['step']}: tokens and verdict disagree"
    if n["steps"] <= TABLE_LONG and rows:
        assert len(rows) == n["steps"], f"{len(rows)} rows for {n['steps']} steps"
        assert verdicts.count("match") == n["match"], lines[-1]
    if rows:
        assert (verdicts.count("near-tie"), verdicts.count("diverged")) == (n["near"], n["diverged"]), lines[-1]
    if m["near_steps"] and rows:
        listed = [int(s) for s in re.findall(r"\d+", m["near_steps"])]
        near = [int(r["step"]) for r in rows if r["verdict"].startswith("near-tie")]
        assert near[:len(listed)] == listed, f"near-tie steps {listed} listed, rows say {near}"
    said = re.search(r"; (\d+) steps$", "\n".join(header(output)), re.M)
    if said:
        assert int(said[1]) == n["steps"], f"the header says {said[1]} steps, the summary {n['steps']}"
    if status is not None:
        bad = n["diverged"] > 0 or "not clean" in lines[-1]
        assert status == (1 if bad else 0), f"exit {status} shown after: {lines[-1]}"
    return n


def golden_shape(output: str, *, status: int | None = None) -> dict:
    """``parity golden check``'s output: the summary adds up, one ``step K: diverged`` line per
    diverged step, the exit status follows."""
    lines = output.strip().splitlines()
    m = GOLDEN_SUMMARY.match(lines[-1])
    assert m, f"the last line is no golden summary: {lines[-1]!r}"
    n = {k: int(m[k]) for k in ("match", "steps", "near", "diverged")}
    assert n["match"] + n["near"] + n["diverged"] == n["steps"], lines[-1]
    assert sum(bool(re.match(r"step \d+: diverged", x)) for x in lines) == n["diverged"], output
    if status is not None:
        assert status == (1 if n["diverged"] else 0), f"exit {status} shown after: {lines[-1]}"
    return n


def corpus_shape(line: str) -> dict:
    m = CORPUS_SUMMARY.match(line)
    assert m, f"no corpus summary: {line!r}"
    n = {k: int(m[k]) for k in ("prompts", "match", "near", "past", "diverged")}
    assert n["match"] + n["near"] + n["past"] + n["diverged"] == n["prompts"], line
    return n


def summary(output: str) -> tuple | None:
    """The kind and counts of the last summary line of ``output`` (diff, golden check or corpus)."""
    for line in reversed(output.strip().splitlines()):
        for kind, pattern in (("diff", DIFF_SUMMARY), ("golden", GOLDEN_SUMMARY), ("corpus", CORPUS_SUMMARY)):
            m = pattern.match(line)
            if m:
                return (kind, *(int(v) for k, v in m.groupdict().items() if k != "near_steps" and v is not None))
    return None


def check_shape(command: str, output: str, status: int | None) -> str:
    """Check the output of one transcript command by what it ran; returns the kind checked."""
    argv = command.split()
    if output.startswith("error: "):  # a refusal: one line, exit 2
        assert len(output.strip().splitlines()) == 1 and status == 2, f"`{command}`: {output!r}, exit {status}"
        return "error"
    if argv[:2] == ["parity", "diff"] or argv == ["parity"]:
        diff_shape(output, status=status)
        return "diff"
    if argv[:3] == ["parity", "golden", "check"]:
        golden_shape(output, status=status)
        return "golden check"
    if argv[:3] == ["parity", "golden", "record"]:
        counts = diff_shape(output.rsplit("\nwrote ", 1)[0])
        m = re.search(r"^wrote \S+: (\d+) steps", output, re.M)
        assert m and int(m[1]) == counts["steps"], output
        return "golden record"
    return "other"
