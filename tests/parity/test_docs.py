"""The docs tables are generated from the registry and in sync with it."""
from parity import docs


def test_the_registry_tables_in_the_docs_are_current():
    for name in ("error-bounds.md", "certificates.md"):
        text = (docs.DOCS / name).read_text()
        assert docs.render(text) == text, f"docs/{name} is stale: run python -m parity.docs"
    text = (docs.DOCS / "error-bounds.md").read_text()
    assert "<!-- registry:bounds -->" in text and "<!-- registry:mutants -->" in text


def test_a_planted_bug_in_the_certificates_example_fails_with_the_mutant_the_page_names(tmp_path, monkeypatch,
                                                                                      parity_device):
    """docs/certificates.md's adapter (``my_chunk_kda.py``; the page's example itself runs in
    test_docs_examples.py) with the bug the page plants: the certificate names its nearest mutant."""
    import pytest

    from . import doc_blocks

    pytest.importorskip("fla", reason="fla-core is not installed (pip install 'kimi-parity[peers]')")
    adapter = doc_blocks.files()["my_chunk_kda.py"].text
    assert "state_stored_transposed" in (docs.DOCS / "certificates.md").read_text()
    bug = adapter.replace("    return o[:, :T], state",
                          "    return o[:, :T], state.transpose(-1, -2).contiguous().view(state.shape)")
    assert bug != adapter
    (tmp_path / "my_buggy_kda.py").write_text(bug)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_buggy_kda

    from parity.testing import assert_certified

    with pytest.raises(AssertionError, match="nearest known bug: state_stored_transposed"):
        assert_certified("kda.chunked", my_buggy_kda.chunk_kda, dtypes=("float32",), examples=1, device=parity_device)
