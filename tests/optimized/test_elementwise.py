"""optimized.elementwise against the float64 reference, in units of a derived error bound.

Bound model (per element, r = reference value on the same input values):
    |out - r| <= (rho_o + c * (|x| + 1) * u_c) * |r| + tiny
u_c: unit roundoff of the compute dtype (fp32 2^-24; fp64 2^-53). The kernels compute exp of -|x|,
whose argument reduction on a GPU costs a relative error ~|x| u_c; the divisions, log and products
add a few u_c (c = 8). rho_o: the final rounding to the output dtype (0 when it is the compute
dtype; bf16: u = 2^-8 with round-to-nearest, one ulp 2u under an interpreter that truncates).
tiny: the output dtype's smallest normal (underflow).
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import optimized
from optimized import _counters, elementwise

from ._bounds import DEV, DTYPES, u_compute, rho_triton, assert_within


def reference_op(name):
    """The float64 reference op (NumPy in, NumPy out) as a torch float64 function."""
    fn = getattr(importlib.import_module("reference.elementwise"), name)
    return lambda x, **kw: torch.from_numpy(np.asarray(fn(x.detach().to(torch.float64).cpu().numpy(), **kw)))


def make_x(dtype, n=1031, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 6
    x[:16] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 20.0, 20.5, 19.75, -20.0, -40.0, -80.0, 40.0, 80.0,
                           -0.5, 0.5, 3.0, -3.0], dtype=torch.float64)
    return x.to(dtype=dtype, device=DEV)


def bound(x, r, dtype, c=8.0):
    xd = x.to(torch.float64).cpu()
    return (rho_triton(dtype) + c * (xd.abs() + 1) * u_compute(dtype)) * r.abs() + torch.finfo(dtype).tiny


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus"])
def test_matches_reference_within_bound(name, dtype):
    x = make_x(dtype)
    out = getattr(elementwise, name)(x)
    assert out.dtype == dtype and out.shape == x.shape
    r = reference_op(name)(x)
    assert_within(f"{name} {dtype}", out, r, bound(x, r, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softplus_threshold_rule(dtype):
    x = torch.tensor([19.5, 20.0, 20.25, 2.0, 2.5, -30.0], dtype=dtype, device=DEV)
    for thr in (20.0, 2.25):
        out = elementwise.softplus(x, threshold=thr)
        r = reference_op("softplus")(x, threshold=thr)
        assert_within(f"softplus threshold {thr}", out, r, bound(x, r, dtype))
        above = x.to(torch.float64) > thr
        assert torch.equal(out[above], x[above]), "above the threshold softplus must return x itself"


def test_any_shape_noncontiguous_and_empty():
    x = make_x(torch.float32, 6 * 35).view(6, 35).t()  # non-contiguous [35, 6]
    out = elementwise.silu(x)
    assert out.shape == (35, 6)
    r = reference_op("silu")(x)
    assert_within("silu transposed", out, r, bound(x, r, torch.float32))
    assert elementwise.sigmoid(torch.empty(0, 3, device=DEV)).shape == (0, 3)


@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus"])
def test_run_to_run_bitwise_and_counted(name):
    x = make_x(torch.bfloat16, 4099, seed=3)
    before = _counters.snapshot()[f"elementwise.{name}"]
    a, b = getattr(elementwise, name)(x), getattr(elementwise, name)(x)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert _counters.snapshot()[f"elementwise.{name}"] - before == 2


def test_rejects_integer_input_naming_x():
    with pytest.raises(TypeError, match="x"):
        elementwise.silu(torch.arange(4))


def test_negative_wrong_threshold_is_caught():
    """Teeth: a softplus with the wrong threshold (0 instead of 20) fails the comparison in fp64."""
    x = make_x(torch.float64)
    wrong = elementwise.softplus(x, threshold=0.0)
    r = reference_op("softplus")(x)
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_within("softplus mutant", wrong, r, bound(x, r, torch.float64))


def test_negative_silu_vs_sigmoid_is_caught():
    x = make_x(torch.bfloat16)
    r = reference_op("sigmoid")(x)
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_within("silu as sigmoid", elementwise.silu(x), r, bound(x, r, torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_large(dtype):
    x = make_x(dtype, 1 << 22)
    for name in ("silu", "sigmoid", "softplus"):
        r = reference_op(name)(x)
        assert_within(f"{name} gpu", getattr(elementwise, name)(x), r, bound(x.cpu(), r, dtype))
    assert optimized.backend_info()["cuda"]
