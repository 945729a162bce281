"""The report of judged recorded calls (``parity judge``): the printed report (the first
bad call at the top, a row per call, the per-op summary) and the certificate document
(parity/schemas/certificate.schema.json with its ``calls`` object)."""
from __future__ import annotations

import math
import os

from rich.table import Table

from parity.certify.report import certificate as doc
from parity.certify.report import render_summary

SHOWN = 40          # rows of the per-call table: every bad call, then the first clean ones


def _r(x) -> str:
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.3g}")


def _site(site: str) -> str:
    path, _, rest = site.partition(":")
    return f"{os.path.basename(path)}:{rest}"


def headline(v) -> str:
    """One line: the first bad call, or that every judged call is clean."""
    fb = v.first_bad
    judged = sum(c.ratio is not None for c in v.calls)
    if fb is None:
        if not v.file.calls and v.never_called:
            return f"no call judged: no watched target was called ({len(v.never_called)} never called, below)"
        if not judged:
            return f"no call judged: {len(v.calls)} call(s), none kept with its tensors"
        return f"every judged call is clean: {judged} of {len(v.calls)} call(s) judged"
    e = fb.entry
    line = f"first bad call: {e['id']} ({e['op'] or e['target']}) at step {e['step']}, {_site(e['call_site'])}: "
    line += fb.summary
    if fb.nearest_bug:
        line += f"; nearest known bug: {fb.nearest_bug['mutant']} (similarity {fb.nearest_bug['similarity']:.2f})"
    return line


def render(console, v) -> None:
    style = "green" if v.first_bad is None else "red"
    console.print(f"[{style}]{headline(v)}[/]", highlight=False, soft_wrap=True)
    for t in v.never_called:
        console.print(f"  [yellow]never called[/]: {t['target']} ({t['watched']}): {t['why']}", highlight=False,
                      soft_wrap=True)
    bad = [c for c in v.calls if c.verdict != "clean"]
    rows = bad[:SHOWN] + [c for c in v.calls if c.verdict == "clean"][:max(0, SHOWN - len(bad))]
    rows.sort(key=lambda c: v.calls.index(c))
    t = Table(title=f"calls ({len(rows)} of {len(v.calls)} shown)", title_justify="left")
    for col in ("call", "step", "op", "call site", "dtype", "worst x bound", "verdict", "nearest bug"):
        t.add_column(col, justify="right" if col in ("step", "worst x bound") else "left")
    for c in rows:
        e = c.entry
        colour = {"clean": "green", "not kept": "yellow"}.get(c.verdict, "red")
        bug = f"{c.nearest_bug['mutant']} ({c.nearest_bug['similarity']:.2f})" if c.nearest_bug else "-"
        t.add_row(e["id"], str(e["step"]), e["op"] or "-", _site(e["call_site"]).split(" (")[0], c.dtype or "-", _r(c.ratio),
                  f"[{colour}]{c.verdict}[/]", bug)
    console.print(t)
    for d in v.file.header.get("dropped", []):
        console.print(f"  not kept: {d['calls']} call(s) of {d['op']}: {d['reason']}", highlight=False)
    for c in v.calls:
        if c.verdict == "unmapped":
            console.print(f"  [red]x[/] {c.entry['id']} {c.entry['target']}: {c.summary}", highlight=False)
            break
    if v.certs:
        render_summary(console, v.certs, v.seconds)


def certificate(v, argv=None) -> dict:
    dtypes = sorted({d for c in v.certs for d in c.runs})
    judged = sum(c.ratio is not None for c in v.calls)
    out = doc(v.certs, device="cpu", dtypes=dtypes, candidate="recorded", examples=judged, seconds=v.seconds,
              argv=argv, impls={c.op: c.candidate for c in v.certs})
    out["calls"] = v.calls_entry()
    out.pop("summary")
    out["summary"] = {"ops": len(v.certs), "certified": sum(c.certified for c in v.certs),
                      "verdict": "certified" if v.certified else "not certified"}
    return out
