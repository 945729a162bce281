"""Bounds of MLA attention, absorbed and naive forms (docs/error-bounds.md, "MLA").

Absorbed form, per head: q_lat = W_UK^T q_nope (P-long dots, stored in the run dtype for the latent dot), scores
sigma_s = scale (q_lat . c_s + q_pe . k_pe_s) (L+R-long dots), softmax over the causal context
(exp relative error (2 + |sigma - max|) ua, an S-long sum), probabilities stored in the run dtype
for the PV dot, o~ = sum_s p_s c_s (S-long, stored), o = W_UV o~ (L-long). A perturbation d sigma
moves p_s by at most p_s (|d sigma_s| + sum p d sigma), and o by sum_s dp_s W_UV c_s. Reduction
lengths: P, L + R, the context S, L.

Naive form, per head: keys k_s = W_UK c_s and values v_s = W_UV c_s (L-long dots, stored in the
run dtype by the GEMM that expands them), scores sigma_s = scale (q_nope . k_s + q_pe . k_pe_s)
(P+R-long), the same softmax, o = sum_s p_s v_s (S-long), normalized (one divide). Reduction
lengths: L, P + R, the context S.

Every product's accumulation is ``Precision.dot`` (``gamma_n(ua)`` under IEEE, plus the rounding of
its operands under a TF32 or bf16 contract).
"""
from __future__ import annotations

import numpy as np

from parity.bounds.core import LAMBDA, exp_rel, gamma


def _split(x):
    q, lat, kpe, w = x["q"], x["latent"], x["k_pe"], x["w_kvb"]
    B, T, N, PR = q.shape
    R = kpe.shape[-1]
    P = PR - R
    L = lat.shape[-1]
    Vh = w.shape[0] // N - P
    W = w.reshape(N, P + Vh, L)
    return q[..., :P], q[..., P:], lat, kpe, W[:, :P], W[:, P:], (B, T, N, P, R, L, Vh)


def _scale(kw, P, R):
    s = kw.get("scale")
    return (P + R) ** -0.5 if s is None else float(s)


def _softmax_rel(sc, dsc, mask, ua, us):
    """(p, relative bound of each p_s): a perturbation d sigma moves p_s by p_s (|d sigma_s| +
    sum p d sigma); exp, the S-long sum, the divide; p stored in the run dtype for the PV dot."""
    sc = np.where(mask, sc, -np.inf)
    m = np.max(sc, axis=-1, keepdims=True)
    e = np.exp(sc - m)
    pr = e / np.sum(e, axis=-1, keepdims=True)
    n_ctx = np.sum(mask, axis=-1, keepdims=True)
    dsc = np.where(mask, dsc, 0.0)
    mean_d = np.sum(pr * dsc, axis=-1, keepdims=True)
    rel = dsc + mean_d + ua * (np.where(mask, exp_rel(sc - m), 0.0) + 2.0) + gamma(n_ctx, ua) + us
    return pr, rel, n_ctx


def attention_bound(x, kw, ref_o, p, uo, *, lengths=None):
    """Bound of o [B, T, N, Vh]; ``lengths`` [B] (paged decode: each sequence's context length,
    the query being its last position) or None (queries are the last T of S positions)."""
    qn, qp, c, kpe, Wuk, Wuv, (B, T, N, P, R, L, Vh) = _split(x)
    S = c.shape[1]
    scale = _scale(kw, P, R)
    ua, us = p.ua, p.u
    ql = np.einsum("btnp,npl->btnl", qn, Wuk)
    # scores: the fp32 accumulations of q_lat (P-long) and of the score (L+R-long), the scale
    # multiply; q_lat's storage in the run dtype is propagated separately below (linearized)
    acc_q = p.dot(P) * np.einsum("btnl,bsl->btns", np.einsum("btnp,npl->btnl", np.abs(qn), np.abs(Wuk)), np.abs(c))
    ab = np.einsum("btnl,bsl->btns", np.abs(ql), np.abs(c)) + np.einsum("btnr,bsr->btns", np.abs(qp), np.abs(kpe))
    sc = scale * (np.einsum("btnl,bsl->btns", ql, c) + np.einsum("btnr,bsr->btns", qp, kpe))
    dsc = scale * (acc_q + p.dot(L + R) * ab) + ua * np.abs(sc)
    s_idx = np.arange(S)
    if lengths is None:
        last = S - T + np.arange(T)                 # query t sees s <= S - T + t
        mask = s_idx[None, :] <= last[:, None]      # [T, S]
        mask = np.broadcast_to(mask[None, :, None, :], sc.shape)
    else:
        mask = s_idx[None, :] < np.asarray(lengths)[:, None]
        mask = np.broadcast_to(mask[:, None, None, :], sc.shape)
    pr, rel_p, n_ctx = _softmax_rel(sc, dsc, mask, ua, us)
    # a perturbation dp of the weights moves o by exactly sum_s dp_s v_s, v_s = W_UV c_s: bounded
    # with |v_s| (the cancellation inside W_UV c_s is exact math, not error)
    v = np.einsum("nvl,bsl->bsnv", Wuv, c)
    o_p = np.einsum("btns,bsnv->btnv", pr * rel_p, np.abs(v))
    ot = np.einsum("btns,bsl->btnl", pr, c)
    # q_lat stored in the run dtype: d sigma_s = scale dq_lat . c_s, so (first order)
    # do = scale sum_l dq_lat_l Cov_l with Cov_l = sum_s p_s (c_sl - o~_l) v_s (the softmax removes
    # the common shift); independent roundings |dq_lat_l| <= u |q_lat_l|: probabilistic over L
    o = np.einsum("btns,bsnv->btnv", pr, v)
    cov = np.einsum("btns,bsl,bsnv->btnlv", pr, c, v) - ot[..., None] * o[..., None, :]
    o_q = LAMBDA * scale * np.sqrt(np.einsum("btnl,btnlv->btnv", (us * ql) ** 2, cov * cov))
    # o~ stored in the run dtype (independent per l: probabilistic through W_UV), its S-long fp32
    # accumulation, the L-long fp32 accumulation of W_UV o~, the output rounding
    o_store = LAMBDA * np.sqrt(np.einsum("nvl,btnl->btnv", Wuv * Wuv, (us * ot) ** 2))
    acc_o = p.dot(n_ctx[..., 0][..., None]) * np.einsum("nvl,btnl->btnv", np.abs(Wuv),
                                                             np.einsum("btns,bsl->btnl", pr, np.abs(c)))
    acc_uv = p.dot(L) * np.einsum("nvl,btnl->btnv", np.abs(Wuv), np.abs(ot))
    return o_p + o_q + o_store + acc_o + acc_uv + uo * np.abs(ref_o)


def naive_bound(x, kw, ref_o, p, uo):
    """Bound of o [B, T, N, Vh] of the naive form (queries the last T of S positions, causal)."""
    qn, qp, c, kpe, Wuk, Wuv, (B, T, N, P, R, L, Vh) = _split(x)
    S = c.shape[1]
    scale = _scale(kw, P, R)
    ua, us = p.ua, p.u
    kn = np.einsum("npl,bsl->bsnp", Wuk, c)
    v = np.einsum("nvl,bsl->bsnv", Wuv, c)
    # the expanding GEMM: L-long fp32 accumulation, then the stored keys and values
    dkn = p.dot(L) * np.einsum("npl,bsl->bsnp", np.abs(Wuk), np.abs(c)) + us * np.abs(kn)
    dv = p.dot(L) * np.einsum("nvl,bsl->bsnv", np.abs(Wuv), np.abs(c)) + us * np.abs(v)
    sc = scale * (np.einsum("btnp,bsnp->btns", qn, kn) + np.einsum("btnr,bsr->btns", qp, kpe))
    ab = np.einsum("btnp,bsnp->btns", np.abs(qn), np.abs(kn)) + np.einsum("btnr,bsr->btns", np.abs(qp), np.abs(kpe))
    dsc = scale * (np.einsum("btnp,bsnp->btns", np.abs(qn), dkn) + p.dot(P + R) * ab) + ua * np.abs(sc)
    last = S - T + np.arange(T)
    mask = np.broadcast_to((np.arange(S)[None, :] <= last[:, None])[None, :, None, :], sc.shape)
    pr, rel_p, n_ctx = _softmax_rel(sc, dsc, mask, ua, us)
    o_p = np.einsum("btns,bsnv->btnv", pr * rel_p, np.abs(v))
    o_v = np.einsum("btns,bsnv->btnv", pr, dv)
    acc = p.dot(n_ctx) * np.einsum("btns,bsnv->btnv", pr, np.abs(v))
    return o_p + o_v + acc + (2 * ua + uo) * np.abs(ref_o)


def naive(x, kw, ref, p):
    return {"o": naive_bound(x, kw, ref["o"], p, p.uo("o"))}


def absorbed(x, kw, ref, p):
    return {"o": attention_bound(x, kw, ref["o"], p, p.uo("o"))}


def paged_decode(x, kw, ref, p):
    """One query per sequence (q [B, N, P+R]) over its first lengths[b] positions."""
    x = dict(x, q=x["q"][:, None])
    return {"o": attention_bound(x, kw, ref["o"][:, None], p, p.uo("o"), lengths=x["lengths"])[:, 0]}
