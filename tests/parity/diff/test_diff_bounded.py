"""``parity diff`` on a checkpoint of the bounded KDA gate (fixtures/bounded: preset tiny-bounded,
``linear_attn_config.gate_lower_bound = -5``), end to end on the CPU (the optimized model's Triton
kernels under the interpreter): both paths read the gate from the config and agree; an engine that
runs the softplus gate on it (the Kimi-Linear path on a Kimi-K3 checkpoint) diverges, localized to
the first KDA layer. About 25 s on 2 cores."""
import json
from pathlib import Path

from ..diff_helpers import run_cli
from .test_diff_cli import check_consistent

BOUNDED = str(Path(__file__).resolve().parents[3] / "fixtures" / "bounded")


def test_a_bounded_gate_checkpoint_diffs_clean_end_to_end(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", BOUNDED, "--steps", "4", "--json", str(path))
    assert rc == 0, out + err
    report = json.loads(path.read_text())
    check_consistent(report)
    assert report["summary"]["diverged"] == 0
    for side in ("reference", "optimized"):
        assert report["variants"][side]["kda_gate"] == "lower_bound:-5"


def test_the_softplus_gate_on_a_bounded_checkpoint_diverges(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", BOUNDED, "--engine", "tests.parity.diff.engines_planted:softplus_on_bounded",
                           "--steps", "2", "--json", str(path))
    assert rc == 1, out + err
    report = json.loads(path.read_text())
    assert report["summary"]["diverged"] >= 1
    assert report["variants"]["optimized"]["kda_gate"] == "softplus"
    assert report["variants"]["reference"]["kda_gate"] == "lower_bound:-5"
    loc = report["localization"]
    assert loc and "layers.0." in json.dumps(loc), loc


def test_the_gate_variant_is_checked_and_reported(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "diff", BOUNDED, "--variant", "kda_gate=lower_bound:0.5", "--steps", "1")
    assert rc == 2 and "--variant kda_gate=lower_bound:0.5: expected softplus or lower_bound:<b>" in err, err
