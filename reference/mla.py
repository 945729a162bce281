"""Multi-head latent attention, NoPE variant (spec b.11, b.12), float64: two equivalent forms, on
any array API executor.

Conventions: ``q [B, T, N, P+R]`` (per head ``[q_nope ; q_pe]``), ``latent [B, S, L]`` (the
``kv_a_layernorm``-ed ``c``), ``k_pe [B, S, R]`` (shared by all heads, never rotated: NoPE),
``w_kvb [N*(P+Vh), L]`` (``kv_b_proj.weight``: per head ``P`` rows of W_UK then ``Vh`` rows of
W_UV), ``o [B, T, N, Vh]``. The ``T`` queries are the last ``T`` of the ``S`` positions
(``S - T`` cached + ``T`` new), causal: query ``t`` sees keys ``0 .. S-T+t``. ``scale`` defaults
to ``(P+R) ** -0.5``.

Memory: no ``[B, N, T, S]`` score array. The softmax runs over blocks of queries and keys with a
running max and sum (the online softmax: each block's scores are shifted by the running row max,
earlier sums rescaled by ``exp(m_old - m_new)``), so any score magnitude is stable and the working
set is bounded: a score block holds at most ``SCORE_BLOCK_BYTES`` (``[B, N, tq, tk]`` float64) and
three temporaries of its size exist at a time, beside the ``[B, N, tq, .]`` accumulators and, in
the naive form, the expanded per-head keys and values ``[B, N, S, P + R + Vh]`` (linear in S).
``attention_bytes`` states the whole working set.
"""
from __future__ import annotations

from .executor import device_of, namespace

SCORE_BLOCK_BYTES = 256 << 20  # one [B, N, tq, tk] float64 score block (a 32k-token 48B prefill layer:
# 0.58 s on an H200, 0.68 s with 64 MB blocks: fewer launches and running rescales)
QUERY_BLOCK = 512  # queries per block; keys per block fill SCORE_BLOCK_BYTES


def naive(q, latent, k_pe, w_kvb, *, scale=None):
    """Expanded ("compute-friendly") form: per head ``k_nope = W_UK c``, ``v = W_UV c``, then causal
    softmax attention with key ``[k_nope ; k_pe]`` and value ``v``. Shapes in the module docstring."""
    xp, q, latent, k_pe, w_uk, w_uv, scale = _prepare(q, latent, k_pe, w_kvb, scale)
    B, T, N, _ = q.shape
    S, R = k_pe.shape[1:]
    lat_t = xp.matrix_transpose(latent)[:, None, ...]  # [B, 1, L, S]
    # keys transposed and contiguous, [k_nope ; k_pe] per head: one BLAS product per score block
    # (NumPy's batched matmul loops without BLAS over a transposed view, ~100x slower)
    k_t = xp.concat([w_uk[None, ...] @ lat_t,
                     xp.broadcast_to(xp.matrix_transpose(k_pe)[:, None, ...], (B, N, R, S))], axis=2)
    v = latent[:, None, ...] @ xp.matrix_transpose(w_uv)[None, ...]  # [B, N, S, Vh]
    qh = xp.permute_dims(q, (0, 2, 1, 3))  # [B, N, T, P+R]

    def scores(t0, t1, s0, s1):
        return qh[:, :, t0:t1, :] @ k_t[..., s0:s1]

    o = _causal_attention(xp, scores, lambda s0, s1: v[:, :, s0:s1, :], (B, T, N), S, v.shape[-1], scale)
    return xp.permute_dims(o, (0, 2, 1, 3))  # [B, T, N, Vh]


def absorbed(q, latent, k_pe, w_kvb, *, scale=None, lengths=None):
    """Absorbed ("data-movement-friendly", decode) form: ``q_lat = W_UK^T q_nope`` per head, MQA
    over the shared ``[latent ; k_pe]`` keys with value ``latent``, then ``o = W_UV o_lat``.
    Same result as ``naive`` (``q_nope . (W_UK c) = (W_UK^T q_nope) . c``).

    ``lengths`` (B host ints, each in ``[T, S]``; None: all S): sequence ``b`` holds
    ``lengths[b]`` positions, its rows of ``latent``/``k_pe`` past them padding (any finite
    values) that no query sees: B sequences of ragged lengths in one call."""
    xp, q, latent, k_pe, w_uk, w_uv, scale = _prepare(q, latent, k_pe, w_kvb, scale)
    B, T, N, _ = q.shape
    S, L = latent.shape[1:]
    P = w_uk.shape[1]
    qh = xp.permute_dims(q, (0, 2, 1, 3))  # [B, N, T, P+R]
    q_abs = xp.concat([qh[..., :P] @ w_uk[None, ...], qh[..., P:]], axis=-1)  # [q_lat ; q_pe]
    k_t = xp.concat([xp.matrix_transpose(latent), xp.matrix_transpose(k_pe)], axis=1)[:, None, ...]
    lat = latent[:, None, ...]  # [B, 1, S, L]: the values

    def scores(t0, t1, s0, s1):
        return q_abs[:, :, t0:t1, :] @ k_t[..., s0:s1]

    o_lat = _causal_attention(xp, scores, lambda s0, s1: lat[:, :, s0:s1, :], (B, T, N), S, L, scale,
                              lengths=_lengths(lengths, B, T, S))
    o = o_lat @ xp.matrix_transpose(w_uv)[None, ...]  # [B, N, T, Vh]
    return xp.permute_dims(o, (0, 2, 1, 3))


def blocks(B: int, N: int, T: int) -> tuple[int, int]:
    """(queries, keys) per block of a ``[B, N, T, .]`` attention: at most ``QUERY_BLOCK`` queries
    and as many keys as fit ``SCORE_BLOCK_BYTES`` (a decode step's one query sees every key at once)."""
    tq = max(1, min(T, QUERY_BLOCK))
    return tq, max(1, SCORE_BLOCK_BYTES // (8 * B * N * tq))


def attention_bytes(B: int, T: int, S: int, N: int, P: int, R: int, Vh: int, L: int, *,
                    form: str) -> int:
    """Peak float64 bytes of ``naive``/``absorbed`` beyond their inputs and output: three score
    blocks, the accumulators of one query block, the finished query blocks and their
    concatenation, the heads-first queries (and q_lat), and for the naive form the per-head keys
    and values of all S positions."""
    tq, tk = blocks(B, N, T)
    tk = min(tk, S)
    width = Vh if form == "naive" else L
    total = 3 * B * N * tq * tk + 2 * B * N * tq * (width + 2) + 2 * B * N * T * width + B * N * T * (P + R)
    total += B * N * S * (P + R + Vh) if form == "naive" else B * N * T * (2 * L + R) + B * S * (L + R)
    return 8 * total


def _heads_first(xp, q, P):
    qh = xp.permute_dims(q, (0, 2, 1, 3))  # [B, N, T, P+R]
    return qh[..., :P], qh[..., P:]


def _lengths(lengths, B: int, T: int, S: int):
    """``lengths`` checked: None, or B ints in ``[T, S]`` (a host list)."""
    if lengths is None:
        return None
    out = [int(n) for n in lengths]
    if len(out) != B or any(not T <= n <= S for n in out):
        raise ValueError(f"lengths: expected {B} ints in [T, S] = [{T}, {S}], got {list(lengths)!r}")
    return None if all(n == S for n in out) else out


def _causal_attention(xp, scores, values, BTN, S, W, scale, *, lengths=None):
    """``softmax(scale * scores) @ values`` over blocks, query ``t`` seeing keys ``<= S - T + t``
    (of sequence ``b``: ``<= lengths[b] - T + t``); ``[B, N, T, W]``.

    ``scores(t0, t1, s0, s1) -> [B, N, t1-t0, s1-s0]``, ``values(s0, s1) -> [B, 1|N, s1-s0, W]``.
    Key blocks run in increasing order: the first holds key 0, which every query sees, so the
    running max is finite after it and ``exp(-inf - m)`` of a masked key is an exact 0."""
    B, T, N = BTN
    dev = device_of(values(0, 0))
    if T == 0:
        return xp.zeros((B, N, 0, W), dtype=xp.float64, device=dev)
    tq, tk = blocks(B, N, T)
    outs = []
    for t0 in range(0, T, tq):
        t1 = min(T, t0 + tq)
        last = S - T + t1  # keys 0 .. last-1 are visible to some query of the block
        m = l = acc = None
        for s0 in range(0, last, tk):
            s1 = min(last, s0 + tk)
            s = scale * scores(t0, t1, s0, s1)
            if lengths is not None:  # each sequence's own last key; key 0 is every query's
                last_key = xp.asarray(lengths, dtype=xp.int64, device=dev)[:, None, None, None] - T \
                    + xp.arange(t0, t1, device=dev)[None, None, :, None]  # [B, 1, tq, 1]
                s = xp.where(xp.arange(s0, s1, device=dev)[None, None, None, :] <= last_key, s, -xp.inf)
            elif s1 - 1 > S - T + t0:  # the block reaches past the first query's last key: mask
                allowed = (xp.arange(s0, s1, device=dev)[None, :]
                           <= (S - T + xp.arange(t0, t1, device=dev))[:, None])
                s = xp.where(allowed, s, -xp.inf)
            m_blk = xp.max(s, axis=-1, keepdims=True)
            if m is None:
                m = m_blk
                p = xp.exp(s - m)
                l, acc = xp.sum(p, axis=-1, keepdims=True), p @ values(s0, s1)
                continue
            m_new = xp.maximum(m, m_blk)
            alpha = xp.exp(m - m_new)
            p = xp.exp(s - m_new)
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha + p @ values(s0, s1)
            m = m_new
        outs.append(acc / l)
    return xp.concat(outs, axis=2)


def _prepare(q, latent, k_pe, w_kvb, scale):
    xp = namespace(q, latent, k_pe, w_kvb)
    q, latent, k_pe, w_kvb = (xp.asarray(x, dtype=xp.float64) for x in (q, latent, k_pe, w_kvb))
    if q.ndim != 4:
        raise ValueError(f"q: expected [B,T,N,P+R], got {tuple(q.shape)}")
    B, T, N, PR = q.shape
    if latent.ndim != 3 or latent.shape[0] != B or latent.shape[1] < T:
        raise ValueError(f"latent: expected [B,S,L] with B = {B} and S >= T = {T}, "
                         f"got {tuple(latent.shape)}")
    S, L = latent.shape[1:]
    if k_pe.ndim != 3 or tuple(k_pe.shape[:2]) != (B, S) or k_pe.shape[2] >= PR:
        raise ValueError(f"k_pe: expected [B,S,R] = ({B}, {S}, R) with R < P+R = {PR}, "
                         f"got {tuple(k_pe.shape)}")
    P = PR - k_pe.shape[2]
    rows = w_kvb.shape[0] if w_kvb.ndim == 2 else 0
    if w_kvb.ndim != 2 or w_kvb.shape[1] != L or rows % N or rows // N <= P:
        raise ValueError(f"w_kvb: expected [N*(P+Vh), L] with N = {N}, P = {P}, L = {L}, "
                         f"got {tuple(w_kvb.shape)}")
    w = xp.reshape(w_kvb, (N, rows // N, L))
    scale = PR ** -0.5 if scale is None else float(scale)
    return xp, q, latent, k_pe, w[:, :P, :], w[:, P:, :], scale
