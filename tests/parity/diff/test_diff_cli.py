"""``parity diff`` driven through the real CLI on the bundled checkpoint and a generator checkpoint
(bf16 on CPU under the Triton interpreter): the run completes, every step's verdict agrees with its
numbers, the counts add up, the JSON validates against docs/diff-report-schema.json and the PNG opens.

Cost on a 2-core CPU: ~1 min for the 32-step bundled run (the interpreter decodes ~1-3 s a step);
the 128-step run is the GPU job's (``parity_gpu``)."""
import json
from pathlib import Path

import matplotlib.image
import pytest
import torch

from ..diff_helpers import run_cli
from parity.schema import errors

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "diff-report-schema.json").read_text())


def check_consistent(report: dict) -> None:
    """Every step's verdict follows from its own numbers; the summary counts add up."""
    steps, summary = report["steps"], report["summary"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for s in steps:
        same = s["ref_token"] == s["opt_token"]
        assert (s["verdict"] == "match") == (same and s["cause"] != "nonfinite"), s
        # the twin runs only where the tokens differ: a match may carry no flip bound
        assert s["bound"] is None and same or s["bound"] >= 0, s
        if s["verdict"] == "near-tie":
            # within the logit noise, or a logit jump explained by a router flip in noise
            assert s["ref_margin"] <= s["bound"] or s["cause"] == "router", s
            assert s["cause"] != "op"
            if s["cause"] == "router":
                assert any(f["within_noise"] for f in s["router"]) or report["localization"], s
        if s["verdict"] == "diverged":
            assert s["cause"] in ("op", "nonfinite") or s["ref_margin"] > s["bound"], s
        for f in s["router"]:
            assert f["within_noise"] == (f["margin"] <= f["bound"])
            assert set(f["swapped_in"]).isdisjoint(f["swapped_out"])
    counts = {v: sum(s["verdict"] == v for s in steps) for v in ("match", "near-tie", "diverged")}
    assert summary["steps"] == len(steps) == sum(counts.values())
    assert (summary["match"], summary["near_tie"], summary["diverged"]) == (
        counts["match"], counts["near-tie"], counts["diverged"])
    assert summary["verdict"] == ("diverged" if counts["diverged"] else "past-bound" if summary["past_bound"]
                                  else "near-tie" if counts["near-tie"] else "match")
    assert summary["line"].startswith(f"{counts['match']}/{len(steps)} tokens match, {counts['near-tie']} near-")


def test_the_default_run_on_the_bundled_checkpoint_is_benign_and_its_report_validates(tmp_path, capsys):
    report_path, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = run_cli(capsys, "diff", "--steps", "32", "--json", str(report_path), "--plot", str(png))
    assert rc == 0, out + err
    assert ("on CUDA" if torch.cuda.is_available() else "Triton interpreter, faithful bf16 dot installed") in err
    report = json.loads(report_path.read_text())
    assert errors(report, SCHEMA) == []
    check_consistent(report)
    assert report["summary"]["diverged"] == 0  # bf16 noise is never a bug
    assert report["summary"]["line"] == out.strip().splitlines()[-1]
    assert report["checkpoint"]["kind"] == "bundled" and report["mode"] == "forced"
    info = report["environment"]["backend_info"]
    assert report["prompt"]["text"] and info["triton_interpreter"] == (not torch.cuda.is_available())
    assert info["faithful_bf16_dot"] == info["triton_interpreter"]
    assert report["variants"]["reference"] == {"moe_combine": "unbiased", "kv_norm_eps": 1e-6, "kda_gate": "softplus"}
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]  # no temporaries left
    _the_getting_started_transcript_is_this_run(report)


def _the_getting_started_transcript_is_this_run(report: dict) -> None:
    """docs/getting-started.md shows this command's output: its reference side (float64, the same
    on every platform) is this run's, step by step; the engine's side is bf16 noise of the machine
    that ran it (python tools/doc_outputs.py rewrites it; test_docs_examples.py checks its shape)."""
    from .. import doc_blocks

    shown = next(out for b in doc_blocks.blocks("docs/getting-started.md") if b.lang == "console"
                 for command, out in doc_blocks.transcript(b.text) if command == "parity diff --steps 32")
    rows = doc_blocks.table(shown)
    assert [(int(r[0]), r[1].split()[0], r[6]) for r in rows] == [
        (s["step"], str(s["ref_token"]), f"{s['ref_gap']:.3g}") for s in report["steps"]], \
        "docs/getting-started.md's 32-step run is stale: python tools/doc_outputs.py docs/getting-started.md"


def test_a_generator_checkpoint_in_free_mode(tmp_path, capsys):
    report_path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--synthetic", "tiny", "--seed", "7", "--mode", "free",
                           "--steps", "6", "--prompt", "Kimi-Linear decodes.", "--json", str(report_path))
    assert rc == 0, out + err
    report = json.loads(report_path.read_text())
    assert errors(report, SCHEMA) == []
    check_consistent(report)
    assert report["checkpoint"] == {"kind": "synthetic", "preset": "tiny", "seed": 7,
                                    "describe": "synthetic tiny, seed 7"}
    assert report["mode"] == "free" and report["prompt"]["ids"][:4] == [78, 108, 112, 108]  # bytes + 3
    splits = [s["step"] for s in report["steps"] if s["ref_token"] != s["opt_token"]]
    assert [sp["step"] for sp in report["splits"]] == splits
    assert all(s["anchored"] == (s["step"] in splits) for s in report["steps"])


@pytest.mark.parity_gpu
def test_benign_bf16_noise_is_never_called_diverged_over_128_forced_steps(tmp_path, capsys, parity_device):
    report_path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--device", parity_device, "--steps", "128", "--json", str(report_path))
    assert rc == 0, out + err
    report = json.loads(report_path.read_text())
    check_consistent(report)
    assert report["summary"]["diverged"] == 0 and report["summary"]["steps"] == 128
