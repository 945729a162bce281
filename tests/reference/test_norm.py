"""Norm reference: definitions, broadcasting over leading dims, errors.
(Accuracy against 50-digit mpmath is in test_mpmath.py.)"""
import numpy as np
import pytest

from reference.elementwise import sigmoid
from reference.norm import gated_rms_norm, l2norm, rms_norm


def test_rms_norm_by_hand():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    y = rms_norm(x, np.array([1.0, 2.0]), eps=0.5)
    # mean(x^2) = 12.5 -> 1/sqrt(13)
    np.testing.assert_allclose(y[0], [3 / 13 ** 0.5, 8 / 13 ** 0.5], rtol=1e-15)
    np.testing.assert_array_equal(y[1], 0.0)


def test_rms_norm_normalizes_each_row_over_the_last_dim():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 16)) * rng.uniform(0.1, 100, (2, 3, 1))
    y = rms_norm(x, np.ones(16), eps=0.0)
    np.testing.assert_allclose(np.mean(y * y, axis=-1), 1.0, rtol=1e-14)


def test_gated_rms_norm_is_rms_norm_times_sigmoid_gate():
    rng = np.random.default_rng(1)
    x, gate, w = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8)), rng.random(8)
    np.testing.assert_array_equal(gated_rms_norm(x, gate, w, eps=1e-5),
                                  rms_norm(x, w, eps=1e-5) * sigmoid(gate))


def test_l2norm_plus_eps_form():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    y = l2norm(x)
    np.testing.assert_allclose(y[0], np.array([3.0, 4.0]) / np.sqrt(25 + 1e-6), rtol=1e-15)
    np.testing.assert_array_equal(y[1], 0.0)  # zero stays zero (no division by zero)
    np.testing.assert_allclose(l2norm(x[0], eps=0.0), [0.6, 0.8], rtol=1e-15)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"rms_norm: weight: expected \[D\]"):
        rms_norm(np.zeros((2, 4)), np.zeros(3), eps=1e-5)
    with pytest.raises(ValueError, match="gated_rms_norm: gate"):
        gated_rms_norm(np.zeros((2, 4)), np.zeros((2, 3)), np.zeros(4), eps=1e-5)
    with pytest.raises(TypeError):
        rms_norm(np.zeros((2, 4)), np.zeros(4))  # eps is required
