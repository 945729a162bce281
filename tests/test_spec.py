"""docs/spec.md is the model spec the code cites: every citation ("spec b.9", "spec §(c)",
"spec b.13 / e.1", "§b.4", ranges "b.2-b.4") names a heading of it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec.md"
SOURCES = ("kimi", "reference", "optimized", "parity", "tests", "benchmarks", "docs")

LABEL = r"(?:\([a-f]\)|[a-f]\.\d+)"
# "spec" then a list of labels joined by , / - – "and"; or a label right after "§"
CITATION = re.compile(rf"\bspec\s+((?:§\s*)?{LABEL}(?:\s*(?:,|/|-|–|and)\s*(?:§\s*)?{LABEL})*)"
                      rf"|§\s*({LABEL})", re.IGNORECASE)
HEADING = re.compile(rf"^#+\s+({LABEL})\s", re.MULTILINE)


def headings(text: str) -> set:
    """The section labels of the spec's headings: ``(a)``, ``b.9``, ``e.1``."""
    return set(HEADING.findall(text))


def cited(text: str) -> set:
    """The labels ``text`` cites, a range ``b.2-b.4`` expanded to every section in it."""
    out = set()
    for listed, single in CITATION.findall(text):
        body = listed or single
        for lo, hi in re.findall(rf"({LABEL})\s*[-–]\s*({LABEL})", body):
            if lo[0] == hi[0] != "(":
                out |= {f"{lo[0]}.{n}" for n in range(int(lo[2:]), int(hi[2:]) + 1)}
        out |= set(re.findall(LABEL, body))
    return out


def citations() -> dict:
    """``{label: first file:line citing it}`` over the repository's code and docs."""
    found = {}
    paths = [ROOT / "README.md"] + [p for d in SOURCES for p in sorted((ROOT / d).rglob("*"))
                                    if p.suffix in (".py", ".md", ".sh")]
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for label in cited(line):
                found.setdefault(label, f"{path.relative_to(ROOT)}:{n}")
    return found


def test_every_spec_citation_in_code_and_docs_names_a_heading_of_docs_spec_md():
    found = citations()
    assert {"b.9", "(c)", "(e)", "e.1"} <= set(found)  # the scan sees the code's citations
    missing = {label: where for label, where in found.items() if label not in headings(SPEC.read_text())}
    assert not missing, f"cited but not a heading of docs/spec.md: {missing}"


def test_the_citation_parser_reads_lists_ranges_and_section_signs():
    assert cited("(spec b.10-b.17), built") == {f"b.{n}" for n in range(10, 18)}
    assert cited("see spec b.13 / e.1 and spec §(c); §b.4 too") == {"b.13", "e.1", "(c)", "b.4"}
    assert cited("spec b.11/b.12 and spec b.13, b.14") == {"b.11", "b.12", "b.13", "b.14"}
    assert cited("the spec's authors, specification b.4, a.b.1") == set()
    assert headings("## (a) Config\n### b.9 KDA chunked\n#### not b.1\n### e.1 MoE\n") == {"(a)", "b.9", "e.1"}
    assert "b.99" not in headings(SPEC.read_text())
