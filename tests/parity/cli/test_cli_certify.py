"""`parity certify` end to end (a subprocess, as a user runs it) and its JSON against the schema."""
import json
import os
import subprocess
import sys

import pytest
import torch

from parity import schema

PARITY = os.path.join(os.path.dirname(sys.executable), "parity")


def _certify(*args, tmp_path=None, timeout=600):
    env = dict(os.environ, PARITY_HYPOTHESIS_PROFILE="ci")
    return subprocess.run([PARITY, "certify", *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=tmp_path)


def test_certify_prints_tables_writes_a_valid_certificate_and_exits_0(tmp_path, parity_device):
    import optimized

    path = tmp_path / "cert.json"
    out = _certify("--device", parity_device, "--ops", "elementwise.silu", "norm.l2norm", "--examples", "2",
                   "--json", str(path), tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2/2 op(s) certified" in out.stdout and "teeth" in out.stdout
    doc = json.loads(path.read_text())
    assert schema.errors(doc) == []
    assert doc["summary"] == {"ops": 2, "certified": 2, "verdict": "certified", "faults": 0, "nondeterministic": 0}
    assert doc["environment"]["git"]["revision"] and doc["environment"]["backend_info"]["triton_interpreter"] == optimized.interpreting()
    op = doc["ops"][0]
    assert op["reached"] == ["bytes", "lifted", "production"] and op["mutants_killed"] == op["mutants_total"]
    assert {r["dtype"] for r in op["runs"].values()} == {"float32", "bfloat16"}
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(doc, schema.load())


def test_the_validator_rejects_a_certificate_that_breaks_the_schema(tmp_path):
    bad = {"schema": "kimi-parity/certificate", "version": 2, "ops": [{"op": 1}]}
    errs = schema.errors(bad)
    assert any("version" in e for e in errs) and any("missing required property 'summary'" in e for e in errs)
    assert any("$.ops[0]" in e for e in errs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_one_line_error_exit_2():
    out = _certify("--device", "cuda", "--ops", "elementwise.silu")
    assert out.returncode == 2 and out.stderr.startswith("error: --device cuda") and out.stderr.count("\n") == 1


@pytest.mark.parametrize("args, needle", [
    (["--ops", "nosuch.op"], "nosuch.op"),
    (["--examples", "0"], "--examples"),
    (["--dtype", "int8"], "invalid choice"),
])
def test_bad_arguments_are_one_line_errors_exit_2(args, needle, parity_device):
    out = _certify("--device", parity_device, *args)
    assert out.returncode == 2 and out.stderr.startswith("error:") and needle in out.stderr
    assert "Traceback" not in out.stderr
