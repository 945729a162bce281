"""MLA attention (naive and absorbed forms) in torch at float32 arithmetic (see parity.emulate).

Mutations: ``causal_off_by_one`` (each query also sees the next position), ``values_from_keys``
(W_UV read from the W_UK rows: the per-head split of w_kvb off by P rows).
"""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def _heads(q, latent, k_pe, w_kvb, scale):
    """(P, Vh, arithmetic dtype, w_kvb per head [N, P+Vh, L] in it, scale)."""
    N, PR = q.shape[2:]
    P = PR - k_pe.shape[-1]
    cd = cdt(q.dtype)
    W = w_kvb.to(cd).reshape(N, -1, latent.shape[-1])
    return P, W.shape[1] - P, cd, W, PR ** -0.5 if scale is None else scale


def _attend(q, latent, k_pe, w_kvb, scale, mask, mutation):
    P, Vh, cd, W, scale = _heads(q, latent, k_pe, w_kvb, scale)
    Wuk = W[:, :P]
    Wuv = W[:, :Vh] if mutation == "values_from_keys" else W[:, P:]
    qc = q.to(cd)
    ql = torch.einsum("btnp,npl->btnl", qc[..., :P], Wuk)
    c, kp = latent.to(cd), k_pe.to(cd)
    s = scale * (torch.einsum("btnl,bsl->btns", ql, c) + torch.einsum("btnr,bsr->btns", qc[..., P:], kp))
    s = s.masked_fill(~mask, -float("inf"))
    p = torch.softmax(s, dim=-1)
    ot = torch.einsum("btns,bsl->btnl", p, c)
    return torch.einsum("nvl,btnl->btnv", Wuv, ot).to(q.dtype)


def _causal(q, latent, shift):
    T, S = q.shape[1], latent.shape[1]
    last = S - T + torch.arange(T, device=q.device) + shift
    return (torch.arange(S, device=q.device)[None, :] <= last[:, None])[None, :, None, :]


def naive(q, latent, k_pe, w_kvb, *, scale=None, mutation=None):
    """Per-head keys and values expanded by one GEMM (``kv = latent W^T``, stored in q's dtype, as
    the optimized op does), then causal attention over ``[k_nope ; k_pe]``."""
    check_mutation("naive", mutation, ("causal_off_by_one", "values_from_keys"))
    P, Vh, cd, W, scale = _heads(q, latent, k_pe, w_kvb, scale)
    kv = torch.einsum("bsl,nrl->bsnr", latent.to(cd), W).to(q.dtype).to(cd)
    v = kv[..., :Vh] if mutation == "values_from_keys" else kv[..., P:]
    qc = q.to(cd)
    s = scale * (torch.einsum("btnp,bsnp->btns", qc[..., :P], kv[..., :P])
                 + torch.einsum("btnr,bsr->btns", qc[..., P:], k_pe.to(cd)))
    s = s.masked_fill(~_causal(q, latent, 1 if mutation == "causal_off_by_one" else 0), -float("inf"))
    return torch.einsum("btns,bsnv->btnv", torch.softmax(s, dim=-1), v).to(q.dtype)


def absorbed(q, latent, k_pe, w_kvb, *, scale=None, mutation=None):
    check_mutation("absorbed", mutation, ("causal_off_by_one", "values_from_keys"))
    mask = _causal(q, latent, 1 if mutation == "causal_off_by_one" else 0)
    return _attend(q, latent, k_pe, w_kvb, scale, mask, mutation)


def paged_decode(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None,
                 mutation=None, _block_shift=0):
    """One query per sequence (``q [B, N, P+R]``) over its first ``lengths[b]`` positions, held
    contiguous: the paged cache's layout (``block_size``, the block order from ``seed``, the memory
    ``cache_fill``) changes no value. ``_block_shift`` emulates reading the next block of a
    sequence's table (its blocks in order, wrapping around) by rolling the padded context."""
    check_mutation("paged_decode", mutation, ("stale_last_token", "values_from_keys"))
    if _block_shift:
        B, S, L = latent.shape
        cap = -(-S // block_size) * block_size
        pad = lambda t: torch.cat([t, t.new_zeros(B, cap - S, t.shape[-1])], 1).roll(-block_size * _block_shift, 1)
        latent, k_pe = pad(latent), pad(k_pe)
    S = latent.shape[1]
    ln = lengths.to(latent.device) - (1 if mutation == "stale_last_token" else 0)
    mask = torch.arange(S, device=q.device)[None, :] < ln[:, None]
    return _attend(q[:, None], latent, k_pe, w_kvb, scale, mask[:, None, None, :], mutation)[:, 0]
