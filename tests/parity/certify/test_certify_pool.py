"""Certify's worker processes, shards, repros, dirty memory and nondeterminism: a candidate that
kills its process fails only its own inputs, the pool of two workers certifies the other ops as
this process does, shards merge into the unsharded certificate, a repro script reproduces a
failure in a fresh process, and two runs that differ in bytes are a finding of their own."""
import dataclasses
import json
import subprocess
import sys

import pytest

from parity import ops, schema
from parity.certify import certify, certify_op, cpu_threads
from parity.cli import main
from parity.errors import CandidateError
from parity.registry import OpRecord

from . import planted_kda
from .cli_errors import assert_certify_refuses

RECURRENT = ops.get("kda.recurrent")


def _strip(doc):
    """A certificate without what differs between two runs of the same work (times, dates)."""
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("seconds", "created")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def test_a_candidate_that_kills_its_process_fails_only_its_own_inputs(parity_device):
    """Two workers: kda.recurrent's implementation exits (os._exit(3)) on one shape and segfaults on
    another (both given as explicit inputs, beside one drawn); those inputs are faults naming their
    shapes and how the process ended, every other input is judged, and the ops after it are
    certified exactly as in this process (the same draws: hypothesis draws here either way)."""
    from parity.ops.kda.inputs import core_case

    others = [ops.get("elementwise.silu"), ops.get("norm.l2norm")]
    kw = dict(dtypes=("float32",), device=parity_device, candidate="reference-f32", examples=1)
    with cpu_threads(parity_device):   # first: later runs then see the same modules (hypothesis draws
        here = certify(others, workers=0, **kw)          # constants from the loaded ones)
    killers = [core_case(2, 37, 2, 2, 16, 32, 1, has_state=False), core_case(1, 70, 1, 2, 32, 16, 2)]
    pooled = certify([RECURRENT, *others], impls={"kda.recurrent": planted_kda.kills_its_process}, workers=2,
                     cases={"kda.recurrent": killers}, **kw)
    rec = pooled[0]
    faults = [(f["shapes"]["q"], f["error"]) for f in rec.faults()]
    assert faults[:2] == [([2, 37, 2, 16], "the worker process exited with status 3"),
                          ([1, 70, 1, 32], "the worker process was killed by SIGSEGV")], faults
    killed = {c.label for c in rec.runs["float32"].cases if c.fault is not None}
    judged = [c for c in rec.runs["float32"].cases if c.fault is None]
    assert judged and all(c.passed for c in judged) and all(
        ("T=70" in c.label or ("T=37" in c.label and " h0" not in c.label)) for c in rec.runs["float32"].cases
        if c.label in killed)
    assert not rec.certified and rec.label == "tests.parity.certify.planted_kda:kills_its_process"
    assert schema.errors({"ops": [rec.to_dict()]}, _op_schema()) == []
    for a, b in zip(pooled[1:], here):
        assert a.certified and b.certified, a.reasons()
        assert _strip(a.to_dict()) == _strip(b.to_dict())


def _op_schema():
    s = schema.load()
    return {"$defs": s["$defs"], "type": "object", "properties": {"ops": {"type": "array", "items": {"$ref": "#/$defs/op"}}}}


def test_shards_merge_into_the_certificate_of_the_unsharded_run(tmp_path, capsys, parity_device):
    args = ["certify", "--device", parity_device, "--ops", "elementwise.silu", "norm.l2norm", "--candidate", "reference-f32",
            "--dtype", "float32", "bfloat16", "--examples", "1"]
    assert main([*args, "--json", str(tmp_path / "all.json")]) == 0
    for i in (1, 2):
        assert main([*args, "--shard", f"{i}/2", "--json", str(tmp_path / f"s{i}.json")]) == 0
    s1 = json.loads((tmp_path / "s1.json").read_text())
    assert s1["shard"]["units"] == [["elementwise.silu", "float32"], ["norm.l2norm", "float32"]]
    assert main(["certify", "merge", str(tmp_path / "s2.json"), str(tmp_path / "s1.json"),
                 "--json", str(tmp_path / "merged.json")]) == 0
    whole, merged = (json.loads((tmp_path / f).read_text()) for f in ("all.json", "merged.json"))
    assert schema.errors(merged) == [] and merged["merged"]["shards"] == 2
    assert _strip(merged["ops"]) == _strip(whole["ops"]) and merged["summary"] == whole["summary"]
    capsys.readouterr()
    assert main(["certify", "merge", str(tmp_path / "s1.json"), "--json", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: merge: expected shards 1..n") and err.count("\n") == 1


def test_a_repro_reproduces_a_failure_in_a_fresh_process(tmp_path, parity_device):
    """The repro of a planted bug: its inputs, the float64 reference and its bound, and a script that
    needs only torch, safetensors and the implementation; run alone, it prints the error in bound
    units (> 1) and exits 1."""
    with cpu_threads(parity_device):
        cert = certify_op(RECURRENT, candidate=planted_kda.beta_dropped, dtypes=("float32",), examples=1,
                          device=parity_device, repro=str(tmp_path))
    assert not cert.certified
    folder = next(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {"inputs.safetensors", "expected.safetensors", "meta.json", "repro.py"}
    script = (folder / "repro.py").read_text()
    assert "import parity" not in script and "from parity" not in script and len(script.splitlines()) < 45
    out = subprocess.run([sys.executable, str(folder / "repro.py"), parity_device], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    worst = float(out.stdout.strip().splitlines()[-1].split()[1])
    assert worst > 1 and worst == pytest.approx(cert.runs["float32"].worst_ratio, rel=1e-2)


def test_dirty_memory_kills_the_blanking_by_zero_mutant_and_a_correct_candidate_holds(parity_device):
    """The pool's free rows hold NaN, Inf, then stale values: the stand-in holds on all three, and
    the mutant that blanks a padding row by multiplying by zero (vLLM pull 43961) is killed on NaN."""
    rec = ops.get("kda.fused_recurrent_decode")
    with cpu_threads(parity_device):
        cert = certify_op(rec, candidate="reference-f32", dtypes=("float32",), examples=1, device=parity_device)
    assert cert.certified, cert.reasons()
    run = cert.runs["float32"]
    assert [c.dirty for c in run.cases] == [None, "nan", "inf", "stale"]
    blank = run.mutants["padding_blanked_by_zero"]
    assert blank.killed and "dirty=nan" in blank.first_failure
    with pytest.raises(ValueError, match="blanks it by multiplying by zero"):
        dataclasses.replace(rec, mutants=tuple(m for m in rec.mutants if not m.dirty))


def test_two_runs_that_differ_in_bytes_are_a_finding_of_their_own(parity_device):
    with cpu_threads(parity_device):
        cert = certify_op(RECURRENT, candidate=planted_kda.flips_a_bit, dtypes=("float32",), examples=1,
                          device=parity_device)
    assert cert.runs["float32"].passed   # within the bound every time
    found = cert.nondeterminism()
    assert found and found[0]["outputs"] == ["o"] and found[0]["dtype"] == "float32"
    assert not cert.certified and any("run-to-run differs in ['o']" in r for r in cert.reasons())
    assert cert.to_dict()["nondeterminism"] == found


def test_a_wrong_number_of_outputs_is_refused_and_a_harness_bug_is_a_traceback(parity_device):
    def one_output(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
        return planted_kda.recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)[0]

    with pytest.raises(CandidateError, match=r"expected outputs \('o', 'final_state'\), got Tensor"):
        certify_op(RECURRENT, candidate=one_output, dtypes=("float32",), examples=1, device=parity_device)

    def broken_reference(x, *, eps=1e-6):
        raise ZeroDivisionError("a bug in the reference")

    rec: OpRecord = dataclasses.replace(ops.get("norm.l2norm"), reference=broken_reference)
    with pytest.raises(ZeroDivisionError):
        certify_op(rec, candidate="reference-f32", dtypes=("float32",), examples=1, device=parity_device)


@pytest.mark.parametrize("args, needle", [
    (["--workers", "-1"], "--workers -1: expected a count >= 0"),
    (["--shard", "3/2"], "--shard 3/2: expected I/N with 1 <= I <= N"),
    (["--shard", "x"], "--shard x: expected I/N"),
    (["--repro", "pyproject.toml"], "--repro pyproject.toml: not a folder"),
    (["merge", "a.json"], "merge: --json PATH is required"),
    (["nosuch.json"], "invalid choice: 'nosuch.json'"),
])
def test_bad_pool_shard_and_merge_arguments_are_one_line_errors_exit_2(args, needle, capsys, parity_device):
    assert_certify_refuses(args, needle, capsys, parity_device)


def test_workers_are_pinned_one_visible_gpu_each_within_an_outer_cuda_visible_devices(monkeypatch):
    """No process starts here: which device each worker would get (its CUDA_VISIBLE_DEVICES)."""
    from parity.certify import runners
    from parity.certify.pool import visible_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert visible_devices() == ["2", "5"]
    assert [w.gpu for w in runners("cuda", None)] == ["2", "5"]        # default: one per visible GPU
    assert [w.gpu for w in runners("cuda", 3)] == ["2", "5", "2"]
    assert [type(r).__name__ for r in runners("cpu", None)] == ["InProcess"]
    assert [(type(r).__name__, r.gpu) for r in runners("cpu", 2)] == [("Worker", None)] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_devices() == []


def test_a_call_that_never_returns_is_a_fault_and_its_worker_is_killed(parity_device):
    from parity.certify.candidate import first_case, of
    from parity.certify.check import CANDIDATE, Call, Job, prepare
    from parity.certify.pool import Worker

    case = first_case(RECURRENT)
    worker = Worker(parity_device, timeout=2)
    prep = prepare(RECURRENT, case, "float32", worker.prep_device)
    try:
        [res] = worker.run(RECURRENT, of(planted_kda.hangs), Job(RECURRENT.name, prep.tensors, dict(case.kwargs),
                                                                 prep.aux, [Call(CANDIDATE), Call(CANDIDATE)]))
    finally:
        worker.close()
    assert res.fault == "the call did not return within 2 s (the worker was killed)" and worker.faults == 1


def test_an_outside_candidate_that_ends_its_process_fails_only_its_op_without_any_flag(tmp_path, capsys, parity_device):
    """No --workers: on the CPU an --impl from outside the project runs in a worker by default (on a
    GPU, one per device already). Its os._exit(13) fails kda.recurrent, named in the certificate,
    and the other op is certified: exit 1, a certificate written."""
    path = tmp_path / "c.json"
    rc = main(["certify", "--device", parity_device, "--ops", "kda.recurrent", "elementwise.silu",
               "--impl", f"kda.recurrent={planted_kda.__file__}:exits", "--candidate", "reference-f32",
               "--dtype", "float32", "--examples", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "worker process(es)" in out
    doc = json.loads(path.read_text())
    by_op = {op["op"]: op for op in doc["ops"]}
    assert by_op["elementwise.silu"]["verdict"] == "certified"
    kda = by_op["kda.recurrent"]
    assert kda["verdict"] == "not certified"
    faults = [c["fault"] for run in kda["runs"].values() for c in run["cases"] if c.get("fault")]
    assert faults and set(faults) == {"the worker process exited with status 13"}, faults


@pytest.mark.parametrize("spec, isolated", [
    ("optimized", False), ("reference-f32", False), ("fla", False),
    ("tests.parity.certify.planted_kda:recurrent", True), ("tests/parity/certify/planted_kda.py:recurrent", True),
    ("optimized.kda:recurrent", False),
])
def test_outside_code_is_isolated_by_default_on_the_cpu_and_the_projects_own_is_not(spec, isolated):
    from parity.certify import Impl, candidate
    from parity.cli.certify import _workers
    from parity.peers import implementations

    if spec in candidate.NAMES:
        cand = candidate.named(RECURRENT, spec)
    elif spec == "fla":
        cand = candidate.of(implementations("fla", "cpu")["kda.recurrent"])
    else:
        cand = candidate.of(candidate.load(spec), spec=spec)
    assert candidate.in_project(cand) is not isolated
    impls = (Impl("kda.recurrent", spec, cand),)
    assert _workers(None, "cpu", impls) == (1 if isolated else None)
    assert _workers(0, "cpu", impls) == 0   # asked for: as asked
