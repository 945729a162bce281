"""Report files are written atomically, and the documented schema is one the validator reads."""
import json

import pytest

from parity.diff.report import atomic_write
from schema_check import load_schema, validate


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


def test_the_validator_rejects_what_the_schema_forbids():
    schema = load_schema("diff-report-schema.json")
    assert validate({}, schema)  # everything missing
    step = {"step": 0, "ref_token": 1, "opt_token": 1, "verdict": "maybe", "max_abs_diff": 0.1,
            "kl": None, "ref_margin": 0.5, "bound": 0.01, "router": []}
    errors = validate(step, schema["$defs"]["step"], schema)
    assert errors == ["$.verdict: 'maybe' not one of ['match', 'near-tie', 'diverged']"]
    json.dumps(schema)
