"""Certifying outside implementations (``parity certify --impl``): the implementation named in the
certificate, its calls and outputs witnessed, arithmetic contracts, the nearest known bug of a
failure, bad input as one-line errors, and fla-core's torch recurrences on the CPU (its Triton
kernels on a GPU). Small shapes and one or two inputs per dtype: the mechanism, cheaply."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parity import ops, schema
from parity.bounds.core import CONTRACTS, precision_for, weaker_contracts
from parity.certify import certify_op, cpu_threads, fingerprint
from parity.certify.candidate import first_case, of
from parity.certify.check import own_outputs, prepare
from parity.cli import main
from parity.errors import CandidateError

from . import planted_kda
from .cli_errors import assert_certify_refuses

HERE = Path(__file__).parent
PLANTED = str(HERE / "planted_kda.py")
RECURRENT = ops.get("kda.recurrent")
PARITY = os.path.join(os.path.dirname(sys.executable), "parity")


def _certify(fn, dtypes=("float32",), examples=2, record=RECURRENT, *, device, **kw):
    with cpu_threads(device):
        return certify_op(record, candidate=fn, dtypes=dtypes, examples=examples, device=device, **kw)


# -- fla-core's kernels on a GPU (the longest tests, first) ----------------------------------------------
# one op a test, so pytest-xdist spreads them (together they ran past check_gpu.sh's per-file limit);
# chunk_kda's safe-gate path, the longest, has a file of its own (test_certify_fla_chunked.py).
def test_fla_adapters_declare_what_fla_cores_source_does():
    from parity.peers import fla

    cuda = fla.implementations("cuda")
    assert {op: fn.parity_contract for op, fn in cuda.items()} == {
        "kda.gate": "ieee", "kda.recurrent": "ieee", "kda.chunked": "tf32", "kda.fused_recurrent": "ieee",
        "kda.fused_chunked": "tf32", "norm.l2norm": "ieee", "norm.gated_rms_norm": "ieee",
        "kda.gate+lower_bound": "ieee", "kda.fused_recurrent+lower_bound": "ieee",
        "kda.fused_chunked+lower_bound": "tf32"}
    assert all(fn.parity_wraps.startswith("fla.") for fn in cuda.values())
    # fla's kernels compute either gate: none declares one (the safe-gate path is chunk_kda's)
    assert all(getattr(fn, "parity_gate", None) is None for fn in cuda.values())


@pytest.mark.parity_gpu
@pytest.mark.parametrize("op,dtypes", [("kda.gate+lower_bound", ("float32", "bfloat16")),
                                       ("kda.fused_recurrent+lower_bound", ("float32", "bfloat16"))])
def test_fla_cores_bounded_gate_kernels_on_a_gpu(op, dtypes, parity_device):
    """fused_kda_gate and fused_recurrent_kda with lower_bound, under the bounded gate's bound."""
    from parity.peers import implementations

    fn = implementations("fla", parity_device)[op]
    with cpu_threads(parity_device):
        cert = certify_op(ops.get(op), candidate=fn, dtypes=dtypes, examples=6, device=parity_device)
    assert cert.certified, (op, cert.contract_summary(), cert.reasons())


@pytest.mark.parity_gpu
def test_fla_cores_triton_kernels_on_a_gpu(parity_device):
    """fla-core's kernels on the GPU under their declared contracts. Its fused_kda_gate is not within
    ieee: its softplus is lg2.approx(1 + ex2.approx(x)) (fla/ops/utils/softplus.py), whose error is
    absolute, so a small gate -exp(A_log) softplus(x) (x << 0) errs by percents of itself."""
    from parity.peers import implementations

    fns = implementations("fla", parity_device)
    with cpu_threads(parity_device):
        for op in ("kda.recurrent", "norm.l2norm", "norm.gated_rms_norm"):
            cert = certify_op(ops.get(op), candidate=fns[op], dtypes=("float32", "bfloat16"), examples=4, device=parity_device)
            assert cert.certified, (op, cert.contract_summary(), cert.reasons())
        gate = certify_op(ops.get("kda.gate"), candidate=fns["kda.gate"], dtypes=("float32",), examples=4,
                          device=parity_device)
        assert not gate.certified and gate.runs["float32"].worst_ratio > 100, gate.reasons()
        assert "fails ieee at float32" in gate.contract_summary()


# -- the mechanism -------------------------------------------------------------------------------------
def test_a_correct_outside_implementation_is_certified_and_named(parity_device):
    cert = _certify(planted_kda.recurrent, dtypes=("float32", "bfloat16"), device=parity_device)
    assert cert.certified, cert.reasons()
    d = cert.to_dict()
    impl = d["implementation"]
    assert (impl["module"], impl["function"]) == ("tests.parity.certify.planted_kda", "recurrent")
    assert impl["file"].endswith("planted_kda.py") and impl["git"]["revision"] and impl["adapter"] is None
    assert d["contract"] == "ieee" and d["contract_verdict"].startswith("holds ieee at float32")
    assert all(r["kernel_ran"] is True for r in d["runs"].values())   # called, fresh, honest outputs
    assert d["nearest_bug"] is None and schema.errors({"ops": [d]}, _op_schema()) == []


def _op_schema():
    s = schema.load()
    return {"$defs": s["$defs"], "type": "object", "properties": {"ops": {"type": "array", "items": {"$ref": "#/$defs/op"}}}}


@pytest.mark.parametrize("bug, nearest", [
    ("state_v_major", "state_stored_transposed"),
    ("beta_dropped", "beta_dropped"),
    ("empty_on_branch", None),
    ("garbage_rows", None),
])
def test_each_replayed_bug_is_not_certified_and_named_where_a_mutant_fits(bug, nearest, parity_device):
    cert = _certify(getattr(planted_kda, bug), device=parity_device)
    assert not cert.certified
    found, scores = cert.nearest_bug()
    print(bug, scores)
    if nearest is None:
        assert found is None and max(scores.values(), default=0.0) < fingerprint.THRESHOLD
    else:
        assert found["mutant"] == nearest and found["similarity"] > 0.95 and not found["ties"]
    # no weaker contract excuses a bug
    assert cert.runs["float32"].contract_verdict()["consistent_with"] is None


@pytest.mark.parity_gpu
def test_memory_the_allocator_holds_free_reads_nan_when_a_candidate_runs(parity_device):
    """On CUDA an output never written (``empty_on_branch``) is the last freed block of its size: the
    output certify itself just computed on that input (the mutant output_before_update ran last),
    which the fingerprint then named with similarity 1. The free blocks are poisoned first."""
    from parity.certify.check import poison_free_memory

    x = torch.full((3000,), 1.5, device=parity_device)
    del x
    poison_free_memory(parity_device)
    assert torch.isnan(torch.empty(3000, device=parity_device)).all()


def test_outputs_that_are_not_the_implementations_own_are_refused(parity_device):
    """An l2norm that normalizes its input in place is right to the last bit and still not
    certified: its output is the memory it was handed. So is one answering NaN where the
    reference is finite, and an output that is the reference's own array."""
    l2 = ops.get("norm.l2norm")

    def in_place(x, *, eps=1e-6):
        return x.div_(torch.sqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype))

    cert = _certify(in_place, record=l2, examples=1, device=parity_device)
    assert cert.runs["float32"].passed and not cert.certified
    assert any("is the memory of input x" in r for r in cert.reasons())

    prep = prepare(l2, first_case(l2), "float32", parity_device)
    inputs = prep.inputs()
    assert own_outputs(prep, inputs, {"y": torch.from_numpy(prep.ref["y"])}) == \
        "output y is the memory of the reference's y"
    nan = torch.full(prep.ref["y"].shape, float("nan"))
    assert "non-finite" in own_outputs(prep, inputs, {"y": nan})
    assert own_outputs(prep, inputs, {"y": torch.tensor(prep.ref["y"], dtype=torch.float32)}) is None


def test_a_wrong_signature_or_output_is_refused_before_any_run(parity_device):
    for name, needle in (("wrong_signature", "not the signature of kda.recurrent"),
                         ("wrong_shape", "output o has shape (2, 19, 1, 32), expected (2, 20, 1, 32)"),
                         ("wrong_dtype", "output o is float16, expected float32 or a wider float")):
        with pytest.raises(CandidateError) as err:
            _certify(getattr(planted_kda, name), device=parity_device)
        assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CandidateError, match="contract: expected one of ieee, tf32, bf16-storage"):
        of(planted_kda.recurrent, contract="fp8")


# -- arithmetic contracts -------------------------------------------------------------------------------
def test_contracts_only_ever_widen_the_bounds_and_ieee_is_what_it_was(parity_device):
    """Under IEEE a matrix product reads its operands as held (udot 0): the bounds are the ones every
    other test holds the kernels to. Each weaker contract's bounds contain the stronger's, for every
    output of ops with matrix products in their models."""
    p = precision_for("float32")
    assert (p.contract, p.udot, p.uop(False), p.uop(True)) == ("ieee", 0.0, 0.0, p.u)
    assert precision_for("bfloat16", contract="tf32").uop(True) == precision_for("bfloat16").u   # bf16 is exact in TF32
    assert precision_for("float32", contract="tf32").uop(False) == 2.0 ** -10
    assert list(CONTRACTS) == ["ieee", *weaker_contracts("ieee")]
    for op in ("kda.recurrent", "kda.chunked", "mla.naive", "moe.swiglu", "embed.lm_head"):
        rec = ops.get(op)
        prep = prepare(rec, first_case(rec), "float32", parity_device)
        dt = {n: "float32" for n in rec.outputs}
        bounds = [prep.bound(dt, c) for c in CONTRACTS]
        for a, b in zip(bounds, bounds[1:]):
            for n in rec.outputs:
                assert np.all(b[n] >= a[n]), (op, n)
        assert any(np.any(bounds[1][n] > bounds[0][n]) for n in rec.outputs), op


def test_a_failure_names_the_weaker_contract_it_is_consistent_with(parity_device):
    """A recurrence whose products read TF32 operands fails IEEE by two orders of magnitude at
    float32; the certificate says it is consistent with tf32, and it is certified when it claims
    tf32 (declared by its adapter, or on the command line)."""
    cert = _certify(planted_kda.tf32_dots, device=parity_device)
    v = cert.runs["float32"].contract_verdict()
    assert not v["holds"] and v["worst_ratio"] > 50
    assert v["consistent_with"]["contract"] == "tf32" and v["consistent_with"]["ratio"] < 1
    assert "fails ieee at float32 by" in cert.contract_summary() and "consistent with tf32 at" in cert.contract_summary()
    assert not cert.certified
    declared = _certify(planted_kda.tf32_declared, device=parity_device)
    assert declared.certified and declared.contract == "tf32", declared.reasons()
    assert _certify(planted_kda.tf32_dots, contract="tf32", device=parity_device).certified


# -- the command line -------------------------------------------------------------------------------
def test_the_command_certifies_a_correct_implementation_and_exits_0(tmp_path, parity_device):
    path = tmp_path / "c.json"
    out = subprocess.run([PARITY, "certify", "--ops", "kda.recurrent", "--impl", f"kda.recurrent={PLANTED}:recurrent",
                          "--device", parity_device, "--dtype", "float32", "bfloat16", "--examples", "2", "--json", str(path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PARITY_HYPOTHESIS_PROFILE="ci"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "implementation: planted_kda:recurrent" in out.stdout and "holds ieee at bfloat16" in out.stdout
    doc = json.loads(path.read_text())
    assert schema.errors(doc) == [] and doc["impls"] == {"kda.recurrent": f"{PLANTED}:recurrent"}
    assert doc["ops"][0]["implementation"]["function"] == "recurrent" and doc["summary"]["verdict"] == "certified"


def test_the_command_exits_1_on_a_bug_and_names_it(tmp_path, capsys, parity_device):
    path = tmp_path / "c.json"
    rc = main(["certify", "--impl", f"kda.recurrent={PLANTED}:state_v_major", "--device", parity_device,
               "--dtype", "float32", "--examples", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 1 and "nearest known bug: state_stored_transposed" in out
    op = json.loads(path.read_text())["ops"][0]
    assert op["nearest_bug"]["mutant"] == "state_stored_transposed" and op["verdict"] == "not certified"


@pytest.mark.parametrize("args, needle", [
    (["--impl", "kda.recurrent=no_such_module_here:f"], "cannot import no_such_module_here"),
    (["--impl", f"kda.recurrent={HERE}/nosuch.py:f"], "no such file"),
    (["--impl", f"kda.recurrent={PLANTED}:wrong_signature"], "not the signature of kda.recurrent"),
    (["--impl", f"kda.recurrent={PLANTED}:wrong_shape"], "output o has shape"),
    (["--impl", f"kda.recurrent={PLANTED}:wrong_dtype"], "output o is float16"),
    (["--impl", f"kda.nosuch={PLANTED}:recurrent"], "unknown op 'kda.nosuch'"),
    (["--impl", f"kda.recurrent={PLANTED}:recurrent", "--contract", "tf64"], "invalid choice: 'tf64'"),
    (["--ops", "kda.gate", "--impl", f"kda.recurrent={PLANTED}:recurrent"], "not among --ops"),
    (["--impl", "nosuchpeer"], "expected OP=module:function"),
])
def test_bad_implementations_are_one_line_errors_exit_2(args, needle, capsys, parity_device):
    assert_certify_refuses(args, needle, capsys, parity_device)


# -- fla-core, the first outside implementation ------------------------------------------------------
@pytest.mark.parity_interpreter  # fla-core's CPU path: as on a machine without a GPU
def test_fla_cores_torch_recurrences_are_certified_on_the_cpu(parity_device):
    """``--impl fla`` on the CPU: fla-core's own torch recurrences (its Triton kernels need a GPU),
    named with their package and version and the adapter that fits them. Its bounded gate
    (naive_kda_lowerbound_gate) is within its bound, and on some CPUs not batch invariant: torch's
    CPU sigmoid takes another code path for the tail of a vectorized loop, which moves with the
    batch (1 ulp where it happens; an AMD EPYC gives batch-invariant bits)."""
    pytest.importorskip("fla", reason="fla-core is not installed (pip install 'kimi-parity[peers]')")
    from parity.peers import implementations

    impls = implementations("fla", parity_device)
    assert set(impls) == {"kda.gate", "kda.recurrent", "kda.chunked", "kda.gate+lower_bound"}
    for op, fn in impls.items():
        cert = _certify(fn, dtypes=("float32", "bfloat16"), examples=1, record=ops.get(op), device=parity_device)
        if op == "kda.gate+lower_bound":
            assert all(r.contract_verdict()["holds"] for r in cert.runs.values()), cert.contract_summary()
            assert all("bytes: batch of 1 of 2 differs in ['g']" in w for w in cert.reasons()), cert.reasons()
        else:
            assert cert.certified, (op, cert.reasons())
        impl = cert.implementation
        assert (impl["package"], impl["version"]) == ("fla-core", "0.6.0") and impl["git"]["revision"] is None
        assert impl["adapter"]["module"] == "parity.peers.fla"


@pytest.mark.parity_gpu
def test_a_candidate_that_faults_the_gpu_fails_only_its_inputs(parity_device):
    """A CUDA fault poisons its worker's context: the faulting inputs are faults with one-line
    errors, the worker is replaced, and the op after it is certified."""
    from parity.certify import certify

    certs = certify([ops.get("kda.recurrent"), ops.get("norm.l2norm")], dtypes=("float32",), device=parity_device,
                    examples=1, impls={"kda.recurrent": planted_kda.faults}, workers=1,
                    candidate="reference-f32")
    faults = certs[0].faults()
    assert not certs[0].certified and faults, certs[0].reasons()
    assert all("CUDA" in f["error"] and "\n" not in f["error"] and f["shapes"]["q"] for f in faults), faults
    assert certs[1].certified, certs[1].reasons()
