"""The docs tables are generated from the registry and in sync with it."""
from parity import docs


def test_the_registry_tables_in_the_docs_are_current():
    for name in ("error-bounds.md", "certificates.md"):
        text = (docs.DOCS / name).read_text()
        assert docs.render(text) == text, f"docs/{name} is stale: run python -m parity.docs"
    text = (docs.DOCS / "error-bounds.md").read_text()
    assert "<!-- registry:bounds -->" in text and "<!-- registry:mutants -->" in text
