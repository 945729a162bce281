"""optimized.norm against the float64 reference, in units of a derived error bound.

Bound model (per element, r = reference value, first order):
    |out - r| <= (rho_o + (n/2 + 8) * u_c + [gated] 8 * (|g| + 1) * u_c) * |r| + tiny
The sum of squares of a row of n = D non-negative terms has relative error <= gamma_n ~ n u_c (worst
case, any summation order); the square root halves it; mean, +eps, sqrt, reciprocal and the products
by x, weight (and sigmoid(gate)) add a few u_c (8 covers them); sigmoid(g) itself is accurate to
~(|g| + 1) u_c (exp argument reduction). rho_o: the final rounding to x's dtype (0 in fp32/fp64; bf16
u = 2^-8 round-to-nearest, 2u under an interpreter that truncates). tiny: smallest normal.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from optimized import _counters, norm

from ._bounds import DEV, DTYPES, u_compute, rho_triton, np64, assert_within


def ref(name, *args, **kw):
    fn = getattr(importlib.import_module("reference.norm"), name)
    return torch.from_numpy(np.asarray(fn(*[np64(a) for a in args], **kw)))


def bound(r, dtype, D, gate=None):
    uc = u_compute(dtype)
    rel = rho_triton(dtype) + (D / 2 + 8) * uc
    if gate is not None:
        rel = rel + 8 * (gate.to(torch.float64).cpu().abs() + 1) * uc
    return rel * r.abs() + torch.finfo(dtype).tiny


def inputs(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    gate = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    return x.to(DEV), gate.to(DEV), w.to(DEV)


# D = 7, 300: odd, masked tail; 128: the KDA head dim; 9000: longer than one tile (two-pass path)
SHAPES = [(3, 5, 7), (2, 3, 4, 128), (13, 300), (3, 9000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(shape, dtype):
    x, _, w = inputs(shape, dtype)
    out = norm.rms_norm(x, w, eps=1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    r = ref("rms_norm", x, w, eps=1e-5)
    assert_within("rms_norm", out, r, bound(r, dtype, shape[-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_gated_rms_norm(shape, dtype):
    x, gate, w = inputs(shape, dtype, seed=1)
    out = norm.gated_rms_norm(x, gate, w, eps=1e-5)
    assert out.dtype == dtype
    r = ref("gated_rms_norm", x, gate, w, eps=1e-5)
    assert_within("gated_rms_norm", out, r, bound(r, dtype, shape[-1], gate))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_l2norm(shape, dtype):
    x, _, _ = inputs(shape, dtype, seed=2)
    x[0, ...] = 0  # a zero vector maps to zero
    out = norm.l2norm(x)
    r = ref("l2norm", x)
    assert_within("l2norm", out, r, bound(r, dtype, shape[-1]))
    assert not out[0].any()


def bits(t):
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3]], ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm_is_the_add_then_the_norm_bitwise(shape, dtype):
    """The fused residual add + norm returns the bits of a torch add followed by ``rms_norm`` (which
    the norm.rms_norm certificate covers), on the one-tile and the two-pass (D = 9000) paths."""
    x, _, w = inputs(shape, dtype, seed=8)
    r, _, _ = inputs(shape, dtype, seed=9, scale=3.0)
    c0 = _counters.snapshot()
    y, h = norm.add_rms_norm(x, r, w, eps=1e-5)
    assert (_counters.snapshot() - c0)["norm.add_rms_norm"] == 1
    h_ref = x + r
    assert torch.equal(bits(h), bits(h_ref))
    assert torch.equal(bits(y), bits(norm.rms_norm(h_ref, w, eps=1e-5)))


def test_add_rms_norm_strided_rows_and_errors():
    x, _, w = inputs((6, 2, 40), torch.bfloat16, seed=10)
    r = inputs((6, 90), torch.bfloat16, seed=11)[0][:, 5:85].view(6, 2, 40)  # rows of a wider tensor
    y, h = norm.add_rms_norm(x, r, w, eps=1e-6)
    assert torch.equal(bits(h), bits(x + r))
    assert torch.equal(bits(y), bits(norm.rms_norm(x + r, w, eps=1e-6)))
    with pytest.raises(ValueError, match="residual"):
        norm.add_rms_norm(x, r[:3], w, eps=1e-6)
    with pytest.raises(TypeError, match="residual"):
        norm.add_rms_norm(x, r.float(), w, eps=1e-6)


def test_negative_add_rms_norm_bitwise_check_catches_an_unrounded_sum():
    """Teeth: normalizing the fp32 sum instead of the rounded bf16 h (a fusion that skips the
    rounding torch does between the add and the norm) changes the bits; the check above sees it."""
    x, _, w = inputs((64, 2304), torch.bfloat16, seed=12)
    r, _, _ = inputs((64, 2304), torch.bfloat16, seed=13, scale=3.0)
    y, _ = norm.add_rms_norm(x, r, w, eps=1e-5)
    unrounded = norm.rms_norm((x.float() + r.float()), w, eps=1e-5).to(torch.bfloat16)
    assert not torch.equal(bits(unrounded), bits(y))


def test_weight_dtype_may_differ_and_input_may_be_strided():
    x, gate, w = inputs((6, 40), torch.bfloat16, seed=3)
    xt = x.t().contiguous().t()  # same values, column-major storage
    out = norm.rms_norm(xt, w.float(), eps=1e-6)
    r = ref("rms_norm", x, w.float(), eps=1e-6)
    assert_within("rms_norm strided", out, r, bound(r, torch.bfloat16, 40))


def test_run_to_run_bitwise_and_counted():
    x, gate, w = inputs((33, 2304), torch.bfloat16, seed=4)
    c0 = _counters.snapshot()
    a = norm.rms_norm(x, w, eps=1e-5)
    b = norm.rms_norm(x, w, eps=1e-5)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    g1, g2 = (norm.gated_rms_norm(x[:, :128], gate[:, :128], w[:128], eps=1e-5) for _ in range(2))
    assert torch.equal(g1.view(torch.int16), g2.view(torch.int16))
    d = _counters.snapshot() - c0
    assert d["norm.rms_norm"] == 2 and d["norm.gated_rms_norm"] == 2


def test_errors_name_the_argument():
    x, gate, w = inputs((4, 16), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, w[:15], eps=1e-5)
    with pytest.raises(ValueError, match="gate"):
        norm.gated_rms_norm(x, gate[:3], w, eps=1e-5)


def test_negative_wrong_eps_is_caught_in_fp64():
    """Teeth: eps 1e-6 where the reference has 1e-5 (the kv_a_layernorm variant question) is far
    beyond the fp64 bound on small-magnitude rows, and invisible at bf16."""
    x, _, w = inputs((8, 512), torch.float64, seed=5, scale=0.01)
    r = ref("rms_norm", x, w, eps=1e-5)
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_within("rms_norm eps mutant", norm.rms_norm(x, w, eps=1e-6), r, bound(r, torch.float64, 512))


def test_negative_missing_gate_is_caught():
    x, gate, w = inputs((8, 128), torch.bfloat16, seed=6)
    r = ref("gated_rms_norm", x, gate, w, eps=1e-5)
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_within("gate dropped", norm.rms_norm(x, w, eps=1e-5), r, bound(r, torch.bfloat16, 128, gate))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_model_shapes(dtype):
    for shape in [(4096, 2304), (4096, 32, 128), (257, 512)]:
        x, gate, w = (t.cuda() for t in inputs(shape, dtype, seed=7))
        r = ref("rms_norm", x, w, eps=1e-5)
        assert_within("rms_norm gpu", norm.rms_norm(x, w, eps=1e-5), r, bound(r, dtype, shape[-1]))
        r = ref("gated_rms_norm", x, gate, w, eps=1e-5)
        assert_within("gated gpu", norm.gated_rms_norm(x, gate, w, eps=1e-5), r,
                      bound(r, dtype, shape[-1], gate))
        r = ref("l2norm", x)
        assert_within("l2norm gpu", norm.l2norm(x), r, bound(r, dtype, shape[-1]))
        y, h = norm.add_rms_norm(x, gate, w, eps=1e-5)
        assert torch.equal(bits(h), bits(x + gate))
        assert torch.equal(bits(y), bits(norm.rms_norm(x + gate, w, eps=1e-5)))
