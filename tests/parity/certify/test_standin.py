"""The machinery against the stand-in (the reference evaluated at float32 arithmetic, parity.emulate):
every op within its bound at lifted and production precision, every mutant killed with its teeth
ratio printed, and the all-zeros and NaN controls rejected for every op."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis import target

from parity import ops
from parity.certify import certify_op, cpu_threads
from parity.certify.candidate import rowwise
from parity.certify.check import check, prepare
from parity.mutants import CONTROLS

OPS = ops.names()


@pytest.fixture(autouse=True, scope="module")
def one_thread(parity_device):
    with cpu_threads(parity_device):
        yield


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_the_float32_stand_in_is_within_the_bound_on_drawn_inputs(op, dtype, parity_device):
    rec = ops.get(op)
    cand = rec.candidate(rec.emulated)

    @given(st.data())
    def within(data):
        case = data.draw(rec.inputs(), label="case")
        j = check(prepare(rec, case, dtype, parity_device), cand)
        target(min(j.ratio, 1e300), label="error in bound units")
        assert j.passed, f"{op} [{dtype}] {case.label}\n{j.report()}"

    within()


@pytest.mark.parametrize("op", OPS)
def test_the_stand_in_certifies_and_every_mutant_is_killed(op):
    cert = certify_op(ops.get(op), candidate="reference-f32", dtypes=("float32", "bfloat16"), examples=2)
    teeth = cert.teeth()
    print(f"{op}: " + ", ".join(f"{m} {t:.3g}" for m, t in teeth.items()))
    assert cert.certified, "\n".join(cert.reasons())
    assert all(t > 1 for t in teeth.values())
    assert set(cert.reached()) == {"bytes", "lifted", "production"}


@pytest.mark.parametrize("op", OPS)
def test_an_all_zeros_and_a_nan_candidate_fail_for_every_op(op, parity_device):
    rec = ops.get(op)

    @given(rec.inputs())
    def rejected(case):
        for dtype in ("float32", "bfloat16"):
            prep = prepare(rec, case, dtype, parity_device)
            for name, make in CONTROLS.items():
                j = check(prep, make(rec, prep))
                assert not j.passed, f"{op} [{dtype}]: the {name} candidate passed"
                assert math.isinf(j.ratio) or any(c.failures for c in j.outputs.values())

    rejected()


def test_the_stand_in_is_evaluated_row_by_row_for_batch_invariance():
    rec = ops.get("moe.experts")
    x = torch.randn(3, 4)
    calls = []

    def cand(inp, kw):
        calls.append(inp["x"].shape[0])
        return {"y": inp["x"]}

    out = rowwise(rec, cand)({"x": x, "weights": x, "ids": x}, {})
    assert calls == [1, 1, 1] and torch.equal(out["y"], x)
