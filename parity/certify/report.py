"""Rendering certificates: the rich tables of ``parity certify`` and the JSON document
(docs/certificates.md; schema parity/schemas/certificate.schema.json)."""
from __future__ import annotations

import datetime as _dt
import json
import math

from rich.markup import escape as rich_escape
from rich.table import Table

from parity.atomic import atomic_write

from ..environment import environment
from ..strategies import profile_name
from .fingerprint import THRESHOLD

SCHEMA_ID = "kimi-parity/certificate"
SCHEMA_VERSION = 1


def _r(x) -> str:
    if x is None:
        return "-"
    return "inf" if not math.isfinite(x) else f"{x:.3g}"


def render_op(console, cert) -> None:
    style = "green" if cert.certified else "red"
    k, n = cert.mutants_killed()
    t = Table(title=f"{cert.op}  [{style}]{cert.verdict}[/]  ({escape(cert.label)})", title_justify="left")
    for col in ("dtype", "strength", "shapes", "inputs", "worst x bound", "kernel ran", "bytes",
                "mutants killed", "weakest teeth", "verdict"):
        t.add_column(col, justify="right" if col in ("inputs", "worst x bound", "weakest teeth") else "left")
    for d, r in cert.runs.items():
        killed = sum(m.killed for m in r.mutants.values())
        weakest = min((m.teeth for m in r.mutants.values()), default=math.inf)
        labels = {c.label for c in r.cases}
        ok = r.passed and all(m.killed for m in r.mutants.values()) and all(r.controls.values())
        b = r.bytes_ok()
        t.add_row(d, r.strength, str(len(labels)),
                  str(len(r.cases)), _r(r.worst_ratio),
                  "-" if r.kernel_ran is None else ("yes" if r.kernel_ran else "[red]no[/]"),
                  "-" if b is None else ("yes" if b else "[red]no[/]"),
                  f"{killed}/{len(r.mutants)}", _r(weakest), "[green]ok[/]" if ok else "[red]fail[/]")
    console.print(t)
    teeth = cert.teeth()
    console.print("  teeth (mutant error / bound): " + ", ".join(f"{m} {_r(v)}" for m, v in teeth.items())
                  + f"  [{k}/{n} killed]")
    console.print("  shapes: " + "; ".join(cert.shapes()))
    if cert.implementation:
        console.print(f"  implementation: {_who(cert.implementation)}", markup=False)
    console.print(f"  contract: {cert.contract_summary()}", markup=False)
    for f in cert.faults():
        console.print(f"  fault at {f['dtype']} on {f['label']} ({_shapes(f['shapes'])}): {f['error']}", markup=False)
    for f in cert.nondeterminism():
        console.print(f"  nondeterministic at {f['dtype']} on {f['label']}: {f['detail']}", markup=False)
    dirty = sorted({c.dirty for r in cert.runs.values() for c in r.cases if c.dirty})
    if dirty:
        bad = [f"{d} {c.label}" for d, r in cert.runs.items() for c in r.cases if c.dirty and not c.passed]
        console.print(f"  dirty memory ({', '.join(dirty)}): " + ("held" if not bad else "FAILED on " + "; ".join(bad)),
                      markup=False)
    if cert.error:
        console.print(f"  [red]x[/] {escape(cert.error)}")
    for d, r in cert.runs.items():
        if r.unsupported:
            console.print(f"  {d}: skipped, unsupported by the implementation: "
                          + "; ".join(f"{why} ({n})" for why, n in r.unsupported.items()), markup=False)
    if not cert.certified:
        bug, scores = cert.nearest_bug()
        if bug:
            tie = f"; as near: {', '.join(bug['ties'])}" if bug["ties"] else ""
            console.print(f"  nearest known bug: [bold]{bug['mutant']}[/] (similarity {bug['similarity']:.2f}{tie})")
        elif scores:
            best = max(scores, key=scores.get)
            console.print(f"  nearest known bug: none (best {best} at {scores[best]:.2f}, below "
                          f"{_threshold():.2f})", markup=False)
    replayed = cert.replayed()
    if replayed:
        console.print("  replayed: " + "; ".join(
            f"{e['case']} {e['kind']} ({e['call_site']}) {_r(e['ratio'])} x bound{'' if e['passed'] else ' [red]FAILED[/]'}"
            for e in replayed), highlight=False)
    for why in cert.reasons()[:6]:
        console.print(f"  [red]x[/] {why}", markup=True, highlight=False)
    if cert.certified:
        console.print(f"  reached: {', '.join(cert.reached())}")


def render_summary(console, certs, seconds: float) -> None:
    t = Table(title="summary", title_justify="left")
    for col in ("op", "candidate", "contract", "reached", "worst x bound", "mutants", "nearest bug", "verdict"):
        t.add_column(col)
    for c in certs:
        k, n = c.mutants_killed()
        worst = max((r.worst_ratio for r in c.runs.values()), default=math.inf)
        bug = None if c.certified else c.nearest_bug()[0]
        t.add_row(c.op, escape(c.label), c.contract, ", ".join(c.reached()) or "-", _r(worst), f"{k}/{n}",
                  f"{bug['mutant']} ({bug['similarity']:.2f})" if bug else "-",
                  "[green]certified[/]" if c.certified else "[red]not certified[/]")
    console.print(t)
    ok = sum(c.certified for c in certs)
    console.print(f"{ok}/{len(certs)} op(s) certified in {seconds:.1f} s")


def escape(text: str) -> str:
    return rich_escape(text)


def _shapes(shapes: dict) -> str:
    return ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())


def _who(impl: dict) -> str:
    pkg = f"{impl['package']} {impl['version']}" if impl.get("package") else "no installed package"
    git = impl.get("git") or {}
    rev = f", git {git['revision'][:12]}{' (dirty)' if git.get('dirty') else ''}" if git.get("revision") else ""
    ad = impl.get("adapter")
    via = f" via {ad['module']}:{ad['function']}" if ad else ""
    return f"{impl['module']}:{impl['function']} ({pkg}{rev}){via}"


def _threshold() -> float:
    return THRESHOLD


def certificate(certs, *, device, dtypes, candidate, examples, seconds, argv=None, contract=None,
                impls=None, cases=None, workers: int = 0, shard: dict | None = None,
                variants: dict | None = None) -> dict:
    """The certificate document; ``cases``: the ``cases`` entry of a ``--cases`` run (file, sha256,
    replayed, skipped); ``workers``: the worker processes the candidates ran in (0: certify's own);
    ``shard``: ``{"index", "count", "ops", "units"}`` of a ``--shard`` run; ``variants``: the
    ``--variant`` values (``kda_gate``)."""
    env = environment(device)
    if device == "cpu":
        env["torch_threads"] = 1   # certify.cpu_threads: what the run used
    return {
        "schema": SCHEMA_ID, "version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": argv, "candidate": candidate, "contract": contract, "impls": dict(impls or {}),
        "device": device, "dtypes": list(dtypes),
        "examples": examples, "hypothesis_profile": profile_name(), "seconds": round(seconds, 3),
        "environment": env,
        "workers": workers,
        "ops": [c.to_dict() for c in certs],
        **({"cases": cases} if cases is not None else {}),
        **({"shard": shard} if shard is not None else {}),
        **({"variants": dict(variants)} if variants else {}),
        "summary": _summary(certs),
    }


def _summary(certs) -> dict:
    ok = sum(c.certified for c in certs)
    return {"ops": len(certs), "certified": ok, "verdict": "certified" if certs and ok == len(certs) else "not certified",
            "faults": sum(len(c.faults()) for c in certs),
            "nondeterministic": sum(bool(c.nondeterminism()) for c in certs)}


def merged(docs, certs, argv=None) -> dict:
    """The certificate of a sharded run from its shards' documents ``docs`` and the merged op
    certificates ``certs`` (parity.certify.merge): the first shard's header (environment, command
    line options), the shards' seconds added up, ``merged`` naming how many shards it came from."""
    first = docs[0]
    doc = {k: v for k, v in first.items() if k not in ("shard", "ops", "summary")}
    doc.update(created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               seconds=round(sum(d["seconds"] for d in docs), 3), merged={"shards": len(docs), "command": argv},
               command=first["command"], ops=[c.to_dict() for c in certs], summary=_summary(certs))
    return doc


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` atomically (strict JSON: non-finite numbers are refused)."""
    atomic_write(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
