"""Planted differences: bugs are called diverged and localized to their layer; a router near-tie
that bf16 noise flips is detected and reported as a near-tie. bf16 on CPU (Triton interpreter)."""
import json

import numpy as np

import pytest

import optimized
import reference
from ..diff_helpers import Override, PROMPT_IDS, perturbed_a_log, router_near_tie, run_cli, write_checkpoint
from parity.diff import run_diff
from kimi.checkpoint import open_source
from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path
from kimi.synthetic import SyntheticSource

PROMPT = [int(t) for t in PROMPT_IDS.split(",")]
PLANTED = "tests.parity.diff.engines_planted"


def test_a_perturbed_a_log_in_the_optimized_checkpoint_is_diverged_and_localized_to_its_layer(tmp_path, capsys):
    bad = write_checkpoint(perturbed_a_log(open_source(default_checkpoint_path()), layer=1, delta=1.0),
                           tmp_path / "bad")
    report_path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--optimized-from", str(bad), "--steps", "6",
                           "--json", str(report_path))
    assert rc == 1, out + err
    report = json.loads(report_path.read_text())
    assert report["summary"]["diverged"] >= 1 and report["summary"]["verdict"] == "diverged"
    loc = report["localization"]
    assert loc["first"]["name"] == "layers.1.mixer" and loc["first"]["op"] == "kda"
    assert loc["first_kind"] == "level" and loc["first"]["units"] > 1
    assert loc["backend_hint"] == "--backend kda=reference"
    # every op before it is within its bound: the bug is where it is named, not upstream
    before = [e for e in loc["entries"] if e["name"] in ("layers.0.mixer", "layers.0.ffn")]
    assert all(e["units"] < 1 for e in before)
    assert "layers.1.mixer (kda)" in out.strip().splitlines()[-1]
    assert report["optimized_checkpoint"]["path"] == str(bad)


def test_a_doubled_f_b_in_a_deep_kda_layer_is_diverged_and_named_in_bf16(tmp_path, capsys):
    """llama.cpp's bug at layer 2, bf16: every op is judged on the engine's own inputs, so the
    benign router flips upstream widen nothing, and the twin's noise excuses no flip."""
    source = open_source(default_checkpoint_path())
    name = "model.layers.2.self_attn.f_b_proj.weight"
    bad = write_checkpoint(Override(source, {name: source.get(name) * 2.0}), tmp_path / "fb")
    rc, out, err = run_cli(capsys, "diff", "--optimized-from", str(bad), "--steps", "8")
    assert rc == 1, out + err
    assert "layers.2.mixer (kda)" in out.strip().splitlines()[-1], out


def test_nan_in_a_carried_state_exits_1_and_the_report_writes_it_as_null(tmp_path, capsys):
    report_path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--engine", f"{PLANTED}:nan_state", "--steps", "4",
                           "--json", str(report_path))
    assert rc == 1, out + err
    report = json.loads(report_path.read_text())   # strict JSON: NaN/Inf written as null
    assert report["summary"]["verdict"] == "diverged"
    bad = [s for s in report["steps"] if s["cause"] == "nonfinite"]
    assert bad and bad[0]["nonfinite"]["name"] == "layers.0.mixer"


def test_nan_in_one_layer_is_named_as_the_first_non_finite_layer():
    source = SyntheticSource(KimiConfig.from_name("tiny"), 3)
    opt = optimized.load(source)
    # a NaN weight in the last layer's shared expert (upstream of a router, the optimized router
    # would be handed NaN scores)
    opt.weights.layers[3].ffn.shared.down[0, 0] = float("nan")
    result = run_diff(reference.load(source), opt, PROMPT, config=source.config, steps=1)
    (step,) = result.steps
    assert step.verdict == "diverged" and step.nonfinite["name"] == "layers.3.ffn"
    loc = result.localization
    assert loc.nonfinite["name"] == "layers.3.ffn" and loc.first.name == "layers.3.ffn"
    # everything upstream of the NaN within its bound (the layer's residual stream holds the NaN too)
    assert all(e.units < 1 for e in loc.entries if e.layer is not None and e.name not in ("layers.3.ffn", "layers.3.residual"))
    assert "first NaN/Inf at layers.3.ffn" in result.summary()["line"]


def test_a_constructed_router_near_tie_is_detected_and_reported(tmp_path, capsys):
    source, tie = router_near_tie(SyntheticSource(KimiConfig.from_name("tiny"), 0), PROMPT, layer=1)
    ckpt = write_checkpoint(source, tmp_path / "tie")
    report_path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", str(ckpt), "--prompt-ids", PROMPT_IDS, "--steps", "1",
                           "--json", str(report_path))
    assert rc == 0, out + err
    (step,) = json.loads(report_path.read_text())["steps"]
    flip = next(f for f in step["router"] if (f["layer"], f["position"]) == (tie["layer"], tie["position"]))
    assert (flip["swapped_out"], flip["swapped_in"]) == ([tie["x"]], [tie["y"]])
    assert flip["margin"] == pytest.approx(tie["margin"], rel=1e-3) and flip["within_noise"]
    # the swapped expert moves the logits: a token flip, explained by the router near-tie
    assert step["ref_token"] != step["opt_token"]
    assert step["verdict"] == "near-tie" and step["cause"] == "router"
    # shown, not assumed: the reference forced down the engine's choice there reproduces its step
    assert "router flip shown: the reference forced down the engine's choice at layers.1 pos 19 experts" \
        in out.strip().splitlines()[-1]
    assert step["counterfactual"]["what"] == "flip" and step["counterfactual"]["shown"]


def test_runs_that_route_apart_after_a_benign_drift_are_a_near_tie_not_a_bug():
    """Two correct runs: the engine's stream drifts within its bounds (layer 0's output 0.8% off),
    and at a router tie in layer 1 it picks the other expert than the reference's own run, rightly
    for its own input (the replayed router agrees). An expert scaled up makes that swap move the
    logits far past the twin's noise; with the engine's expert choices the reference agrees, so the
    step is a near-tie one level down, not a bug."""
    import torch

    from reference.norm import rms_norm

    base = SyntheticSource(KimiConfig.from_name("tiny"), 0)
    o0 = "model.layers.0.self_attn.o_proj.weight"
    drift = Override(base, {o0: base.get(o0) * (1 + 2.0**-7)})

    def scores(source):
        t = {}
        reference.load(source).prefill(PROMPT, trace=t)
        mid = np.asarray(t["layers.0.hidden"])[-1] + np.asarray(t["layers.1.mixer"])[-1]
        x = rms_norm(mid, source.get("model.layers.1.post_attention_layernorm.weight"), eps=source.config.rms_norm_eps)
        return 1 / (1 + np.exp(-(x @ source.get("model.layers.1.block_sparse_moe.gate.weight").T)))

    s_ref, s_eng = scores(base), scores(drift)
    lo, hi = s_ref[None, :] - s_ref[:, None], s_eng[None, :] - s_eng[:, None]   # [x, y]
    width = np.where(np.eye(len(s_ref), dtype=bool), -np.inf, hi - lo)
    x, y = np.unravel_index(np.argmax(width), width.shape)
    assert width[x, y] > 0
    bias = np.full(len(s_ref), -2.0) - s_ref
    sure = [e for e in np.argsort(-s_ref) if e not in (x, y)][:1]
    bias[sure] = 2.0 - s_ref[sure]
    bias[x], bias[y] = 0.5 + (lo[x, y] + hi[x, y]) / 4, 0.5 - (lo[x, y] + hi[x, y]) / 4
    w2 = f"model.layers.1.block_sparse_moe.experts.{y}.w2.weight"
    tie = {"model.layers.1.block_sparse_moe.gate.e_score_correction_bias": bias, w2: base.get(w2) * 30.0}
    ref_src, eng_src = Override(base, tie), Override(base, {**tie, o0: base.get(o0) * (1 + 2.0**-7)})

    class Bf16Declared:  # the float64 engine, its logits stored as the bf16 run would
        def __init__(self, model):
            self.model = model

        def prefill(self, ids, *, trace=None):
            logits, cache = self.model.prefill(ids, trace=trace)
            return torch.tensor(np.asarray(logits)).bfloat16(), cache

        def decode(self, token, cache, *, trace=None):
            logits, cache = self.model.decode(token, cache, trace=trace)
            return torch.tensor(np.asarray(logits)).bfloat16(), cache

    result = run_diff(reference.load(ref_src), Bf16Declared(reference.load(eng_src)), PROMPT,
                      config=base.config, steps=1, dtype="bfloat16")
    (step,) = result.steps
    assert step.ref_token != step.opt_token and step.ref_margin > step.bound, step   # past the twin's noise
    assert step.verdict == "near-tie" and step.cause == "router", step.explanation
    assert "the engine's own expert choices at every position" in step.explanation
    assert "first layers.1 pos 19" in step.explanation and step.counterfactual.shown
    assert result.final.first is None   # every replayed op within its bound
