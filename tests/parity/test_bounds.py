"""parity.bounds: unit roundoffs, precision, and properties every model must have."""
import numpy as np
import pytest

from parity import bounds, ops
from parity.bounds.core import gamma, precision_for, unit_roundoff
from parity.certify.check import prepare
from parity.registry import Case


def test_unit_roundoffs_are_those_of_the_dtypes():
    assert unit_roundoff("bfloat16") == 2.0**-8 and unit_roundoff("float16") == 2.0**-11
    assert unit_roundoff("float32") == 2.0**-24 and unit_roundoff("float64") == 2.0**-53


def test_a_bf16_run_stores_at_bf16_computes_in_fp32_and_includes_the_references_rounding():
    p = precision_for("bfloat16", {"o": "bfloat16", "final_state": "float32"})
    assert p.u == 2.0**-8 + 2.0**-53 and p.ua == 2.0**-24 + 2.0**-53
    assert p.uo("o") == 2.0**-8 + 2.0**-53 and p.uo("final_state") == 2.0**-24 + 2.0**-53


def test_truncating_platforms_get_a_full_ulp_per_rounding():
    p = precision_for("bfloat16", {"y": "bfloat16", "w": "float32"}, rounding="toward-zero")
    assert p.u == 2.0**-7 + 2.0**-53 and p.uo("y") == 2.0**-7 + 2.0**-53 and p.uo("w") == 2.0**-24 + 2.0**-53


def test_gamma_is_n_u_over_one_minus_n_u():
    assert gamma(10, 2.0**-24) == pytest.approx(10 * 2.0**-24 / (1 - 10 * 2.0**-24))


@pytest.mark.parametrize("op", ["embed.lm_head", "moe.router_logits", "moe.swiglu", "norm.rms_norm", "moe.experts"])
def test_bounds_follow_magnitudes_no_absolute_floor(op):
    """Scaling a linear-in-magnitude op's inputs by 2 scales its bound by the same factor: nothing
    absolute hides in the model."""
    rec = ops.get(op)
    from hypothesis import given, settings

    seen = []

    @settings(max_examples=1, database=None, derandomize=True)
    @given(rec.inputs())
    def draw(case):
        seen.append(case)

    draw()
    case = seen[0]
    key = {"embed.lm_head": "h", "moe.router_logits": "x", "moe.swiglu": "w_down", "norm.rms_norm": "weight", "moe.experts": "weights"}[op]
    p1 = prepare(rec, case, "float32")
    scaled = Case(dict(case.arrays, **{key: case.arrays[key] * 2}), case.kwargs, case.aux)
    p2 = prepare(rec, scaled, "float32")
    for name in rec.outputs:
        b1 = p1.bound({name: "float32"})[name]
        b2 = p2.bound({name: "float32"})[name]
        np.testing.assert_allclose(b2, 2.0 * b1, rtol=1e-6)


def test_every_model_gives_a_nonnegative_bound_of_the_outputs_shape_and_zero_for_exact_outputs():
    from hypothesis import given, settings

    for rec in ops.records():
        seen = []

        @settings(max_examples=1, database=None, derandomize=True)
        @given(rec.inputs())
        def draw(case):
            seen.append(case)

        draw()
        p = prepare(rec, seen[0], "bfloat16")
        b = p.bound({o: "bfloat16" for o in rec.outputs})
        for o in rec.outputs:
            assert b[o].shape == np.shape(p.ref[o]), (rec.name, o)
            assert np.all(np.isfinite(b[o])) and np.all(b[o] >= 0), (rec.name, o)
            if o in rec.exact:
                assert not np.any(b[o]), (rec.name, o)
        assert bounds  # the package exports the arithmetic
