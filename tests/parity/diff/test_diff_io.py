"""Report files are written atomically; the documented report schema rejects what it should."""
import json
from pathlib import Path

import pytest

from parity.diff.report import atomic_write
from parity.schema import errors

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "diff-report-schema.json").read_text())


def test_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "r.json"
    atomic_write(path, "old")
    atomic_write(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    atomic_write(path, "old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(path, writer=boom)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_the_schema_rejects_a_step_with_an_unknown_verdict_or_missing_fields():
    assert errors({}, SCHEMA)
    step = {"step": 0, "ref_token": 1, "opt_token": 1, "verdict": "maybe", "max_abs_diff": 0.1,
            "kl": None, "ref_margin": 0.5, "bound": 0.01, "router": []}
    assert errors(step, dict(SCHEMA["$defs"]["step"], **{"$defs": SCHEMA["$defs"]})) == [
        "$.verdict: 'maybe' not one of ['match', 'near-tie', 'diverged']"]
    del step["router"]
    step["verdict"] = "match"
    assert "missing required property 'router'" in errors(step, dict(SCHEMA["$defs"]["step"], **{"$defs": SCHEMA["$defs"]}))[0]
