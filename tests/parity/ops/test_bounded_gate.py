"""The bounded KDA gate on the parity side: its records (``+lower_bound``), its bound (sigmoid's
saturation, the underflow where the bound turns absolute, the product with b), the hostile KDA
inputs both gates draw, ``parity certify --variant kda_gate=...``, and fla's safe-gate calls as
``parity watch`` maps them. The kernels' certification under both gates is tests/parity/
certify/test_optimized.py's (every record), the stand-in's test_standin.py's. About 20 s on 2 cores."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from parity import ops
from parity.bounds.core import precision_for
from parity.ops.kda import BOUNDED, GATES, bounds, inputs, under_gate
from parity.ops.kda.inputs import HOSTILE, core_case, make_hostile
from reference import kda as rkda

from ..diff_helpers import run_cli

GATED = ("kda.gate", "kda.fused_recurrent", "kda.fused_chunked", "kda.fused_recurrent_decode")


def test_each_op_that_computes_the_gate_has_a_record_of_each_gate_on_the_same_op():
    for name in GATED:
        soft, bnd = ops.get(name), ops.get(name + "+lower_bound")
        assert GATES[name] == {"softplus": name, "lower_bound": bnd.name}
        assert (soft.gate, bnd.gate) == ("softplus", "lower_bound")
        assert bnd.reference is soft.reference and bnd.optimized == soft.optimized
        assert bnd.counter_name == name and bnd.outputs == soft.outputs
        names = {m.name for m in bnd.mutants}
        assert {"softplus_gate_on_bounded", "wrong_bound_value", "clamped_softplus"} <= names
    assert {r.name for r in BOUNDED} == {n + "+lower_bound" for n in GATED}
    assert ops.get("kda.chunked").gate is None   # takes the gate's output


@settings(max_examples=8, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(ops.get("kda.fused_chunked+lower_bound").inputs())
def test_the_bounded_records_draw_b_in_its_range_and_sometimes_no_A_log(case):
    assert case.kwargs["lower_bound"] in inputs.LOWER_BOUNDS
    assert -5.0 <= case.kwargs["lower_bound"] < 0


def _precision(dtype="float32"):
    return precision_for(dtype, {"g": "float32"})


def test_the_bounded_gate_bound_is_relative_where_sigmoid_saturates_and_absolute_where_it_underflows():
    """g_raw of +60 (sigmoid 1: g = b), 0 and -120 (sigmoid e^-120, below float32's range)."""
    g_raw = np.array([60.0, 0.0, -120.0, -3.0]).reshape(1, 1, 1, 4)
    A_log, dt, b = np.zeros(1), np.zeros(4), -5.0
    p = _precision()
    g = rkda.gate(g_raw, A_log, dt, lower_bound=b)
    err = bounds.bounded_gate_err(g_raw, A_log, dt, b, p, p.uo("g"))
    assert g[0, 0, 0, 0] == b and err[0, 0, 0, 0] < 8 * 2.0 ** -24 * 5      # a few ulp of b, nothing of |y|
    tiny = 2.0 ** -126
    assert abs(g[0, 0, 0, 2]) < 1e-50 and err[0, 0, 0, 2] == pytest.approx(2 * 5 * tiny, rel=1e-6)
    # a kernel that flushes the underflowed gate to 0 is within it; one that is off by 1e-5 of |g| is not
    assert abs(0.0 - g[0, 0, 0, 2]) <= err[0, 0, 0, 2]
    assert 1e-5 * abs(g[0, 0, 0, 3]) > err[0, 0, 0, 3]


def test_the_fused_ops_take_the_bounded_gates_error_as_their_gate_perturbation():
    case = core_case(1, 20, 1, 1, 16, 16, 2, chunk=16, fused=True, lower_bound=-5.0)
    rec = ops.get("kda.fused_chunked+lower_bound")
    ref = dict(zip(rec.outputs, rec.reference(*[case.arrays[n] for n in rec.args], **case.kwargs,
                                               initial_state=case.arrays["initial_state"])))
    p = precision_for("float32", {"o": "float32", "final_state": "float32"})
    b = rec.bound(case.arrays, case.kwargs, ref, p)
    soft = rec.bound(case.arrays, {k: v for k, v in case.kwargs.items() if k != "lower_bound"}, ref, p)
    assert np.all(np.isfinite(b["o"])) and not np.allclose(b["o"], soft["o"])


@pytest.mark.parametrize("fused", [False, True])
def test_the_hostile_inputs_are_what_they_say(fused):
    T, K = 70, 32
    for kind in HOSTILE[1:]:
        c = core_case(1, T, 1, 1, K, 16, 5, chunk=32, fused=fused, hostile=kind, run=64,
                      lower_bound=-5.0 if fused else None)
        k = c.arrays["k"][0, :, 0]
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        cos = k @ k.T
        if kind in ("identical", "neumann"):
            assert (np.isclose(cos, 1.0, atol=1e-12).sum(1) >= 64).sum() >= 64       # 64 identical keys
        if kind == "collinear":
            assert ((cos > 1 - 1e-5).sum(1) >= 64).sum() >= 64 and not np.all(np.isclose(cos, 1.0, atol=1e-12))
        if kind in ("beta", "neumann"):
            beta = c.arrays["beta_logits"] if fused else c.arrays["beta"]
            assert np.all(beta == (8.0 if fused else 1 / (1 + np.exp(-8.0))))
        if kind == "neumann" and fused:
            g = rkda.gate(c.arrays["g_raw"], c.arrays["A_log"], c.arrays["dt_bias"], lower_bound=-5.0)
            assert np.allclose(g, -5.0 / (1 + np.exp(12.0)))                       # decay ~1: nothing forgets
        if kind == "bound" and fused:
            g = rkda.gate(c.arrays["g_raw"], c.arrays["A_log"], c.arrays["dt_bias"], lower_bound=-5.0)
            assert np.all(g[..., :K // 2] >= -5.0) and np.allclose(g[..., :K // 2], -5.0, rtol=1e-12)
            assert np.all(g[..., K // 2:] > -5.0) and np.all(g[..., K // 2:] < -4.9)
        assert kind in c.label


def test_the_certification_inputs_of_both_gates_draw_every_hostile_kind():
    seen = {n: set() for n in ("kda.chunked", "kda.fused_chunked", "kda.fused_chunked+lower_bound")}

    for name in seen:
        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(ops.get(name).inputs())
        def draw(case):
            seen[name].update(h for h in HOSTILE[1:] if h and f" {h}" in case.label)

        draw()
        assert seen[name] == set(HOSTILE[1:]), (name, seen[name])


def test_make_hostile_leaves_a_t_shorter_than_the_run_whole():
    r = np.random.default_rng(0)
    a = core_case(1, 10, 1, 1, 8, 8, 1).arrays
    make_hostile(a, r, "identical", 64, fused=False)
    k = a["k"][0, :, 0]
    assert np.allclose(k, k[0])


def test_under_gate_maps_the_gated_ops_and_pins_b():
    recs = [ops.get(n) for n in ("kda.gate", "kda.chunked", "kda.fused_chunked+lower_bound")]
    soft = under_gate(recs, None)
    assert [r.name for r in soft] == ["kda.gate", "kda.chunked", "kda.fused_chunked"]
    pinned = under_gate(recs, -2.0)
    assert [r.name for r in pinned] == ["kda.gate+lower_bound", "kda.chunked", "kda.fused_chunked+lower_bound"]

    @settings(max_examples=4, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(pinned[0].inputs())
    def draw(case):
        assert case.kwargs["lower_bound"] == -2.0 and "lb-2 " in case.label + " "

    draw()


def test_certify_under_a_gate_variant(tmp_path, capsys):
    out = tmp_path / "c.json"
    rc, stdout, err = run_cli(capsys, "certify", "--device", "cpu", "--ops", "kda.gate", "--dtype", "float32",
                              "--candidate", "reference-f32", "--examples", "1", "--variant", "kda_gate=lower_bound:-2",
                              "--json", str(out))
    assert rc == 0, stdout + err
    doc = json.loads(out.read_text())
    assert doc["variants"] == {"kda_gate": "lower_bound:-2"} and [o["op"] for o in doc["ops"]] == ["kda.gate+lower_bound"]
    assert doc["ops"][0]["gate"] == "lower_bound" and all("lb-2" in s for s in doc["ops"][0]["shapes"])
    for bad in ("kda_gate=lower_bound:-7", "kda_gate=tanh", "moe_combine=biased"):
        rc, stdout, err = run_cli(capsys, "certify", "--device", "cpu", "--ops", "kda.gate", "--variant", bad)
        assert rc == 2 and err.startswith("error: --variant") and err.count("\n") == 1, err


def test_fla_safe_gate_calls_map_to_the_bounded_records():
    from parity.peers import fla
    from parity.record.watch.adapters import Mismatch

    def call(**kw):
        a = dict(q=1, k=2, v=3, g=4, beta=5, A_log=6, dt_bias=7, output_final_state=True)
        a.update(kw)
        return a

    fused = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    m = fla.chunk_kda_reverse(call(**fused, safe_gate=True, lower_bound=-5.0))
    assert m.op == "kda.fused_chunked+lower_bound" and m.kwargs["lower_bound"] == -5.0 and "safe_gate" in m.note
    assert m.inputs["g_raw"] == 4 and m.inputs["A_log"] == 6
    m = fla.chunk_kda_reverse(call(**fused, A_log=None, lower_bound=-3.0))
    assert m.op == "kda.fused_chunked+lower_bound" and "no A_log" in m.note
    m = fla.fused_recurrent_kda_reverse(call(**fused, lower_bound=-5.0))
    assert m.op == "kda.fused_recurrent+lower_bound"
    m = fla.chunk_kda_reverse(call(safe_gate=True, lower_bound=-5.0))   # gates given: the core op
    assert m.op == "kda.chunked" and "safe_gate" in m.note and "lower_bound" not in m.kwargs
    with pytest.raises(Mismatch, match="lower_bound"):
        fla.chunk_kda_reverse(call(use_gate_in_kernel=True, safe_gate=True))
    with pytest.raises(Mismatch, match="A_log"):
        fla.chunk_kda_reverse(call(**fused, A_log=None))
