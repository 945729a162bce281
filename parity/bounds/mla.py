"""Bounds of MLA attention in the absorbed form (docs/error-bounds.md, section 5).

Per head: q_lat = W_UK^T q_nope (P-long dots, stored in the run dtype for the latent dot), scores
sigma_s = scale (q_lat . c_s + q_pe . k_pe_s) (L+R-long dots), softmax over the causal context
(exp relative error (2 + |sigma - max|) ua, an S-long sum), probabilities stored in the run dtype
for the PV dot, o~ = sum_s p_s c_s (S-long), o = W_UV o~ (L-long). A perturbation d sigma moves
p_s by at most p_s (|d sigma_s| + sum p d sigma). Reduction lengths: P, L + R, the context S, L.
"""
from __future__ import annotations

import numpy as np

from .core import exp_rel, gamma


def _split(x):
    q, lat, kpe, w = x["q"], x["latent"], x["k_pe"], x["w_kvb"]
    B, T, N, PR = q.shape
    R = kpe.shape[-1]
    P = PR - R
    L = lat.shape[-1]
    Vh = w.shape[0] // N - P
    W = w.reshape(N, P + Vh, L)
    return q[..., :P], q[..., P:], lat, kpe, W[:, :P], W[:, P:], (B, T, N, P, R, L, Vh)


def attention_bound(x, kw, ref_o, p, uo, *, lengths=None):
    """Bound of o [B, T, N, Vh]; ``lengths`` [B] (paged decode: each sequence's context length,
    the query being its last position) or None (queries are the last T of S positions)."""
    qn, qp, c, kpe, Wuk, Wuv, (B, T, N, P, R, L, Vh) = _split(x)
    S = c.shape[1]
    scale = kw.get("scale")
    scale = (P + R) ** -0.5 if scale is None else float(scale)
    ua, us = p.ua, p.u
    ql = np.einsum("btnp,npl->btnl", qn, Wuk)
    dql = gamma(P, ua) * np.einsum("btnp,npl->btnl", np.abs(qn), np.abs(Wuk)) + us * np.abs(ql)
    sc = scale * (np.einsum("btnl,bsl->btns", ql, c) + np.einsum("btnr,bsr->btns", qp, kpe))
    ab = np.einsum("btnl,bsl->btns", np.abs(ql), np.abs(c)) + np.einsum("btnr,bsr->btns", np.abs(qp), np.abs(kpe))
    dsc = scale * (gamma(L + R, ua) * ab + np.einsum("btnl,bsl->btns", dql, np.abs(c))) + ua * np.abs(sc)
    s_idx = np.arange(S)
    if lengths is None:
        last = S - T + np.arange(T)                 # query t sees s <= S - T + t
        mask = s_idx[None, :] <= last[:, None]      # [T, S]
        mask = np.broadcast_to(mask[None, :, None, :], sc.shape)
    else:
        mask = s_idx[None, :] < np.asarray(lengths)[:, None]
        mask = np.broadcast_to(mask[:, None, None, :], sc.shape)
    sc = np.where(mask, sc, -np.inf)
    m = np.max(sc, axis=-1, keepdims=True)
    e = np.exp(sc - m)
    pr = e / np.sum(e, axis=-1, keepdims=True)
    n_ctx = np.sum(mask, axis=-1, keepdims=True)
    dsc = np.where(mask, dsc, 0.0)
    mean_d = np.sum(pr * dsc, axis=-1, keepdims=True)
    rel_p = dsc + mean_d + ua * (np.where(mask, exp_rel(sc - m), 0.0) + 2.0) + gamma(n_ctx, ua) + us
    dp = pr * rel_p
    ot = np.einsum("btns,bsl->btnl", pr, c)
    dot_ = np.einsum("btns,bsl->btnl", dp, np.abs(c)) \
        + gamma(n_ctx, ua) * np.einsum("btns,bsl->btnl", pr, np.abs(c)) + us * np.abs(ot)
    do = np.einsum("nvl,btnl->btnv", np.abs(Wuv), dot_ + gamma(L, ua) * np.abs(ot))
    return do + uo * np.abs(ref_o)


def absorbed(x, kw, ref, p):
    return {"o": attention_bound(x, kw, ref["o"], p, p.uo("o"))}


def paged_decode(x, kw, ref, p):
    """One query per sequence (q [B, N, P+R]) over its first lengths[b] positions."""
    x = dict(x, q=x["q"][:, None])
    return {"o": attention_bound(x, kw, ref["o"][:, None], p, p.uo("o"), lengths=x["lengths"])[:, 0]}
