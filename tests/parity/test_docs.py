"""The docs tables are generated from the registry and in sync with it."""
from parity import docs


def test_the_registry_tables_in_the_docs_are_current():
    for name in ("error-bounds.md", "certificates.md"):
        text = (docs.DOCS / name).read_text()
        assert docs.render(text) == text, f"docs/{name} is stale: run python -m parity.docs"
    text = (docs.DOCS / "error-bounds.md").read_text()
    assert "<!-- registry:bounds -->" in text and "<!-- registry:mutants -->" in text


def _block(text: str, name: str) -> str:
    """The python code block between ``<!-- example:NAME -->`` and ``<!-- /example:NAME -->``."""
    part = text.split(f"<!-- example:{name} -->", 1)[1].split(f"<!-- /example:{name} -->", 1)[0]
    return part.split("```python", 1)[1].rsplit("```", 1)[0]


def test_certify_your_own_chunk_kda_runs_as_written(tmp_path, monkeypatch, parity_device):
    """docs/certificates.md's example: the adapter file and the check, as a user would run them;
    and the planted bug the page mentions fails with the mutant it names."""
    import pytest

    pytest.importorskip("fla", reason="fla-core is not installed (pip install 'kimi-parity[peers]')")
    text = (docs.DOCS / "certificates.md").read_text()
    adapter = _block(text, "chunk_kda")
    (tmp_path / "my_chunk_kda.py").write_text(adapter)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "my_chunk_kda", raising=False)
    scope = {}
    exec(compile(_block(text, "chunk_kda_check"), "certificates.md", "exec"), scope)
    assert scope["cert"].certified and scope["cert"].implementation["function"] == "naive_chunk_kda"

    from parity.testing import assert_certified

    bug = adapter.replace("    return o[:, :T], state",
                          "    return o[:, :T], state.transpose(-1, -2).contiguous().view(state.shape)")
    (tmp_path / "my_buggy_kda.py").write_text(bug)
    import my_buggy_kda

    with pytest.raises(AssertionError, match="nearest known bug: state_stored_transposed"):
        assert_certified("kda.chunked", my_buggy_kda.chunk_kda, dtypes=("float32",), examples=1, device=parity_device)
