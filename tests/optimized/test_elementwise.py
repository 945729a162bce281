"""optimized.elementwise: values judged through the registry (``parity.testing.assert_parity``: the
records' bounds, docs/error-bounds.md), on inputs that reach the kernel's edges (signed zeros, the
softplus threshold, exp's range); the threshold rule, any shape and strides, bytes and argument
errors here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import optimized
from optimized import _counters, elementwise
from parity.certify.candidate import of
from parity.testing import assert_parity

DTYPES = ["float32", "bfloat16", "float64"]
NAMES = ["silu", "sigmoid", "softplus"]
LANDMARKS = [0.0, -0.0, 1e-3, -1e-3, 20.0, 20.5, 19.75, -20.0, -40.0, -80.0, 40.0, 80.0, -0.5, 0.5, 3.0, -3.0]


def make_x(n=1031, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n) * 6
    x[:16] = LANDMARKS
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_within_bound(name, dtype):
    assert_parity(f"elementwise.{name}", {"x": make_x()}, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softplus_threshold_rule(dtype, parity_device):
    x = np.array([19.5, 20.0, 20.25, 2.0, 2.5, -30.0])
    for thr in (20.0, 2.25):
        assert_parity("elementwise.softplus", {"x": x}, kwargs={"threshold": thr}, dtype=dtype)
        xt = torch.tensor(x, device=parity_device).to(getattr(torch, dtype))
        above = xt.double() > thr
        assert torch.equal(elementwise.softplus(xt, threshold=thr)[above], xt[above]), \
            "above the threshold softplus must return x itself"


def test_any_shape_noncontiguous_and_empty(parity_device):
    def transposed(x):  # the same values in column-major storage
        xt = x.t().contiguous().t()
        assert not xt.is_contiguous()
        return elementwise.silu(xt)

    assert_parity("elementwise.silu", {"x": make_x(6 * 35).reshape(35, 6)}, candidate=of(transposed, triton=True))
    assert elementwise.sigmoid(torch.empty(0, 3, device=parity_device)).shape == (0, 3)


@pytest.mark.parametrize("name", NAMES)
def test_run_to_run_bitwise_and_counted(name, parity_device):
    x = torch.tensor(make_x(4099, seed=3), device=parity_device).bfloat16()
    before = _counters.snapshot()[f"elementwise.{name}"]
    a, b = getattr(elementwise, name)(x), getattr(elementwise, name)(x)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert _counters.snapshot()[f"elementwise.{name}"] - before == 2


def test_rejects_integer_input_naming_x():
    with pytest.raises(TypeError, match="x"):
        elementwise.silu(torch.arange(4))


@pytest.mark.parity_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large(dtype, parity_device):
    x = make_x(1 << 22)
    for name in NAMES:
        assert_parity(f"elementwise.{name}", {"x": x}, dtype=dtype, device=parity_device)
    assert optimized.backend_info()["cuda"]
