"""Markdown tables generated from the registry, embedded in docs/error-bounds.md and
docs/certificates.md between ``<!-- registry:NAME -->`` markers (a test keeps them in sync):

    python -m parity.docs          # rewrite the tables in place
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from .ops import records
from .registry import describe

DOCS = Path(__file__).resolve().parent.parent / "docs"


def bounds_table() -> str:
    rows = ["| op | outputs | reductions | bound model (per element) |", "|---|---|---|---|"]
    for r in records():
        outs = ", ".join(o + (" (exact)" if o in r.exact else "") for o in r.outputs)
        rows.append(f"| `{r.name}` | {outs} | {r.reductions} | {r.bound_doc.replace('|', '&#124;')} |")
    return "\n".join(rows)


def mutants_table() -> str:
    rows = ["| op | reference | optimized | mutants (kind) | strengths | batch rows |", "|---|---|---|---|---|---|"]
    for r in records():
        ref, opt = describe(r.reference), describe(r.optimized)
        muts = "<br>".join(f"`{m.name}` ({m.kind}): {m.doc}" for m in r.mutants)
        batch = "yes" if r.batch else "run-to-run only"
        rows.append(f"| `{r.name}` | `{ref}` | `{opt}` | {muts} | {', '.join(r.strengths)} | {batch} |")
    return "\n".join(rows)


TABLES = {"bounds": bounds_table, "mutants": mutants_table}


def render(text: str) -> str:
    """``text`` with every ``<!-- registry:NAME -->...<!-- /registry:NAME -->`` block regenerated."""
    def sub(m):
        name = m.group(1)
        return f"<!-- registry:{name} -->\n{TABLES[name]()}\n<!-- /registry:{name} -->"

    return re.sub(r"<!-- registry:(\w+) -->.*?<!-- /registry:\1 -->", sub, text, flags=re.S)


def main() -> int:
    for name in ("error-bounds.md", "certificates.md"):
        p = DOCS / name
        if p.exists():
            p.write_text(render(p.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
