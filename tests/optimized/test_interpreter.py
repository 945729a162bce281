"""Under the Triton interpreter the optimized kernels compute bf16 as a GPU does without the caller
doing anything first: ``optimized.load(ckpt, device="cpu", dtype="bfloat16")`` in a fresh process
(nothing installed, nothing imported before it) gives logits and hidden states within their bounds,
judged by ``parity diff``'s machinery against the float64 reference (``run_diff``: each step's
near-tie verdict, and every layer's error against its propagation bound). The check has teeth: with
the interpreter's own bf16 ``tl.dot`` and casts put back (what a run without the faithful dot
computed), the same judge reports the run diverged and names the first layer past its bound. Where
the faithful dot cannot be installed, importing optimized under the interpreter fails with one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parity_interpreter  # the CPU interpreter itself is under test

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")   # as optimized sets it on CPU, before triton is imported
from triton.runtime import interpreter as _interp   # its stock methods, before optimized is imported
STOCK = dict(vars(_interp.InterpreterBuilder))

import optimized
import reference
from kimi.fixtures import default_checkpoint_path
from parity.diff.runner import run_diff
from parity.platform import TOWARD_ZERO, store_rounding

PROMPT = [1, 17, 300, 42]


def judged(opt, ref, rounding, steps):
    res = run_diff(ref, opt, PROMPT, config=ref.config, steps=steps, dtype="bfloat16", rounding=rounding)
    f = res.final
    return {"verdict": res.verdict, "diverged": res.counts["diverged"],
            "past_bound": None if f is None or f.first is None else f.describe(),
            "nonfinite": None if f is None else f.nonfinite}


path = default_checkpoint_path()
opt = optimized.load(path, device="cpu", dtype="bfloat16")
ref = reference.load(path)
rounding = store_rounding("bfloat16", "cpu")
out = {"faithful": optimized.interpreter_is_faithful(), "run": judged(opt, ref, rounding, steps=2)}  # + a decode
if "--stock" in sys.argv:
    builder = _interp.InterpreterBuilder
    for name, fn in STOCK.items():
        if not name.startswith("__") and builder.__dict__.get(name) is not fn:
            setattr(builder, name, fn)
    out["stock"] = judged(opt, ref, TOWARD_ZERO, steps=1)   # it truncates to bf16; the prefill
print(json.dumps(out))
'''


def _in_a_fresh_process(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``script`` run by a new Python in the repository, TRITON_INTERPRET unset (the script sets it
    or leaves the choice to optimized)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fresh_process() -> dict:
    done = _in_a_fresh_process(SCRIPT, "--stock", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_cpu_load_computes_bf16_within_its_bounds(fresh_process):
    run = fresh_process["run"]
    assert run["nonfinite"] is None, run
    assert run["diverged"] == 0 and run["past_bound"] is None, run
    assert fresh_process["faithful"], "optimized.load ran the kernels without the faithful bf16 dot"


def test_the_judge_fails_the_stock_interpreters_bf16(fresh_process):
    stock = fresh_process["stock"]
    assert stock["diverged"] > 0 or stock["past_bound"] is not None, stock


def test_an_interpreter_that_cannot_be_made_faithful_is_refused():
    script = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
              "from triton.runtime import interpreter\n"
              "del interpreter.InterpreterBuilder.create_dot   # a Triton without the hook\n"
              "import optimized\n"
              "optimized.use('cpu')\n")
    done = _in_a_fresh_process(script)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("RuntimeError: optimized: the Triton kernels run under the "
                                                    "interpreter"), done.stderr[-2000:]
    assert "refusing to run them" in last


def test_a_first_call_before_any_choice_runs_under_the_interpreter():
    # no use(), no load(): the chunk-16 prepare kernel's flushing exp (inline PTX, GPU only) is
    # decided before its launch settles the backend, so the decision settles it first
    script = ("import torch\n"
              "from optimized import kda\n"
              "from parity import ops\n"
              "from parity.certify.check import tensors\n"
              "from parity.ops.kda.args import FUSED\n"
              "from parity.ops.kda.inputs import core_case\n"
              "c = core_case(1, 40, 1, 2, 128, 32, 5, chunk=16, fused=True, lower_bound=-5.0)\n"
              "d = tensors(ops.get('kda.fused_chunked+lower_bound'), c, 'bfloat16')\n"
              "run = lambda: kda.fused_chunked(*(d[n] for n in FUSED), chunk_size=16, lower_bound=-5.0)[0]\n"
              "first = run()\n"
              "print(bool(torch.isfinite(first).all()) and torch.equal(first, run()))\n")
    done = _in_a_fresh_process(script)
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr[-2000:]
