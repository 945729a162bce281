"""The executor plumbing: choosing an executor, the bf16 -> float64 conversion and the finiteness
check on every core (exact, and equal to the one-pass form on any layout), storage rounding."""
import numpy as np
import pytest

from kimi.storage import all_finite, bf16_bits_to_float64, float_to_bf16_bits
from reference.executor import get_executor, to_numpy


def one_pass(bits):
    return np.left_shift(bits, np.uint32(16), dtype=np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("n", [7, 1 << 16, 3_000_001])  # one block, the smallest task, many tasks
def test_the_threaded_bf16_conversion_is_the_exact_shift_on_any_layout(n):
    bits = float_to_bf16_bits(np.random.default_rng(n).standard_normal(n) * 1e3)
    np.testing.assert_array_equal(bf16_bits_to_float64(bits), one_pass(bits))
    strided = bits[::-1][: n // 2 * 2].reshape(-1, 2).T  # reversed, then transposed: not contiguous
    np.testing.assert_array_equal(bf16_bits_to_float64(strided), one_pass(strided))
    with pytest.raises(TypeError, match="uint16"):
        bf16_bits_to_float64(bits.astype(np.int32))


def test_the_finiteness_check_sees_one_bad_value_in_any_block():
    x = np.ones(3_000_001)
    assert all_finite(x)
    for where in (0, 1_500_000, 3_000_000):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[where] = bad
            assert not all_finite(y), (where, bad)
    assert all_finite(np.full(3_000_001, 3.3e38))  # the largest bf16/f32 magnitudes: the sum stays finite


def test_executors_are_chosen_by_device_and_name_and_errors_name_the_choice():
    assert (get_executor().name, get_executor().device) == ("numpy", "cpu")
    assert get_executor("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N, got 'gpu'"):
        get_executor("gpu")
    with pytest.raises(ValueError, match="expected one of numpy, torch, array-api-strict, got 'cupy'"):
        get_executor("cpu", "cupy")
    with pytest.raises(ValueError, match="runs on cpu only"):
        get_executor("cuda", "numpy")


def test_storage_bits_and_float32_values_become_the_same_float64_on_every_executor():
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    bits = float_to_bf16_bits(values)
    want = one_pass(bits)
    for ex in (get_executor(), get_executor("cpu", "torch")):
        np.testing.assert_array_equal(to_numpy(ex.from_storage(bits, "bfloat16")), want)
        np.testing.assert_array_equal(to_numpy(ex.round_to_storage(ex.asarray(values, dtype=ex.xp.float32),
                                                                   "bfloat16")), want)
        np.testing.assert_array_equal(to_numpy(ex.from_storage(values, "float32")), values.astype(np.float64))
