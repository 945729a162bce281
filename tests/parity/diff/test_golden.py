"""Golden files: ``parity golden record`` freezes the reference's answer, ``parity golden check``
holds the optimized path to it without running the reference (real CLI, bf16 on CPU)."""
import json
from pathlib import Path

import pytest

from parity.bounds.core import unit_roundoff
from parity.diff import golden

from ..diff_helpers import run_cli

COMMITTED = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "default.json"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 2-step golden of the bundled checkpoint with the built-in prompt."""
    import contextlib
    import io

    from parity.cli import main

    path = tmp_path_factory.mktemp("golden") / "g.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["golden", "record", "--out", str(path), "--steps", "2"]) == 0
    assert f"wrote {path}: 2 steps" in out.getvalue()
    return path


def test_a_recorded_golden_has_the_format_header_and_per_step_digests(recorded):
    g = golden.load(recorded)
    assert (g["format"], g["version"], g["dtype"], g["top_k"]) == ("kimi-parity/golden", 1, "float32", 16)
    assert g["checkpoint"] == {"kind": "bundled", "describe": "the bundled default checkpoint (fixtures/default)"}
    assert g["variants"] == {"moe_combine": "unbiased", "kv_norm_eps": 1e-6, "kda_gate": "softplus"} and g["weights_sha256"]
    for s in g["steps"]:
        assert s["token"] == s["top_ids"][0] and len(s["logits_sha256"]) == 64
        assert s["top_values"] == sorted(s["top_values"], reverse=True) and s["bound"] > 0


def test_recording_reproduces_the_committed_golden(recorded):
    """The committed golden's first steps: same tokens and top ids; the same reference logits bit for
    bit where the float64 arithmetic is the same (NumPy build, platform and CPU: the CPU picks its
    BLAS kernels and their order of sums), else within twice the float64 counterpart of the step's
    bound (the recorded bound scaled by u_float64 / u_dtype: each recording is within it of the
    exact logits)."""
    mine, committed = golden.load(recorded), golden.load(COMMITTED)
    assert committed["prompt"] == mine["prompt"] and committed["weights_sha256"] == mine["weights_sha256"]
    same_arithmetic = all(mine["environment"][k] == committed["environment"][k] for k in ("numpy", "platform", "device_name"))
    scale = unit_roundoff("float64") / unit_roundoff(committed["dtype"])
    for a, b in zip(mine["steps"], committed["steps"]):
        assert (a["token"], a["top_ids"]) == (b["token"], b["top_ids"])
        if same_arithmetic:
            assert (a["logits_sha256"], a["top_values"]) == (b["logits_sha256"], b["top_values"])
        else:
            worst = max(abs(x - y) for x, y in zip(a["top_values"], b["top_values"]))
            assert worst <= 2 * scale * b["bound"], (worst, b["bound"])


def test_the_optimized_path_passes_the_committed_golden_of_the_bundled_checkpoint(tmp_path, capsys):
    """(Its first steps are bit for bit the fresh recording's, test above.)"""
    rc, out, err = run_cli(capsys, "golden", "check", str(COMMITTED), "--steps", "3", "--json",
                           str(tmp_path / "c.json"))
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1].startswith("golden: ")
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["verdict"] in ("match", "near-tie") and len(report["steps"]) == 3


@pytest.mark.parametrize("tamper, reason", [
    (lambda s: s.update(token=s["top_ids"][5], top_ids=[s["top_ids"][5]] + s["top_ids"][1:5] + [s["top_ids"][0]]
                        + s["top_ids"][6:]), "!= golden"),
    (lambda s: s.update(top_values=[v + 0.5 for v in s["top_values"]]), "logits off by 0.5"),
])
def test_a_golden_the_optimized_path_does_not_reproduce_fails(recorded, tmp_path, capsys, tamper, reason):
    g = json.loads(recorded.read_text())
    tamper(g["steps"][0])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(g))
    rc, out, err = run_cli(capsys, "golden", "check", str(bad), "--steps", "1")
    assert rc == 1, out + err
    assert "step 0: diverged" in out and reason in out


def test_a_golden_of_another_version_or_other_weights_is_refused(recorded, tmp_path, capsys):
    g = json.loads(recorded.read_text())
    (tmp_path / "v2.json").write_text(json.dumps(dict(g, version=2)))
    rc, _, err = run_cli(capsys, "golden", "check", str(tmp_path / "v2.json"))
    assert rc == 2 and "golden format version 2; this tool reads 1" in err
    (tmp_path / "w.json").write_text(json.dumps(dict(g, weights_sha256="0" * 64)))
    rc, _, err = run_cli(capsys, "golden", "check", str(tmp_path / "w.json"))
    assert rc == 2 and "recorded on different weights" in err


def test_the_committed_golden_is_valid_and_its_bounds_sit_far_under_the_noise_ceiling():
    from kimi.config import KimiConfig
    from parity.diff.golden_schema import noise_ceiling

    g = golden.load(COMMITTED)
    config = KimiConfig.from_hub_dict(g["config"])
    tokens = len(g["prompt"]["ids"]) + len(g["steps"])
    worst = max(s["bound"] / noise_ceiling(config, g["dtype"], tokens, s["top_values"]) for s in g["steps"])
    # recorded bounds are 106-448 u * scale (the emulated twin's noise, x17 at fp32 for the arithmetic
    # inside the ops it does exactly: parity.diff.twin); the ceiling ~1,000
    assert 0 < worst < 0.5, worst


def test_the_noise_ceiling_grows_with_depth_reduction_length_and_unit_roundoff():
    from kimi.config import KimiConfig
    from parity.diff.golden_schema import noise_ceiling

    tiny, big = KimiConfig.from_name("tiny"), KimiConfig.from_name("kimi-linear-48b")
    values = [3.0, -1.0]
    assert noise_ceiling(tiny, "float32", 50, values) < noise_ceiling(tiny, "float32", 5000, values)
    assert noise_ceiling(tiny, "float32", 50, values) < noise_ceiling(big, "float32", 50, values)
    assert noise_ceiling(tiny, "float32", 50, values) < noise_ceiling(tiny, "bfloat16", 50, values)
    # bf16 noise through 4 layers of 128-long reductions can reach the logits' size, never beyond
    assert noise_ceiling(tiny, "bfloat16", 50, values) == 2 * 3.0
    assert noise_ceiling(tiny, "float32", 50, [0.01]) == noise_ceiling(tiny, "float32", 50, [1.0])


@pytest.mark.parametrize("bound, message", [
    (float("inf"), "not a JSON golden file (Infinity is not a JSON number)"),
    (1e300, "steps[0].bound: 1e+300 is more than float32 rounding noise can explain"),
    (1.0, "steps[0].bound: 1.0 is more than float32 rounding noise can explain"),
])
def test_a_golden_with_an_infinite_or_absurd_bound_is_refused_not_passed(tmp_path, bound, message):
    g = json.loads(COMMITTED.read_text())
    for s in g["steps"]:
        s["bound"] = bound
    (tmp_path / "g.json").write_text(json.dumps(g))
    with pytest.raises(golden.GoldenError) as e:
        golden.load(tmp_path / "g.json")
    assert message in str(e.value)
