"""One float64 reference, several executors: every registered op and the logits of the tiny, small
and medium models agree between NumPy and torch float64 to 1e-12 (normwise relative), on the CPU
in CI and on CUDA where a GPU is present; array-api-strict runs every op, proving the reference
calls nothing outside the array API standard.

Agreement measure: ``max|a - b| / max|b|`` per output (exact equality for integer outputs)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import reference
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from parity import ops
from reference.executor import get_executor, to_numpy

TOL = 1e-12
DEVICES = [pytest.param("cpu", id="torch-cpu"),
           pytest.param("cuda", id="torch-cuda", marks=pytest.mark.skipif(
               "not __import__('torch').cuda.is_available()", reason="needs a CUDA device"))]
def _ops():
    return [r.name for r in ops.records()]


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype.kind in "iub":
        return 0.0 if np.array_equal(a, b) else np.inf
    assert np.array_equal(np.isfinite(a), np.isfinite(b)), "NaN/Inf patterns differ"
    a, b = a[np.isfinite(b)], b[np.isfinite(b)]
    scale = np.abs(b).max(initial=0.0)
    return float(np.abs(a - b).max(initial=0.0) / scale) if scale else float(np.abs(a).max(initial=0.0))


def on(ex, value):
    """A NumPy case input on executor ``ex`` (float64 or int64); other values unchanged."""
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
        return ex.asarray(value, dtype=ex.xp.int64 if kind in "iu" else (ex.xp.bool if kind == "b" else None))
    return value


def run_op(rec, ex, case):
    inputs = {k: on(ex, v) for k, v in case.arrays.items()}
    out = rec.call(rec.reference, inputs, dict(case.kwargs))
    return {k: to_numpy(v) for k, v in out.items()}


def assert_agrees(rec, ex, case):
    want = run_op(rec, get_executor(), case)
    got = run_op(rec, ex, case)
    for name in want:
        err = rel(got[name], want[name])
        assert err <= TOL, f"{rec.name}.{name} on {ex.describe()}: rel {err:.3g} > {TOL} ({case.label})"


# a few examples per op (the ops' own tests cover the shapes); no shrinking: a failure is reported
# as drawn
FEW = dict(deadline=None, phases=[Phase.explicit, Phase.generate],
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", _ops())
@settings(max_examples=3, **FEW)
@given(data=st.data())
def test_every_registered_op_agrees_on_torch_and_numpy(op, device, data):
    rec = ops.get(op)
    assert_agrees(rec, get_executor(device, "torch"), data.draw(rec.inputs()))


@pytest.fixture(scope="module")
def strict():
    xp = pytest.importorskip("array_api_strict")
    with xp.ArrayAPIStrictFlags(api_version="2024.12"):
        yield get_executor("cpu", "array-api-strict")


@pytest.mark.parametrize("op", _ops())
@settings(max_examples=2, **FEW)
@given(data=st.data())
def test_every_registered_op_runs_on_array_api_strict(op, strict, data):
    rec = ops.get(op)
    assert_agrees(rec, strict, data.draw(rec.inputs()))


def test_the_agreement_check_fails_on_a_planted_difference_and_degenerate_outputs():
    b = np.linspace(1.0, 2.0, 50)
    assert rel(b * (1 + 1e-15), b) <= TOL
    assert rel(b * (1 + 1e-9), b) > TOL
    for bad in (np.zeros_like(b), np.full_like(b, 1.5), np.where(b > 1.5, np.nan, b)):
        with pytest.raises(AssertionError) if np.isnan(bad).any() else _no_raise():
            assert rel(bad, b) > TOL
    assert rel(np.array([1, 2]), np.array([1, 3])) == np.inf


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- whole models ------------------------------------------------------------------------------------

PRESETS = {"tiny": 24, "small": 12, "medium": 4}  # prompt tokens (each a few seconds on 2 cores)


@pytest.fixture(scope="module", params=list(PRESETS))
def preset(request):
    return request.param


@pytest.fixture(scope="module")
def numpy_run(preset):
    """NumPy logits: forward over the prompt + 2 tokens, prefill of the prompt, then 2 decode steps."""
    cfg = KimiConfig.from_name(preset)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, PRESETS[preset] + 2)
    return ids, _logits(reference.load(SyntheticSource(cfg, 0)), ids)


def _logits(model, ids):
    T = len(ids) - 2
    out = {"forward": to_numpy(model.forward(ids))}
    logits, cache = model.prefill(ids[:T])
    out["prefill"] = to_numpy(logits)
    for t in range(T, len(ids)):
        step, cache = model.decode(int(ids[t]), cache)
        out[f"decode{t - T}"] = to_numpy(step)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_model_logits_agree_on_torch_and_numpy(preset, numpy_run, device):
    ids, want = numpy_run
    model = reference.load(SyntheticSource(KimiConfig.from_name(preset), 0), device=device, executor="torch")
    got = _logits(model, ids)
    for call in want:
        err = rel(got[call], want[call])
        assert err <= TOL, f"{preset} {call} on torch {device}: rel {err:.3g}"


def test_a_non_finite_weight_is_named_on_the_torch_executor_and_never_used_again():
    from kimi.checkpoint import CheckpointError

    bad_name = "model.layers.1.self_attn.q_proj.weight"

    class Corrupt(SyntheticSource):
        def get_raw(self, name):
            raw = super().get_raw(name)
            if name == bad_name:
                raw = raw.copy()
                raw.flat[5] = 0x7FC0  # a bf16 NaN
            return raw

    model = reference.load(Corrupt(KimiConfig.from_name("tiny"), 0), executor="torch")
    for _ in range(2):  # checked at the end of the call: the second call reads it again, not from the cache
        with pytest.raises(CheckpointError, match=rf"{bad_name}: 1 non-finite values \(first at index \(0, 5\)"):
            model.forward([1, 2])
