"""Importing optimized does nothing: no environment variable is set or changed (``TRITON_INTERPRET``
above all), no backend is chosen and Triton is not patched, until an entry point calls
``optimized.use(device)`` or a kernel launches. One fresh interpreter, about 3 s."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os
before = dict(os.environ)
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction
stock = (JITFunction.run, JITFunction.__call__, interpreter.InterpreterBuilder.create_dot)
import optimized
import optimized.conv, optimized.elementwise, optimized.embed, optimized.kda, optimized.mla
import optimized.moe, optimized.norm, optimized.model, optimized.graphs
after = dict(os.environ)
untouched = stock == (JITFunction.run, JITFunction.__call__, interpreter.InterpreterBuilder.create_dot)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
chosen_on_import = optimized._interpreter.chosen()
optimized.use("cpu")
print(json.dumps({"changed": changed, "chosen": chosen_on_import, "untouched": untouched,
                  "after_use": os.environ.get("TRITON_INTERPRET"), "faithful": optimized.interpreter_is_faithful()}))
'''


def test_importing_optimized_changes_no_environment_variable_and_chooses_no_backend():
    # this process's environment (where packages are found: PYTHONPATH on the GPU machine) without
    # any choice of backend in it
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["changed"] == [] and out["chosen"] is None and out["untouched"], out
    assert out["after_use"] == "1" and out["faithful"], out   # the choice, made by use(): the check has teeth
