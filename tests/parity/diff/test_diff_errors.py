"""Unusable input to ``parity diff`` / ``parity golden``: exit status 2 and one line starting
``error:`` that names the problem, never a traceback (the real CLI, in-process and as a process)."""
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from ..diff_helpers import Override, run_cli, write_checkpoint
from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path

A_LOG = "model.layers.1.self_attn.A_log"


def _copy(tmp_path):
    return shutil.copytree(default_checkpoint_path(), tmp_path / "ckpt")


def _broken_config(tmp_path):
    d = _copy(tmp_path)
    (d / "config.json").write_text('{"vocab_size": 512,')
    return d


def _truncated(tmp_path):
    d = _copy(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def _wrong_shape(tmp_path):
    src = open_source(default_checkpoint_path())
    return write_checkpoint(Override(src, {A_LOG: np.zeros(src.config.kda_num_heads)}), tmp_path / "ckpt")


def _nan_weights(tmp_path):
    src = open_source(default_checkpoint_path())
    w = src.get("model.layers.0.mlp.up_proj.weight")
    w[3, 7] = np.nan
    return write_checkpoint(Override(src, {"model.layers.0.mlp.up_proj.weight": w}), tmp_path / "ckpt")


CHECKPOINTS = {
    "missing folder": (lambda tmp: tmp / "nope", "no such checkpoint directory"),
    "broken config": (_broken_config, "config.json: not valid JSON"),
    "truncated tensors": (_truncated, "truncated"),
    "wrong-shaped tensor": (_wrong_shape, f"{A_LOG}: expected shape (1, 1, 2, 1)"),
    "NaN weights": (_nan_weights, "model.layers.0.mlp.up_proj.weight: 1 non-finite value"),
}


def _one_line_error(rc, out, err, message):
    assert rc == 2, out + err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_a_bad_checkpoint_is_one_line_and_exit_2(tmp_path, capsys, case):
    make, message = CHECKPOINTS[case]
    _one_line_error(*run_cli(capsys, "diff", str(make(tmp_path)), "--steps", "2"), message)


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,2,512"], "prompt token id 512 is outside the vocabulary [0, 512)"),
    (["--prompt-ids", "1,-4"], "prompt token id -4 is outside the vocabulary"),
    (["--prompt-ids", "1,a"], "--prompt-ids '1,a': expected comma-separated integers"),
    (["--steps", "0"], "--steps 0: expected a positive number of steps"),
    (["--steps", "-3"], "--steps -3: expected a positive number of steps"),
    (["--variant", "moe_combine=weird"], "--variant moe_combine=weird: expected one of unbiased, biased"),
    (["--variant", "kv_norm_eps=-1"], "--variant kv_norm_eps=-1: expected a positive number"),
    (["--variant", "colour=blue"], "--variant colour: unknown variant; known: moe_combine, kv_norm_eps"),
    (["--variant", "moe_combine"], "--variant 'moe_combine': expected NAME=VALUE"),
    (["--backend", "attention=reference"], "--backend: backends: unknown op family 'attention'"),
    (["--backend", "kda=fast"], "unknown backend 'fast'"),
    (["--synthetic", "huge"], "unknown preset 'huge'"),
    (["--mode", "sideways"], "argument --mode: invalid choice: 'sideways'"),
    (["--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: folder /nonexistent-dir does not exist"),
])
def test_a_bad_argument_is_one_line_and_exit_2(capsys, argv, message):
    _one_line_error(*run_cli(capsys, "diff", *argv), message)


def test_a_checkpoint_and_synthetic_together_are_refused(tmp_path, capsys):
    _one_line_error(*run_cli(capsys, "diff", str(default_checkpoint_path()), "--synthetic", "tiny"),
                    "give either a CHECKPOINT or --synthetic PRESET, not both")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_refused(capsys):
    _one_line_error(*run_cli(capsys, "diff", "--device", "cuda"), "--device cuda: no CUDA device is available")


@pytest.mark.parametrize("argv, message", [
    (["golden", "check", "{tmp}/missing.json"], "missing.json: no such golden file"),
    (["golden", "check", "{tmp}/notjson.json"], "not a JSON golden file"),
    (["golden", "record", "--out", "{tmp}/g.json", "--steps", "0"], "--steps 0: expected a positive number"),
    (["golden", "record", "{tmp}/nope", "--out", "{tmp}/g.json"], "no such checkpoint directory"),
])
def test_golden_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "notjson.json").write_text("{")
    _one_line_error(*run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv]), message)


def test_the_console_script_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "parity", "diff", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    _one_line_error(proc.returncode, proc.stdout, proc.stderr, "no such checkpoint directory")
