"""optimized.embed: values judged through the registry (``parity.testing.assert_parity``:
embedding exact, lm_head within its record's bound); id validation, the TF32 guard, bytes and
counters here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from optimized import _counters, embed
from parity.testing import assert_parity

DTYPES = ["float32", "bfloat16", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_is_an_exact_gather(dtype):
    r = np.random.default_rng(0)
    ids = np.array([0, 100, 5, 5, 63], dtype=np.int32)
    j = assert_parity("embed.embedding", {"ids": ids, "table": r.standard_normal((101, 37))}, dtype=dtype)
    assert j.ratio == 0.0


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_within_bound(dtype):
    r = np.random.default_rng(1)
    assert_parity("embed.lm_head", {"h": r.standard_normal((5, 77)), "weight": r.standard_normal((131, 77)) / 77 ** 0.5},
                  dtype=dtype)


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


@pytest.mark.parity_gpu
def test_gpu_lm_head_and_async_id_check(parity_device):
    r = np.random.default_rng(2)
    h, w = r.standard_normal((4, 2304)), r.standard_normal((4096, 2304)) / 48
    assert_parity("embed.lm_head", {"h": h, "weight": w}, dtype="bfloat16", device=parity_device)
    wt = torch.tensor(w, device=parity_device).bfloat16()
    out = embed.embedding(torch.tensor([0, 4095], device=parity_device), wt)
    assert torch.equal(out, wt[[0, 4095]])
