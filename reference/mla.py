"""Multi-head latent attention, NoPE variant (spec b.11, b.12), float64: two equivalent forms.

Conventions: ``q [B, T, N, P+R]`` (per head ``[q_nope ; q_pe]``), ``latent [B, S, L]`` (the
``kv_a_layernorm``-ed ``c``), ``k_pe [B, S, R]`` (shared by all heads, never rotated: NoPE),
``w_kvb [N*(P+Vh), L]`` (``kv_b_proj.weight``: per head ``P`` rows of W_UK then ``Vh`` rows of
W_UV), ``o [B, T, N, Vh]``. The ``T`` queries are the last ``T`` of the ``S`` positions
(``S - T`` cached + ``T`` new), causal: query ``t`` sees keys ``0 .. S-T+t``. ``scale`` defaults
to ``(P+R) ** -0.5``. Softmax subtracts the row max (stable for any score magnitude).
"""
from __future__ import annotations

import numpy as np


def naive(q, latent, k_pe, w_kvb, *, scale=None):
    """Expanded ("compute-friendly") form: per head ``k_nope = W_UK c``, ``v = W_UV c``, then causal
    softmax attention with key ``[k_nope ; k_pe]`` and value ``v``. Shapes in the module docstring."""
    q, latent, k_pe, w_uk, w_uv, scale = _prepare(q, latent, k_pe, w_kvb, scale)
    P = w_uk.shape[1]
    k_nope = np.einsum("bsl,npl->bnsp", latent, w_uk)  # [B, N, S, P]
    v = np.einsum("bsl,nvl->bnsv", latent, w_uv)  # [B, N, S, Vh]
    scores = (np.einsum("btnp,bnsp->bnts", q[..., :P], k_nope)
              + np.einsum("btnr,bsr->bnts", q[..., P:], k_pe))
    probs = _causal_softmax(scale * scores)
    return np.einsum("bnts,bnsv->btnv", probs, v)


def absorbed(q, latent, k_pe, w_kvb, *, scale=None):
    """Absorbed ("data-movement-friendly", decode) form: ``q_lat = W_UK^T q_nope`` per head, MQA
    over the shared ``[latent ; k_pe]`` keys with value ``latent``, then ``o = W_UV o_lat``.
    Same result as ``naive`` (``q_nope . (W_UK c) = (W_UK^T q_nope) . c``)."""
    q, latent, k_pe, w_uk, w_uv, scale = _prepare(q, latent, k_pe, w_kvb, scale)
    P = w_uk.shape[1]
    q_lat = np.einsum("btnp,npl->btnl", q[..., :P], w_uk)  # [B, T, N, L]
    scores = (np.einsum("btnl,bsl->bnts", q_lat, latent)
              + np.einsum("btnr,bsr->bnts", q[..., P:], k_pe))
    probs = _causal_softmax(scale * scores)
    o_lat = np.einsum("bnts,bsl->btnl", probs, latent)
    return np.einsum("btnl,nvl->btnv", o_lat, w_uv)


def _prepare(q, latent, k_pe, w_kvb, scale):
    q, latent, k_pe, w_kvb = (np.asarray(x, dtype=np.float64) for x in (q, latent, k_pe, w_kvb))
    if q.ndim != 4:
        raise ValueError(f"q: expected [B,T,N,P+R], got {q.shape}")
    B, T, N, PR = q.shape
    if latent.ndim != 3 or latent.shape[0] != B or latent.shape[1] < T:
        raise ValueError(f"latent: expected [B,S,L] with B = {B} and S >= T = {T}, got {latent.shape}")
    S, L = latent.shape[1:]
    if k_pe.ndim != 3 or k_pe.shape[:2] != (B, S) or k_pe.shape[2] >= PR:
        raise ValueError(f"k_pe: expected [B,S,R] = ({B}, {S}, R) with R < P+R = {PR}, "
                         f"got {k_pe.shape}")
    P = PR - k_pe.shape[2]
    rows = w_kvb.shape[0] if w_kvb.ndim == 2 else 0
    if w_kvb.ndim != 2 or w_kvb.shape[1] != L or rows % N or rows // N <= P:
        raise ValueError(f"w_kvb: expected [N*(P+Vh), L] with N = {N}, P = {P}, L = {L}, "
                         f"got {w_kvb.shape}")
    w = w_kvb.reshape(N, rows // N, L)
    scale = PR ** -0.5 if scale is None else float(scale)
    return q, latent, k_pe, w[:, :P], w[:, P:], scale


def _causal_softmax(scores):
    """Softmax over the last axis of [B, N, T, S] scores, query t seeing keys <= S - T + t."""
    T, S = scores.shape[-2:]
    allowed = np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]
    scores = np.where(allowed, scores, -np.inf)
    e = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)
