"""Elementwise reference: definitions, stability at large |x|, the softplus threshold.
(Accuracy against 50-digit mpmath is in test_mpmath.py.)"""
import numpy as np
import pytest

from reference.elementwise import sigmoid, silu, softplus


def test_sigmoid_is_finite_and_saturates_without_overflow_warnings():
    x = np.array([-1e308, -800.0, -745.0, -700.0, 0.0, 700.0, 800.0, 1e308])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s = sigmoid(x)
    assert s[0] == 0.0 and s[-1] == 1.0 and s[4] == 0.5
    assert 0.0 < s[3] < 1e-300  # exp(-700) survives as a normal number, not 1 - 1 = 0


def test_sigmoid_is_symmetric():
    x = np.linspace(-40, 40, 801)
    np.testing.assert_allclose(sigmoid(x) + sigmoid(-x), 1.0, rtol=0, atol=4.5e-16)


def test_silu_is_x_times_sigmoid():
    x = np.linspace(-30, 30, 601)
    np.testing.assert_array_equal(silu(x), x * sigmoid(x))
    assert silu(0.0) == 0.0


def test_softplus_threshold_rule():
    # x > threshold returns x exactly; at or below it log(1 + exp(x))
    assert softplus(20.000001) == 20.000001
    np.testing.assert_allclose(softplus(20.0), np.log1p(np.exp(20.0)), rtol=1e-16)
    assert softplus(20.0) != 20.0
    assert softplus(5.0, threshold=4.0) == 5.0
    np.testing.assert_allclose(softplus(50.0, threshold=np.inf), 50.0 + np.log1p(np.exp(-50.0)),
                               rtol=1e-16)


def test_softplus_never_overflows_and_is_positive():
    x = np.array([-1e308, -800.0, -30.0, 0.0, 30.0, 800.0, 1e308])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = softplus(x, threshold=np.inf)
    assert np.all(y >= 0) and y[-1] == 1e308 and y[3] == np.log(2.0)


@pytest.mark.parametrize("fn", [sigmoid, silu, softplus])
def test_float64_out_shape_preserved(fn):
    y = fn(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert y.dtype == np.float64 and y.shape == (2, 3)
    assert np.isnan(fn(np.nan))
