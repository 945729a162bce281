"""``parity diff --prompts FILE``: one ``run_diff`` per prompt of a corpus, and the corpus report.

Every prompt is judged exactly as a single-prompt ``parity diff`` judges it (same engine object, one
certified twin for the corpus: ``twin.py`` memoizes its runs). The corpus report adds what only many
prompts show: which prompts diverged (each with its first bad step and its localization), the
distribution over prompts of each op's error in units of its bound, the near-tie and router-flip
rates, and llama.cpp's ``--kl-divergence`` numbers (mean and p99 of KL(reference || engine) over
every step, top-1 agreement) beside the bound-based verdicts.

A corpus is split deterministically for one process per GPU or host (``--shard i/n``: prompt ``k``,
0-based, goes to shard ``k % n + 1``); ``merge`` combines the shard reports into the report the
unsharded run writes. Every aggregate is computed from the per-prompt records as they are written
to JSON, so a merge of shards reproduces the unsharded numbers exactly.

Corpus file formats (docs/cli.md): ``*.jsonl`` / ``*.ndjson``, one object per line with ``text`` or
``ids``; any other file is text, one prompt per line. Empty lines are skipped in both.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parity.diff.engines import DumpError
from parity.diff.engines.dump import read_header
from parity.errors import InputError
from parity.schema import errors
from parity.schema import load as load_schema

from .numerics import finite_or_none
from .runner import RUN_VERDICTS, DiffResult

CORPUS_FORMAT = "kimi-parity/diff-corpus"
CORPUS_VERSION = 1
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PROMPT_KEYS = ("text", "ids")


@dataclass(frozen=True)
class Prompt:
    index: int              # 0-based, in the corpus file's order (empty lines not counted)
    line: int               # 1-based line of the file
    ids: tuple[int, ...]
    text: str | None        # None: given as ids
    source: str | None = None  # a folder of dumps: the dump's file name


# ---------------------------------------------------------------------------------------------
# reading a corpus


def read_prompts(path: str | Path, *, vocab: int, encode=None) -> list[Prompt]:
    """The prompts of ``path`` (module docstring for the formats). ``encode(text) -> ids`` is the
    checkpoint's tokenizer (None: only ``ids`` prompts are usable). Unusable input raises
    ``InputError`` with one line naming the file and line."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--prompts {path}: cannot read it: {type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    jsonl = path.suffix.lower() in JSONL_SUFFIXES
    out: list[Prompt] = []
    # lines end at "\n" only (str.splitlines would also split at U+2028 and other separators a
    # prompt or a JSON string may hold); a CRLF file's "\r" is not part of its prompts
    for n, line in enumerate(raw.split("\n"), start=1):
        line = line[:-1] if line.endswith("\r") else line
        if not line.strip() if jsonl else line == "":
            continue
        text, ids = _parse_jsonl(path, n, line) if jsonl else (line, None)
        if ids is None:
            if encode is None:
                raise InputError(f"--prompts {path}: line {n}: a text prompt needs a tokenizer; give ids")
            ids = [int(t) for t in encode(text)]
        if not ids:
            raise InputError(f"--prompts {path}: line {n}: the prompt has no tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"--prompts {path}: line {n}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        out.append(Prompt(index=len(out), line=n, ids=tuple(ids), text=text))
    if not out:
        raise InputError(f"--prompts {path}: no prompts in it (one a line"
                         + (", as JSON objects with text or ids)" if jsonl else ")"))
    return out


def _parse_jsonl(path: Path, n: int, line: str) -> tuple[str | None, list[int] | None]:
    where = f"--prompts {path}: line {n}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected an object with text or ids, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in PROMPT_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r} (expected text or ids)")
    if len(obj) != 1:
        raise InputError(f"{where}: expected exactly one of text or ids")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise InputError(f"{where}: text must be a string")
        return obj["text"], None
    ids = obj["ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(f"{where}: ids must be a list of integers")
    return None, ids


def read_dumps(directory: str | Path, *, steps: int | None, mode: str | None,
               dtype: str | None) -> tuple[list[Prompt], dict]:
    """A folder of dumps (``*.safetensors``, by name), one prompt each, read from their headers
    only. Returns the prompts and what the dumps share (``steps``: ``steps`` or the dumps' own,
    ``mode``, ``dtype``); dumps that differ in mode or dtype, or in steps without ``steps``, are
    refused."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(f"--engine dump:{directory}: no dump (*.safetensors) in the folder")
    prompts, heads = [], []
    for k, f in enumerate(files):
        try:
            head = read_header(f)
        except DumpError as exc:
            raise InputError(" ".join(str(exc).split())) from None
        heads.append(head)
        prompts.append(Prompt(index=k, line=k + 1, ids=tuple(int(t) for t in head["prompt_ids"]), text=None,
                              source=f.name))
    for key in ("mode", "dtype") + (() if steps is not None else ("steps",)):
        i = next((i for i, h in enumerate(heads) if h[key] != heads[0][key]), None)
        if i is not None:
            raise InputError(f"--engine dump:{directory}: {files[i].name} ran {key} {heads[i][key]}, "
                             f"{files[0].name} {heads[0][key]}"
                             + ("; give --steps N" if key == "steps" else ": diff them apart"))
    short = min(heads, key=lambda h: h["steps"])
    if steps is not None and steps > short["steps"]:
        raise InputError(f"--steps {steps}: {files[heads.index(short)].name} holds {short['steps']} steps")
    if mode is not None and mode != heads[0]["mode"]:
        raise InputError(f"--mode {mode}: the dumps in {directory} are {heads[0]['mode']}-mode dumps")
    if dtype is not None and dtype != heads[0]["dtype"]:
        raise InputError(f"--dtype {dtype}: the dumps in {directory} ran {heads[0]['dtype']}")
    return prompts, {"steps": steps or heads[0]["steps"], "mode": heads[0]["mode"], "dtype": heads[0]["dtype"]}


def corpus_digest(prompts: list[Prompt]) -> str:
    """What makes two shard reports parts of one corpus: the token ids of every prompt, in order (and
    for a folder of dumps each dump's file name)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.source, list(p.ids)] if p.source is not None else list(p.ids)).encode() + b"\n")
    return h.hexdigest()


def shard_of(prompts: list[Prompt], shard: tuple[int, int] | None) -> list[Prompt]:
    """Prompt ``k`` (0-based) belongs to shard ``k % n + 1``."""
    if shard is None:
        return list(prompts)
    i, n = shard
    return [p for p in prompts if p.index % n + 1 == i]


# ---------------------------------------------------------------------------------------------
# per-prompt results


@dataclass
class PromptResult:
    """One prompt's run, as the corpus report keeps it (every step's record, as a single-prompt
    report writes it; the numbers the corpus aggregates)."""
    index: int
    line: int
    text: str | None
    ids: list[int]
    verdict: str                       # the run's verdict (``RUN_VERDICTS``)
    summary: dict                      # ``DiffResult.summary()``
    steps: list[dict]                  # ``StepRecord.to_dict()`` of every step
    localization: str | None           # the run's localization line (``Localization.describe``)
    first_diverged: int | None         # the first diverged step
    units: dict[str, list]             # op name -> [op, level units, spike units], final localization
    source: str | None = None          # a folder of dumps: the dump's file name

    @classmethod
    def of(cls, prompt: Prompt, result: DiffResult) -> "PromptResult":
        loc = result.localization
        bad = next((s.step for s in result.steps if s.verdict == "diverged"), None)
        units = {}
        if result.final is not None:
            units = {e.name: [e.op, finite_or_none(e.units), finite_or_none(e.spike_units)]
                     for e in result.final.entries}
        summary = result.summary()
        return cls(index=prompt.index, line=prompt.line, text=prompt.text, ids=list(prompt.ids),
                   verdict=result.verdict, summary=summary, steps=[s.to_dict() for s in result.steps],
                   localization=loc.describe() if loc is not None else None, first_diverged=bad,
                   units=units, source=prompt.source)

    def to_dict(self) -> dict:
        return {"index": self.index, "line": self.line, "source": self.source, "text": self.text, "ids": self.ids,
                "verdict": self.verdict, "first_diverged": self.first_diverged,
                "localization": self.localization, "summary": self.summary, "units": self.units,
                "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict) -> "PromptResult":
        return cls(index=d["index"], line=d["line"], text=d["text"], ids=list(d["ids"]), verdict=d["verdict"],
                   summary=d["summary"], steps=d["steps"], localization=d["localization"],
                   first_diverged=d["first_diverged"], units=d["units"], source=d.get("source"))

    @property
    def positions(self) -> int:
        """Sequence positions the run judged: the prompt's (step 0) and one per later step."""
        return len(self.ids) + len(self.steps) - 1


# ---------------------------------------------------------------------------------------------
# the corpus


@dataclass(frozen=True)
class Stats:
    min: float | None
    median: float | None
    p99: float | None
    max: float | None
    count: int

    @classmethod
    def of(cls, values) -> "Stats":
        a = np.array([v for v in values if v is not None], dtype=np.float64)
        if a.size == 0:
            return cls(None, None, None, None, 0)
        return cls(float(a.min()), float(np.median(a)), float(np.percentile(a, 99)), float(a.max()), int(a.size))

    def to_dict(self) -> dict:
        return {"min": self.min, "median": self.median, "p99": self.p99, "max": self.max, "count": self.count}


@dataclass
class CorpusResult:
    """The corpus report: identity (``corpus``, ``settings``), the per-prompt results of this
    report's share, and the aggregates over them (properties)."""
    corpus: dict                       # {"file", "size", "digest"}: the whole corpus, not the shard
    shard: tuple[int, int] | None      # (i, n) of a shard report; None: every prompt
    settings: dict                     # what must agree for shards to merge
    environment: dict
    prompts: list[PromptResult] = field(default_factory=list)
    seconds: float | None = None

    @property
    def verdict(self) -> str:
        """The worst prompt's verdict (``match`` < ``near-tie`` < ``past-bound`` < ``diverged``)."""
        order = ("match", "near-tie", "past-bound", "diverged")
        return max((p.verdict for p in self.prompts), key=order.index, default="match")

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict in ("diverged", "past-bound") else 0

    @property
    def steps(self) -> list[dict]:
        return [s for p in self.prompts for s in p.steps]

    def diverged(self) -> list[dict]:
        """Prompts with a diverged step, each with its first bad step and its localization."""
        return [{"index": p.index, "line": p.line, "source": p.source, "first_step": p.first_diverged,
                 "localization": p.localization}
                for p in self.prompts if p.first_diverged is not None]

    def past_bound(self) -> list[dict]:
        """Prompts no step of which diverged but whose numbers are past their bound."""
        return [{"index": p.index, "line": p.line, "source": p.source, "past_bound": p.summary["past_bound"]}
                for p in self.prompts if p.verdict == "past-bound"]

    def ranked(self) -> list[PromptResult]:
        """Prompts in the order worth reading: diverged first, then past-bound, near-tie, match."""
        order = ("diverged", "past-bound", "near-tie", "match")
        return sorted(self.prompts, key=lambda p: (order.index(p.verdict), p.index))

    def op_units(self) -> dict[str, dict]:
        """Per op (``layers.2.mixer``, ...): its error in units of its bound over the prompts (the
        level: median over positions; the worst single position)."""
        names = list(dict.fromkeys(n for p in self.prompts for n in p.units))
        out = {}
        for name in names:
            rows = [p.units[name] for p in self.prompts if name in p.units]
            out[name] = {"op": rows[0][0], "units": Stats.of(r[1] for r in rows).to_dict(),
                         "spike_units": Stats.of(r[2] for r in rows).to_dict()}
        return out

    def near_ties(self) -> dict:
        steps = self.steps
        ties = sum(s["verdict"] == "near-tie" for s in steps)
        flipped = sum(s["ref_token"] != s["opt_token"] for s in steps)
        return {"near_ties": ties, "flipped_steps": flipped, "steps": len(steps),
                "per_flipped_step": ties / flipped if flipped else None,
                "per_step": ties / len(steps) if steps else None}

    def router_flips(self) -> dict:
        flips = [f for s in self.steps for f in s["router"]]
        noise = sum(bool(f["within_noise"]) for f in flips)
        positions = sum(p.positions for p in self.prompts)
        return {"flips": len(flips), "within_noise": noise, "past_bound": len(flips) - noise,
                "positions": positions, "per_position": len(flips) / positions if positions else None}

    def kl(self) -> dict:
        """llama.cpp's numbers: KL(reference || engine) over every step (nats; steps with
        non-finite logits counted apart), and top-1 agreement."""
        steps = self.steps
        kl = np.array([s["kl"] for s in steps if s["kl"] is not None], dtype=np.float64)
        agree = sum(s["ref_token"] == s["opt_token"] for s in steps)
        return {"mean": float(kl.mean()) if kl.size else None,
                "p99": float(np.percentile(kl, 99)) if kl.size else None,
                "max": float(kl.max()) if kl.size else None,
                "nonfinite_steps": len(steps) - int(kl.size),
                "top1_agreement": agree / len(steps) if steps else None}

    def summary(self) -> dict:
        verdicts = {v: sum(p.verdict == v for p in self.prompts) for v in RUN_VERDICTS}
        return {"prompts": len(self.prompts), "verdict": self.verdict, "verdicts": verdicts,
                "steps": len(self.steps), "diverged": self.diverged(), "past_bound": self.past_bound(),
                "op_units": self.op_units(), "near_ties": self.near_ties(), "router_flips": self.router_flips(),
                "kl": self.kl(), "line": self.line()}

    def line(self) -> str:
        """``8 prompts, 32 steps: 6 match, 0 near-tie, 0 past-bound, 2 diverged (prompts 2, 5); KL
        mean 0.0012, p99 0.02; top-1 agreement 0.97``."""
        v = {k: sum(p.verdict == k for p in self.prompts) for k in RUN_VERDICTS}
        bad = [str(p.index) for p in self.prompts if p.verdict in ("diverged", "past-bound")]
        kl = self.kl()
        text = (f"{len(self.prompts)} prompts, {len(self.steps)} steps: " + ", ".join(f"{v[k]} {k}" for k in
                ("match", "near-tie", "past-bound", "diverged")))
        if bad:
            text += f" (not clean: prompt{'s' if len(bad) > 1 else ''} {', '.join(bad[:10])}" \
                    + (", ..." if len(bad) > 10 else "") + ")"
        text += f"; KL mean {fmt(kl['mean'])}, p99 {fmt(kl['p99'])}; top-1 agreement {fmt(kl['top1_agreement'])}"
        return text

    def to_dict(self) -> dict:
        return {"format": CORPUS_FORMAT, "version": CORPUS_VERSION, "corpus": self.corpus,
                "shard": None if self.shard is None else {"index": self.shard[0], "count": self.shard[1]},
                "settings": self.settings, "environment": self.environment, "seconds": self.seconds,
                "summary": self.summary(), "prompts": [p.to_dict() for p in self.prompts]}

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusResult":
        shard = d["shard"]
        return cls(corpus=d["corpus"], shard=None if shard is None else (shard["index"], shard["count"]),
                   settings=d["settings"], environment=d["environment"], seconds=d.get("seconds"),
                   prompts=[PromptResult.from_dict(p) for p in d["prompts"]])


def fmt(x) -> str:
    """A number of the report in 3 digits, ``-`` for null."""
    return "-" if x is None else f"{x:.3g}"


# ---------------------------------------------------------------------------------------------
# merging shards


def merge(parts: list[tuple[str, CorpusResult]]) -> CorpusResult:
    """The shard reports ``[(name, result)]`` combined into the unsharded corpus report. Refused
    (``InputError``, one line) for reports of different corpora or settings, an unsharded report,
    and missing or repeated shards."""
    if not parts:
        raise InputError("merge: give the shard reports (parity diff merge r1.json r2.json --json out.json)")
    name0, first = parts[0]
    seen: dict[int, str] = {}
    for name, r in parts:
        if r.shard is None:
            raise InputError(f"merge: {name} is not a shard report (it was run without --shard)")
        if r.corpus["digest"] != first.corpus["digest"] or r.corpus["size"] != first.corpus["size"]:
            raise InputError(f"merge: {name} is a shard of another corpus than {name0}")
        diff = [k for k in sorted(set(r.settings) | set(first.settings)) if r.settings.get(k) != first.settings.get(k)]
        if diff:
            raise InputError(f"merge: {name} ran other settings than {name0}: {diff[0]} differs")
        if r.shard[1] != first.shard[1]:
            raise InputError(f"merge: {name} is shard {r.shard[0]}/{r.shard[1]}, {name0} one of {first.shard[1]}")
        if r.shard[0] in seen:
            raise InputError(f"merge: shard {r.shard[0]}/{r.shard[1]} given twice ({seen[r.shard[0]]}, {name})")
        seen[r.shard[0]] = name
        want = [k for k in range(r.corpus["size"]) if k % r.shard[1] + 1 == r.shard[0]]
        if [p.index for p in r.prompts] != want:
            raise InputError(f"merge: {name}: its prompts are not those of shard {r.shard[0]}/{r.shard[1]}")
    n = first.shard[1]
    missing = [i for i in range(1, n + 1) if i not in seen]
    if missing:
        raise InputError(f"merge: shard {missing[0]}/{n} is missing" + (f" (and {len(missing) - 1} more)"
                                                                          if len(missing) > 1 else ""))
    prompts = sorted((p for _, r in parts for p in r.prompts), key=lambda p: p.index)
    seconds = [r.seconds for _, r in parts]
    return CorpusResult(corpus=first.corpus, shard=None, settings=first.settings, environment=first.environment,
                        prompts=prompts, seconds=max(seconds) if None not in seconds else None)


def load(path: str | Path) -> CorpusResult:
    """A corpus report written by ``--prompts ... --json`` (``InputError`` for anything else)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"merge: {path}: cannot read it: {type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(d, dict) or d.get("format") != CORPUS_FORMAT:
        raise InputError(f"merge: {path}: not a corpus report (format {CORPUS_FORMAT!r})")
    if d.get("version") != CORPUS_VERSION:
        raise InputError(f"merge: {path}: corpus report version {d.get('version')!r}, this parity reads "
                         f"{CORPUS_VERSION}")
    errs = errors(d, corpus_schema())
    if errs:
        raise InputError(f"merge: {path}: not a valid corpus report: {errs[0]}")
    return CorpusResult.from_dict(d)


def corpus_schema() -> dict:
    """parity/schemas/diff-corpus.schema.json (its steps are the single-prompt report's,
    docs/diff-report-schema.json)."""
    return load_schema("diff-corpus")
