"""optimized.mla at the model's shapes on a GPU (32 heads, latent 512, rope 64): paged decode at
B = 64 over 4096 keys and B = 1 over 32768, bitwise equal to the contiguous form at the same splits
and run to run, rows within the absorbed form's bound; a 300-token prefill over 1000 keys in both
forms. The kernels run all 32 heads; three of them (first, middle, last) are judged against the
float64 reference: heads are independent (each absorbs its own rows of w_kvb over the shared
latent), and the bound's cost grows with heads x keys x latent (all 32 at 32768 keys: minutes of
NumPy). Apart from tests/optimized/test_mla.py so that its compiles run beside that file's. GPU
only."""
from __future__ import annotations

import pytest
import torch

from optimized import mla

from .test_mla import judge, judge_row, make

HEADS = [0, 17, 31]


def heads(q, w_kvb, o, N):
    """``q [..., N, P+R]``, ``w_kvb [N*(P+Vh), L]`` and ``o [..., N, Vh]`` restricted to HEADS."""
    idx = torch.tensor(HEADS, device=q.device)
    L = w_kvb.shape[-1]
    return q[..., idx, :], w_kvb.view(N, -1, L)[idx].reshape(-1, L), o[..., idx, :]


@pytest.mark.parity_gpu
@pytest.mark.parametrize("B,S", [(64, 4096), (1, 32768)])
def test_gpu_decode_model_shapes(B, S, parity_device):
    dtype = torch.bfloat16
    N, P, Rr, Vh, L, bs = 32, 128, 64, 128, 512, 64
    g = torch.Generator(device=parity_device).manual_seed(0)
    q = torch.randn(B, N, P + Rr, device=parity_device, generator=g).to(dtype)
    latent = torch.randn(B, S, L, device=parity_device, generator=g).to(dtype)
    k_pe = torch.randn(B, S, Rr, device=parity_device, generator=g).to(dtype)
    w_kvb = (torch.randn(N * (P + Vh), L, device=parity_device, generator=g) * L ** -0.5 * 2).to(dtype)
    nb = B * S // bs
    cache = mla.PagedLatentCache(nb + 8, bs, L, Rr, dtype, parity_device)
    bt = torch.randperm(nb + 8, device=parity_device)[:nb].view(B, S // bs).to(torch.int32)
    seq = torch.arange(B, device=parity_device).repeat_interleave(S)
    pos = torch.arange(S, device=parity_device).repeat(B)
    cache.write(latent.reshape(-1, L), k_pe.reshape(-1, Rr), mla.PagedLatentCache.slot_mapping(bt, seq, pos, bs))
    sl = torch.full((B,), S, dtype=torch.int32, device=parity_device)
    op = mla.paged_decode(q, cache, bt, sl, w_kvb)
    ns = mla._default_splits(q.device, B * 1, S)
    oc = mla.absorbed(q[:, None], latent, k_pe, w_kvb, num_splits=ns)[:, 0]
    op2 = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=ns)
    assert torch.equal(op2, oc)
    assert torch.equal(op, mla.paged_decode(q, cache, bt, sl, w_kvb))
    for b in range(min(B, 2)):
        qh, wh, oh = heads(q, w_kvb, op, N)
        judge_row(oh, b, S, qh, latent, k_pe, wh, dtype)


@pytest.mark.parity_gpu
def test_gpu_prefill_model_shapes(parity_device):
    dtype = torch.bfloat16
    q, latent, k_pe, w_kvb = make(1, 300, 1000, N=32, P=128, Rr=64, Vh=128, L=512, dtype=dtype, seed=3,
                                  device=parity_device)
    for form in ("absorbed", "naive"):
        qh, wh, oh = heads(q, w_kvb, getattr(mla, form)(q, latent, k_pe, w_kvb), 32)
        judge(form, oh, qh, latent, k_pe, wh, dtype)
