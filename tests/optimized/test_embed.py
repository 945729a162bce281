"""optimized.embed against the float64 reference.

embedding is a gather: bitwise equal to the table rows. lm_head bound (per logit, r = reference):
    |out - r| <= gamma_D(u_c) * sum_d |h_d w_vd| + rho_o |r|
with u_c = 2^-24 (fp32 accumulation, also for bf16 GEMMs) or 2^-53, gamma_n = n u / (1 - n u), and
rho_o the rounding of the GEMM output to h's dtype (bf16 2^-8; torch rounds to nearest; 0 in
fp32/fp64).
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from optimized import _counters, embed

from ._bounds import DEV, DTYPES, U, u_compute, gamma, np64, assert_within


def _fallback_embedding(ids, table):
    return table[np.asarray(ids)]


def _fallback_lm_head(h, weight):
    return h @ weight.T


def reference_op(name):
    """reference.embed.<name> when it exists, else the same float64 NumPy computation written here."""
    try:
        mod = importlib.import_module("reference.embed")
    except ImportError:
        mod = None
    return getattr(mod, name, None) or globals()[f"_fallback_{name}"]


def lm_bound(h, w, r, dtype):
    hd, wd = h.double().cpu(), w.double().cpu()
    rho = U[dtype] if dtype == torch.bfloat16 else 0.0
    return gamma(h.shape[1], u_compute(dtype)) * (hd.abs() @ wd.abs().T) + rho * r.abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_is_an_exact_gather(dtype):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(101, 37, generator=g).to(dtype=dtype, device=DEV)
    ids = torch.tensor([0, 100, 5, 5, 63], dtype=torch.int32, device=DEV)
    out = embed.embedding(ids, table)
    r = torch.from_numpy(np.asarray(reference_op("embedding")(ids.cpu().numpy(), np64(table))))
    assert out.dtype == dtype and torch.equal(out.double().cpu(), r)


def test_embedding_validates_ids():
    table = torch.randn(10, 4)
    with pytest.raises(IndexError, match=r"ids\[1\] = 10"):
        embed.embedding(torch.tensor([3, 10]), table)
    with pytest.raises(IndexError, match=r"ids\[0\] = -1"):
        embed.embedding(torch.tensor([-1]), table)
    with pytest.raises(ValueError, match="ids"):
        embed.embedding(torch.tensor([1.0]), table)
    with pytest.raises(ValueError, match="table"):
        embed.embedding(torch.tensor([1]), table[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lm_head_within_bound(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 77, generator=g).to(dtype=dtype, device=DEV)
    w = (torch.randn(131, 77, generator=g) / 77 ** 0.5).to(dtype=dtype, device=DEV)
    out = embed.lm_head(h, w)
    assert out.shape == (5, 131) and out.dtype == dtype
    r = torch.from_numpy(np.asarray(reference_op("lm_head")(np64(h), np64(w))))
    assert_within("lm_head", out, r, lm_bound(h, w, r, dtype))


def test_lm_head_refuses_tf32_in_fp32():
    h, w = torch.randn(2, 8), torch.randn(3, 8)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with pytest.raises(RuntimeError, match="allow_tf32"):
            embed.lm_head(h, w)
        embed.lm_head(h.bfloat16(), w.bfloat16())  # bf16 is unaffected
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        with pytest.raises(RuntimeError, match="float32_matmul_precision"):
            embed.lm_head(h, w)
    finally:
        torch.set_float32_matmul_precision(old)


def test_counted_and_bitwise():
    h, w = torch.randn(4, 16).bfloat16(), torch.randn(9, 16).bfloat16()
    c0 = _counters.snapshot()
    a, b = embed.lm_head(h, w), embed.lm_head(h, w)
    embed.embedding(torch.tensor([1, 2]), w)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    d = _counters.snapshot() - c0
    assert d["embed.lm_head"] == 2 and d["embed.embedding"] == 1


def test_negative_wrong_rows_are_caught():
    """Teeth: an embedding off by one row, and an LM head with permuted vocabulary rows, fail."""
    g = torch.Generator().manual_seed(2)
    table = torch.randn(20, 8, generator=g)
    ids = torch.tensor([3, 4])
    r = torch.from_numpy(np.asarray(reference_op("embedding")(ids.numpy(), np64(table))))
    assert not torch.equal(embed.embedding(ids + 1, table).double(), r)
    h, w = torch.randn(3, 8, generator=g), torch.randn(20, 8, generator=g)
    r = torch.from_numpy(np.asarray(reference_op("lm_head")(np64(h), np64(w))))
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_within("lm_head rows permuted", embed.lm_head(h, w.roll(1, 0)), r,
                      lm_bound(h, w, r, torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_lm_head_and_async_id_check():
    h = torch.randn(4, 2304, device="cuda").bfloat16()
    w = torch.randn(4096, 2304, device="cuda").bfloat16() / 48
    r = torch.from_numpy(np.asarray(reference_op("lm_head")(np64(h), np64(w))))
    assert_within("lm_head gpu", embed.lm_head(h, w), r, lm_bound(h, w, r, torch.bfloat16))
    out = embed.embedding(torch.tensor([0, 4095], device="cuda"), w)
    assert torch.equal(out, w[[0, 4095]])
