"""The float64 reference in the CLI: ``--reference-device``, the optimized model's weights shared
with it (exact), reports naming the executor, progress on stderr for long prefills only, memory
errors as one line with what to try, and Ctrl-C leaving no partial JSON."""
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import reference
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from parity.diff import reference_device
from parity.environment import environment
from parity.errors import InputError

from ..diff_helpers import run_cli
from ...subprocesses import sigint_default

ROOT = Path(__file__).resolve().parents[3]
TINY = KimiConfig.from_name("tiny")


def test_the_optimized_models_resident_weights_are_the_checkpoints_and_the_reference_reads_them(parity_device):
    import optimized
    from kimi.tensors import expected_tensors
    from optimized.weights import named_views

    dev = parity_device
    src = SyntheticSource(TINY, 0)
    views = named_views(optimized.load(src, device=dev, dtype="bfloat16").weights, TINY)
    shapes = expected_tensors(TINY)
    assert set(views) == set(shapes)
    for name, shape in shapes.items():
        np.testing.assert_array_equal(views[name].double().cpu().numpy().reshape(shape), src.get(name), err_msg=name)
    shared = reference.load(src, executor="torch", device=dev, shared_weights=views)
    assert shared.shares_weights
    ids = [5, 9, 2]
    # the same arithmetic on the same device: the shared weights change no bit
    assert torch.equal(shared.forward(ids), reference.load(src, executor="torch", device=dev).forward(ids))


def test_a_shared_tensor_that_cannot_hold_the_weights_is_refused_by_name():
    src = SyntheticSource(TINY, 0)
    name = "model.layers.0.self_attn.A_log"  # float32 storage: a bf16 copy would round it
    bad = {name: torch.zeros(src.shape(name), dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="A_log.*bfloat16 tensor cannot hold float32"):
        reference.load(src, executor="torch", shared_weights=bad).forward([1])
    wrong = {name: torch.zeros(7, dtype=torch.float32)}
    with pytest.raises(ValueError, match=r"A_log.*expected shape \(1, 1, 2, 1\), got \(7,\)"):
        reference.load(src, executor="torch", shared_weights=wrong).forward([1])
    with pytest.raises(ValueError, match="needs the torch executor"):
        reference.load(src, shared_weights=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_reference_device_cuda_without_a_gpu_is_one_line(capsys):
    code, out, err = run_cli(capsys, "diff", "--reference-device", "cuda", "--steps", "1")
    assert code == 2 and err.strip() == "error: --reference-device cuda: no CUDA device is available on this machine"


def test_reports_name_the_reference_executor_and_device():
    assert environment("cpu")["reference"]["executor"] == "numpy"
    model = reference.load(SyntheticSource(TINY, 0), executor="torch")
    info = reference_device.info(model)
    assert (info["executor"], info["device"], info["shared_weights"]) == ("torch", "cpu", False)
    assert info["library"].startswith("torch ")


def _events(tokens, seconds, call="prefill", layers=4):
    return [{"call": call, "layer": i, "layers": layers, "tokens": tokens, "elapsed_s": seconds * i / layers}
            for i in range(1, layers + 1)]


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream_type, tokens, seconds, call, lines", [
    (io.StringIO, 20, 0.1, "prefill", 0),    # short, not a terminal: silent
    (io.StringIO, 20, 4.0, "prefill", 4),    # long: layers 1.0 s in and later
    (io.StringIO, 20, 40.0, "decode", 0),    # decode steps never
    (_Tty, 20, 0.1, "prefill", 0),           # a short prompt on a terminal: silent
    (_Tty, 4096, 0.1, "forward", 4),         # a long prompt on a terminal: every layer
])
def test_progress_is_printed_for_long_prefills_only(stream_type, tokens, seconds, call, lines):
    stream = stream_type()
    progress = reference_device.Progress(stream)
    for e in _events(tokens, seconds, call):
        progress(e)
    printed = stream.getvalue().splitlines()
    assert len(printed) == lines
    if lines:
        assert printed[-1].startswith(f"reference {call}: layer 4/4 ({tokens} tokens,")


def test_memory_errors_become_one_line_saying_what_did_not_fit_and_what_to_try():
    with pytest.raises(InputError) as info:
        with reference_device.memory_errors("cuda", "cuda"):
            raise reference.DoesNotFit("the float64 reference's prefill of 9 token(s) after 0 needs about "
                                       "80.0 GiB on cuda:0 (64.0 GiB estimated + 25% margin), 40.0 GiB free")
    msg = str(info.value)
    assert "\n" not in msg and "80.0 GiB on cuda:0" in msg and "try --reference-device cpu" in msg
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                 "capacity of 139.81 GiB of which 1.10 GiB is free.\nIncluding ...")
    with pytest.raises(InputError, match=r"^out of GPU memory on cuda: tried to allocate "
                                         r"2.00 GiB, 1.10 GiB free; try --reference-device cpu"):
        with reference_device.memory_errors("cuda", "cuda"):
            raise oom
    with pytest.raises(RuntimeError, match="unrelated"):  # other errors pass through untouched
        with reference_device.memory_errors("cpu"):
            raise RuntimeError("unrelated")


def test_the_reference_running_out_of_memory_is_does_not_fit_naming_the_call():
    class Exhausted(reference.model.Model):
        def _stack(self, *args):
            raise MemoryError("Unable to allocate 12.0 GiB for an array with shape (20000, 163840)")

    with pytest.raises(reference.DoesNotFit, match=r"ran out of host memory in its prefill of 3 token\(s\) "
                                                   r"after 0 \(Unable to allocate 12.0 GiB"):
        Exhausted(SyntheticSource(TINY, 0)).prefill([1, 2, 3])


def test_ctrl_c_during_a_run_leaves_no_json_and_one_line(tmp_path):
    out = tmp_path / "report.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keep what is there
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "parity", "diff", "--steps", "500", "--no-progress",
                             "--json", str(out)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    seen = []
    for line in proc.stderr:  # the header's last line is printed as the decode starts
        seen.append(line)
        if line.startswith("variants:"):
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + rest
    assert rest.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []  # no report, no temporary file


def test_the_diffs_replay_runs_on_the_torch_executor_and_agrees_with_numpy(parity_device):
    """Every op replayed on the engine's own inputs gives the same errors on torch float64 (on the
    suite's device) as on NumPy."""
    import optimized
    from parity.diff import run_diff

    src = SyntheticSource(TINY, 0)
    prompt = [75, 107, 104, 117, 35, 108]
    engine = optimized.load(src, device=parity_device)
    runs = [run_diff(reference.load(src, **kw), engine, prompt, config=TINY, steps=2)
            for kw in ({}, {"executor": "torch", "device": parity_device})]
    a, b = ({e.name: e.rel_err for e in r.final.entries} for r in runs)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-12 * max(a[k], 1e-300) for k in a), (a, b)


def test_auto_puts_the_reference_on_the_gpu_when_it_fits_beside_the_engine(monkeypatch):
    class Engine:
        device = "cuda:0"

    assert reference_device.resolve("cpu", Engine()) == "cpu" and reference_device.resolve("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reference_device.resolve("auto", Engine()) == "cpu"  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert reference_device.resolve("auto", Engine()) == "cuda"  # it reads the engine's resident weights
    free = reference_device.AUTO_FREE_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 4 * free))
    assert reference_device.resolve("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free - 1, 4 * free))
    assert reference_device.resolve("auto") == "cpu"  # beside an engine that left too little
