"""``parity diff --engine``: engines we did not write held to the reference, a planted bug localized,
an engine without traces judged on its logits, and every protocol breach refused with one line.

Cheap on purpose (CI, 2 cores): float32, 2-3 steps; the planted engines run on NumPy
(``engines_planted.py``), transformers' model on the tiny checkpoint takes ~1 s a run after its import."""
import importlib.util
import json

import numpy as np
import pytest

from parity.diff.runner import NO_TRACES
from parity.schema import errors

from ..diff_helpers import PROMPT_IDS, one_line_error, run_cli
from .test_diff_cli import SCHEMA, check_consistent

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed "
                                        "(pip install 'kimi-parity[peers]')")
PLANTED = "tests.parity.diff.engines_planted"


def _diff(capsys, tmp_path, engine, *more, device, steps="2"):
    report = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--engine", engine, "--dtype", "float32", "--device", device,
                           "--steps", steps, "--no-progress", "--json", str(report), *more)
    return rc, out, err, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.parity_interpreter  # transformers' torch path (on a GPU it calls fla-core's TF32 kernels)
@needs_transformers
def test_transformers_at_float32_on_the_bundled_checkpoint_has_no_step_diverged_and_no_op_past_its_bound(
        tmp_path, capsys, parity_device):
    rc, out, err, report = _diff(capsys, tmp_path, "transformers", steps="3", device=parity_device)
    assert rc == 0, out + err
    assert errors(report, SCHEMA) == []
    check_consistent(report)
    s = report["summary"]
    assert s["verdict"] == "match" and s["traces"] and s["past_bound"] is None
    assert report["engine"] == {"name": "transformers", "traced": True, "follow": "reference"}
    assert report["variants"]["optimized"]["transformers"].split(".")[0] >= "5"
    assert all(st["logits"]["units"] < 1 for st in report["steps"])
    assert "engine: transformers (TransformersEngine), float32 on cpu" in err


@pytest.mark.parity_interpreter  # transformers' torch path (on a GPU it calls fla-core's TF32 kernels)
@needs_transformers
@pytest.mark.parametrize("held", ["float32", "float64"])
def test_transformers_loads_a_checkpoint_it_saved_itself(tmp_path, capsys, held, parity_device):
    """save_pretrained's layout (the dense MLP as block_sparse_moe, F32/F64 tensors) as it is."""
    import torch

    from kimi.fixtures import default_checkpoint_path
    from parity.diff.engines import load_engine

    engine = load_engine("transformers", default_checkpoint_path(), dtype="float32", device=parity_device)
    engine.hf_model.to(getattr(torch, held)).save_pretrained(tmp_path / "saved")
    rc, out, err, report = _diff(capsys, tmp_path, "transformers", str(tmp_path / "saved"), device=parity_device)
    assert rc == 0, out + err
    assert report["summary"]["verdict"] == "match"


@needs_transformers
@pytest.mark.parity_gpu
def test_transformers_in_bfloat16_on_cuda_has_no_step_diverged_over_128_steps(tmp_path, capsys, parity_device):
    report = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", "--engine", "transformers", "--dtype", "bfloat16", "--device", parity_device,
                           "--steps", "128", "--no-progress", "--json", str(report))
    assert rc == 0, out + err
    report = json.loads(report.read_text())
    check_consistent(report)
    assert report["summary"]["diverged"] == 0 and report["summary"]["past_bound"] is None


@pytest.mark.parity_interpreter  # transformers' torch path (on a GPU it calls fla-core's TF32 kernels)
@needs_transformers
def test_golden_check_holds_transformers_to_the_committed_golden(capsys, parity_device):
    from kimi.fixtures import default_checkpoint_path

    golden = default_checkpoint_path().parent / "golden" / "default.json"
    rc, out, err = run_cli(capsys, "golden", "check", str(golden), "--engine", "transformers", "--device", parity_device,
                           "--steps", "3")
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1] == "golden: 3/3 steps match, 0 near-tie, 0 diverged"


@pytest.mark.parametrize("factory", ["fb_doubled", pytest.param("fb_doubled_transformers", marks=(
    needs_transformers, pytest.mark.parity_interpreter))])  # transformers' torch path, as above
def test_llama_cpp_doubled_f_b_exits_1_and_is_localized_to_that_layers_mixer(tmp_path, capsys, factory, parity_device):
    rc, out, err, report = _diff(capsys, tmp_path, f"{PLANTED}:{factory}", device=parity_device)
    assert rc == 1, out + err
    check_consistent(report)
    loc = report["localization"]
    assert loc["first"]["name"] == "layers.1.mixer" and loc["first"]["op"] == "kda"
    assert loc["first"]["units"] > 100  # float32: the bug is thousands of bounds away, not a near call
    assert all(e["units"] < 1 for e in loc["entries"] if e["name"].startswith("layers.0."))
    # no token flipped in two steps: the run is past its bound, not clean
    assert report["summary"]["verdict"] in ("past-bound", "diverged")
    assert "layers.1.mixer (kda)" in out.strip().splitlines()[-1]


def test_an_engine_without_traces_is_judged_on_its_logits_and_says_so(tmp_path, capsys, parity_device):
    rc, out, err, report = _diff(capsys, tmp_path, "tests/parity/diff/engines_planted.py:untraced", steps="3", device=parity_device)
    assert rc == 0, out + err
    check_consistent(report)
    assert report["summary"]["traces"] is False and report["engine"]["traced"] is False
    assert report["localization"] is None
    assert out.strip().splitlines()[-1].endswith(f"; {NO_TRACES}")
    assert all(0 <= st["logits"]["units"] < 1e-3 for st in report["steps"])  # float64 numbers


def test_logits_outside_lm_heads_span_are_past_their_bound_even_when_every_token_agrees(tmp_path, capsys, parity_device):
    rc, out, err, report = _diff(capsys, tmp_path, f"{PLANTED}:bent_logits", steps="2", device=parity_device)
    assert rc == 1, out + err
    s = report["summary"]
    assert s["diverged"] == 0 and s["match"] == 2 and s["verdict"] == "past-bound"
    assert "not clean: past its bound although no step diverged: step 0: logits:" in s["line"]
    assert s["line"].endswith(NO_TRACES)
    assert report["steps"][0]["logits"]["units"] > 10


ENGINE_ERRORS = {
    "unknown engine": (["--engine", "warp9"], "unknown engine 'warp9'; built in: optimized, transformers"),
    "no such module": (["--engine", "no_such_module:make"], "cannot import no_such_module: ModuleNotFoundError"),
    "no such factory": (["--engine", f"{PLANTED}:nope"], f"{PLANTED} has no callable 'nope'"),
    "factory raises": (["--engine", f"{PLANTED}:raises"],
                       "the factory raised RuntimeError: no GPU driver found"),
    "not an engine": (["--engine", f"{PLANTED}:not_an_engine"], "object has no prefill() method"),
    "wrong vocabulary": (["--engine", f"{PLANTED}:wrong_vocab"],
                         "prefill returned logits of shape (20, 513); expected (20, 512) or (512,)"),
    "wrong rows": (["--engine", f"{PLANTED}:two_rows"], "prefill returned logits of shape (2, 512)"),
    "half a trace": (["--engine", f"{PLANTED}:half_traced"], "trace has no layers.3.mixer"),
    "backend for another engine": (["--engine", f"{PLANTED}:fb_doubled", "--backend", "kda=reference"],
                                   "--variant and --backend apply to the built-in engines"),
    "transformers on synthetic weights": (["--engine", "transformers", "--synthetic", "tiny"],
                                          "--engine transformers loads a checkpoint directory"),
    "a variant transformers does not run": (["--engine", "transformers", "--variant", "moe_combine=biased"],
                                            "the transformers engine runs moe_combine=unbiased"),
}


@pytest.mark.parametrize("case", list(ENGINE_ERRORS))
def test_an_unusable_engine_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, case, parity_device):
    argv, message = ENGINE_ERRORS[case]
    report = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "diff", *argv, "--dtype", "float32", "--device", parity_device, "--steps", "2",
                           "--prompt-ids", PROMPT_IDS,
                           "--no-progress", "--json", str(report))
    one_line_error(rc, out, err, message)
    assert list(tmp_path.iterdir()) == []


def test_the_lm_head_bound_holds_for_lm_head_outputs_and_has_teeth():
    from kimi.checkpoint import open_source
    from kimi.fixtures import default_checkpoint_path
    from parity.bounds.core import precision_for
    from parity.diff.logits import LmHeadSpan

    source = open_source(default_checkpoint_path())
    span = LmHeadSpan(source, source.config)
    W = source.get("lm_head.weight")
    p = precision_for("bfloat16")
    x = np.random.default_rng(0).normal(size=W.shape[1])
    exact = W @ x
    bf16 = np.asarray(__import__("torch").tensor(exact).bfloat16().double())  # rounded as an engine stores it
    assert span.check(bf16, u_out=p.u, ua=p.ua).units < 1
    assert span.check(bf16 + 3.0, u_out=p.u, ua=p.ua).units < 1  # a constant shift changes nothing
    bent = bf16.copy()
    bent[::7] += 0.05 * np.abs(bf16).max()
    assert span.check(bent, u_out=p.u, ua=p.ua).units > 1
    garbage = bf16.copy()
    garbage[5] = 1e30
    assert span.check(garbage, u_out=p.u, ua=p.ua).units > 1
    nan = bf16.copy()
    nan[3] = np.nan
    assert span.check(nan, u_out=p.u, ua=p.ua) is None  # non-finite logits: the step verdict's job


def test_a_batchs_logit_rows_are_checked_together_as_each_alone(parity_device):
    # on a GPU the rows' products are taken at once (within float64 rounding of each row's own
    # check); on the CPU row by row, bit for bit; a non-finite row is None, the others still checked
    from kimi.checkpoint import open_source
    from kimi.fixtures import default_checkpoint_path
    from parity.bounds.core import precision_for
    from parity.diff.logits import LmHeadSpan

    source = open_source(default_checkpoint_path())
    span = LmHeadSpan(source, source.config, device=parity_device)
    W = source.get("lm_head.weight")
    p = precision_for("bfloat16")
    rows = np.random.default_rng(1).normal(size=(4, W.shape[1])) @ W.T
    rows[1, ::7] += 0.05 * np.abs(rows[1]).max()  # past its bound
    rows[2, 3] = np.nan
    got = span.check_rows(rows, u_out=p.u, ua=p.ua)
    assert got[2] is None and got[1].units > 1 > got[0].units
    for g, o in zip(got, rows):
        want = span.check(o, u_out=p.u, ua=p.ua)
        if want is None or parity_device == "cpu":
            assert g == want
        else:
            assert g.units == pytest.approx(want.units, rel=1e-9, abs=1e-12)


@needs_transformers
def test_transformers_failing_inside_its_own_model_is_one_line_and_exit_2(tmp_path, capsys, parity_device):
    """transformers' model raising inside its own forward (a kernel that cannot run on this card)."""
    rc, out, err = run_cli(capsys, "diff", "--engine", f"{PLANTED}:transformers_raises", "--dtype", "float32",
                           "--device", parity_device, "--steps", "2", "--prompt-ids", PROMPT_IDS, "--no-progress")
    one_line_error(rc, out, err, "raised")
    assert "prefill raised RuntimeError: no kernel image is available" in err, err
