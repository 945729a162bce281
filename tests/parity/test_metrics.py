"""parity.metrics: comparisons in units of a bound, failures in their own right, worst elements."""
import math

import numpy as np
import pytest
import torch

from parity.metrics import HostCopy, compare, dtype_of, host_copies, nearer_truth, round_to, to_host, to_numpy, ulp_distance


def test_a_candidate_within_its_bound_passes_with_its_ratio():
    ref = np.array([1.0, -2.0, 4.0])
    c = compare("y", ref, ref + np.array([1e-3, 0, -2e-3]), 1e-2 * np.abs(ref))
    assert c.passed and math.isclose(c.ratio, 0.1)
    assert c.max_abs == pytest.approx(2e-3) and c.cosine > 0.999999


def test_an_element_past_its_bound_fails_and_is_named_with_both_values_and_the_bound():
    ref = np.arange(1.0, 13.0).reshape(3, 4)
    cand = ref.copy()
    cand[2, 1] += 0.5
    c = compare("o", ref, cand, 0.01 * np.abs(ref))
    assert not c.passed and c.n_bad == 1
    assert c.worst[0].index == (2, 1) and c.worst[0].ref == 10.0 and c.worst[0].cand == 10.5
    text = c.report()
    assert "(2, 1)" in text and "10.5" in text and "bound 0.1" in text
    assert str(list(ref.ravel())) not in text   # never the whole tensor


def test_a_nan_where_the_reference_is_finite_is_a_pattern_failure():
    ref = np.ones(5)
    cand = ref.copy()
    cand[3] = np.nan
    c = compare("y", ref, cand, np.full(5, 10.0))   # even a huge bound does not excuse it
    assert not c.passed and math.isinf(c.ratio)
    assert any("NaN/Inf pattern" in f and "(3,)" in f for f in c.failures)


def test_an_inf_of_the_wrong_sign_is_a_pattern_failure():
    ref = np.array([np.inf, 1.0])
    assert not compare("y", ref, np.array([-np.inf, 1.0]), 1.0).passed
    assert compare("y", ref, np.array([np.inf, 1.0]), 1.0).passed


def test_all_zeros_and_constant_outputs_are_degenerate_even_within_a_loose_bound():
    ref = np.linspace(-1e-3, 1e-3, 7)
    zeros = compare("y", ref, np.zeros(7), np.full(7, 1.0))
    const = compare("y", ref, np.full(7, 2e-4), np.full(7, 1.0))
    assert not zeros.passed and any("all zeros" in f for f in zeros.failures)
    assert not const.passed and any("constant" in f for f in const.failures)


def test_a_shape_mismatch_fails():
    c = compare("state", np.zeros((2, 3)), np.zeros((3, 2)), 1.0)
    assert not c.passed and "shape mismatch" in c.failures[0]


def test_an_exact_bound_accepts_only_identical_values():
    ref = np.array([1.0, 2.0])
    assert compare("s", ref, ref.copy(), 0.0).passed
    c = compare("s", ref, ref + [0, 2.0**-51], 0.0)
    assert not c.passed and math.isinf(c.ratio)


def test_ulp_distance_counts_representable_steps_in_the_candidate_dtype():
    one = np.array([1.0])
    assert ulp_distance(one, one + 2.0**-7, "bfloat16")[0] == 1
    assert ulp_distance(-one, one, "bfloat16")[0] == 2 * 0x3F80
    assert ulp_distance(one, one + 2.0**-23, "float32")[0] == 1
    c = compare("y", np.array([1.0, 2.0]), torch.tensor([1.0, 2.015625], dtype=torch.bfloat16), 1.0)
    assert c.ulp == 1


def test_rounding_to_bfloat16_is_to_nearest_even():
    assert round_to(np.array([1.0 + 2.0**-8]), "bfloat16")[0] == 1.0          # tie to even
    assert round_to(np.array([1.0 + 3 * 2.0**-9]), "bfloat16")[0] == 1.0 + 2.0**-7


def test_rms_ratio_is_the_rms_of_the_difference_over_the_rms_of_the_reference():
    ref = np.array([3.0, 4.0])
    c = compare("y", ref, ref + [0.3, 0.4], 1.0)
    assert c.rms_ratio == pytest.approx(0.1)


def test_nearer_truth_names_the_candidate_closer_to_float64():
    t = np.array([1.0, 2.0, 3.0])
    assert nearer_truth(t, t + 1e-3, t + 1e-6)["nearer"] == "b"
    assert nearer_truth(t, t - 1e-6, t + 1e-3)["nearer"] == "a"
    assert nearer_truth(t, t, t)["nearer"] == "tie"


def test_host_copies_hold_the_exact_values_and_remember_the_stored_dtype():
    bf = torch.randn(3, 5).to(torch.bfloat16)
    a, b = host_copies([bf, bf[1:]])
    assert isinstance(a, HostCopy) and a.dtype == np.float64 and dtype_of(a) == "bfloat16"
    assert np.array_equal(to_numpy(a), to_numpy(bf)) and np.array_equal(b, to_numpy(bf[1:]))
    assert dtype_of(a[1:]) == "bfloat16" and type(to_numpy(a)) is np.ndarray and dtype_of(to_numpy(a)) == "float64"
    (ids,) = host_copies([torch.tensor([[3, 1]], dtype=torch.int32)])
    assert ids.dtype == np.int64 and dtype_of(ids) is None and ids.tolist() == [[3, 1]]
    with pytest.raises(ValueError):  # one buffer under every copy of a group: never written
        a[0, 0] = 1.0


def test_to_host_takes_a_traces_device_tensors_to_the_host_and_passes_the_rest_through(parity_device):
    trace = {"h": torch.randn(2, 4, dtype=torch.bfloat16, device=parity_device),
             "ids": torch.tensor([[1, 2], [3, 4]], device=parity_device),
             "s": torch.rand(2, 3, dtype=torch.bfloat16, device=parity_device), "np": np.ones(3)}
    host = to_host(trace)
    assert list(host) == list(trace) and host["np"] is trace["np"]
    for k in ("h", "ids", "s"):
        assert np.array_equal(to_numpy(host[k]), to_numpy(trace[k])) and dtype_of(host[k]) == dtype_of(trace[k])
        if trace[k].device.type == "cpu":  # a host tensor passes through
            assert host[k] is trace[k]
        else:  # a device tensor comes back as a host copy (a NumPy array: its .device is "cpu")
            assert isinstance(host[k], HostCopy) and not hasattr(host[k], "detach")
