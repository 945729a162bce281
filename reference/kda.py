"""Kimi Delta Attention (KDA) core, float64: the recurrence (spec b.8) and its chunked form (b.9).

Conventions (docs/ARCHITECTURE.md):

- ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``,
  ``o [B, T, HV, V]``. ``HV`` is a multiple of ``H``; value head ``hv`` reads qk head
  ``hv // (HV // H)`` (GVA).
- ``g`` is the **log-space** per-channel decay (``<= 0`` in the model): one step multiplies row
  ``d`` of the state by ``exp(g[d])``. No log2 rescaling anywhere.
- State ``S [B, HV, K, V]``, **K-first** (row = key channel, column = value channel), the fla
  layout. With ``cu_seqlens`` (``[N+1]`` ints, ``B == 1``) the ``N`` sequences are independent and
  states are ``[N, HV, K, V]``.
- ``scale`` defaults to ``K ** -0.5``. ``recurrent``/``chunked`` take q, k already normalized;
  ``fused_*`` apply l2norm, the gate and the beta sigmoid first (the composition the kernels fuse).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .elementwise import sigmoid, softplus
from .norm import l2norm

# The chunked form evaluates exp(G_i - G_j) as exp(G_i) * exp(-G_j) when every |G| of a chunk is
# at most this (both factors then lie in [e^-600, e^600], far from float64 over/underflow, and
# every product, also the ones masked away, stays finite); otherwise it falls back to the pairwise
# difference masked to -inf before exp. Both are accurate to a few ulp; the first is BLAS-fast,
# the second costs c*c*K exps per chunk and head.
_FACTORED_RANGE_MAX = 600.0


def gate(g_raw, A_log, dt_bias):
    """KDA forget gate, softplus form (spec b.6): ``g = -exp(A_log[hv]) * softplus(g_raw + dt_bias)``.

    g_raw: [B, T, HV, K]; A_log: [HV] (the checkpoint's [1, 1, HV, 1] is accepted too); dt_bias:
    [HV*K] (flat index ``hv*K + d``). Returns the log-space decay g [B, T, HV, K] (<= 0). softplus
    uses torch's threshold 20.
    """
    g_raw = np.asarray(g_raw, dtype=np.float64)
    A_log = np.asarray(A_log, dtype=np.float64)
    dt_bias = np.asarray(dt_bias, dtype=np.float64)
    if g_raw.ndim != 4:
        raise ValueError(f"g_raw: expected [B,T,HV,K], got {g_raw.shape}")
    HV, K = g_raw.shape[2:]
    if A_log.shape == (1, 1, HV, 1):
        A_log = A_log.reshape(HV)
    if A_log.shape != (HV,):
        raise ValueError(f"A_log: expected [HV] = ({HV},) or [1,1,HV,1], got {A_log.shape}")
    if dt_bias.shape != (HV * K,):
        raise ValueError(f"dt_bias: expected [HV*K] = ({HV * K},), got {dt_bias.shape}")
    return -np.exp(A_log)[:, None] * softplus(g_raw + dt_bias.reshape(HV, K))


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """The KDA recurrence, token by token (the ground truth, spec b.8). Per value head::

        S~  = diag(exp(g_t)) S          # row d decays by exp(g_t[d])
        e_t = beta_t (v_t - S~^T k_t)   # delta, [V]
        S   = S~ + k_t e_t^T
        o_t = scale * S^T q_t           # the UPDATED state

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (log-space); beta: [B, T, HV];
    initial_state: [B, HV, K, V] (or [N, HV, K, V] with cu_seqlens) or None (zeros).
    Returns ``(o [B, T, HV, V], final_state)`` with final_state shaped like initial_state.
    """
    args = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return _over_sequences(_recurrent_core, args, cu_seqlens)


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    """The chunked KDA algorithm (spec b.9): same inputs, outputs and math as ``recurrent``.

    Each sequence is cut into chunks of ``chunk_size`` tokens (any positive size; the kernels use
    16/32/64); a ragged final chunk is simply shorter (``G_last`` = its last valid row). Within a
    chunk, with ``G`` the inclusive prefix sum of ``g`` (restarting every chunk)::

        Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)   (i > j)      key-key, strictly lower
        Aqk[i,j] = scale sum_d q_i k_j exp(G_i - G_j)    (i >= j)     query-key, lower
        w = (I + Akk)^-1 (beta k exp(G)),  u = (I + Akk)^-1 (beta v)   WY form (forward substitution)
        v_new = u - w S;  o = scale (q exp(G)) S + Aqk v_new
        S <- diag(exp(G_last)) S + (k exp(G_last - G))^T v_new

    ``exp(G_i - G_j)`` is never formed for ``j > i`` where it could overflow: a chunk whose
    ``|G|`` stays within ``_FACTORED_RANGE_MAX`` uses ``exp(G_i) exp(-G_j)`` (BLAS products),
    any other chunk the pairwise difference masked to -inf before exp. Strong decays (G differences
    past 709 within a chunk) therefore give finite results equal to the recurrence's. The chunks
    run in sequence, each vectorized over B and heads.
    """
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    args = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return _over_sequences(partial(_chunked_core, chunk_size=int(chunk_size)), args, cu_seqlens)


def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None,
                    initial_state=None, cu_seqlens=None):
    """``recurrent`` after the fused prologue: l2norm(q), l2norm(k) (eps 1e-6), ``gate(g_raw,
    A_log, dt_bias)``, ``sigmoid(beta_logits)``. g_raw: [B, T, HV, K]; beta_logits: [B, T, HV];
    other arguments and the result as in ``recurrent``."""
    q, k, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias)
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     cu_seqlens=cu_seqlens)


def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None,
                  initial_state=None, cu_seqlens=None, chunk_size=64):
    """``chunked`` after the same fused prologue as ``fused_recurrent``."""
    q, k, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias)
    return chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# validation and sequence handling


def _prologue(q, k, g_raw, beta_logits, A_log, dt_bias):
    return l2norm(q), l2norm(k), gate(g_raw, A_log, dt_bias), sigmoid(beta_logits)


def _expect(name, x, letters, shape):
    if x.shape != tuple(shape):
        raise ValueError(f"{name}: expected [{letters}] = {tuple(shape)}, got {x.shape}")


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Validate and cast; expand q, k to the HV value heads; returns the core's arguments."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    if q.ndim != 4:
        raise ValueError(f"q: expected [B,T,H,K], got {q.shape}")
    B, T, H, K = q.shape
    _expect("k", k, "B,T,H,K", q.shape)
    if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[2] % H != 0 or v.shape[2] == 0:
        raise ValueError(f"v: expected [B,T,HV,V] with B,T = {(B, T)} and HV a multiple of "
                         f"H = {H}, got {v.shape}")
    HV, V = v.shape[2:]
    _expect("g", g, "B,T,HV,K", (B, T, HV, K))
    _expect("beta", beta, "B,T,HV", (B, T, HV))
    if cu_seqlens is None:
        N = B
    else:
        cu = np.asarray(cu_seqlens)
        if B != 1:
            raise ValueError(f"cu_seqlens: requires B == 1, got q of shape {q.shape}")
        if (cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer)
                or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0)):
            raise ValueError(f"cu_seqlens: expected non-decreasing ints [N+1] from 0 to T = {T}, "
                             f"got {cu_seqlens!r}")
        N = cu.size - 1
    if initial_state is None:
        state = np.zeros((N, HV, K, V))
    else:
        # copy: the cores update the state in place, the caller's array must stay untouched
        state = np.array(initial_state, dtype=np.float64, copy=True)
        _expect("initial_state", state, "B,HV,K,V" if cu_seqlens is None else "N,HV,K,V",
                (N, HV, K, V))
    scale = K ** -0.5 if scale is None else float(scale)
    if HV != H:  # GVA: value head hv reads qk head hv // (HV // H)
        q, k = np.repeat(q, HV // H, axis=2), np.repeat(k, HV // H, axis=2)
    return q, k, v, g, beta, scale, state


def _over_sequences(core, args, cu_seqlens):
    """Run ``core`` on the whole batch, or on each ``cu_seqlens`` segment with its own state."""
    q, k, v, g, beta, scale, state = args
    if cu_seqlens is None:
        return core(q, k, v, g, beta, scale, state)
    cu = [int(c) for c in cu_seqlens]
    o = np.zeros(v.shape)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        o[:, s:e], state[n : n + 1] = core(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e],
                                           beta[:, s:e], scale, state[n : n + 1])
    return o, state


# ---------------------------------------------------------------------------------------------
# cores: q, k already expanded to [B, T, HV, K]; S [B, HV, K, V] is owned (updated in place)


def _recurrent_core(q, k, v, g, beta, scale, S):
    B, T, HV, V = v.shape
    o = np.zeros((B, T, HV, V))
    for t in range(T):
        S *= np.exp(g[:, t])[..., None]
        kt = k[:, t, :, None, :]  # [B, HV, 1, K]
        e = beta[:, t, :, None] * (v[:, t] - (kt @ S)[..., 0, :])  # [B, HV, V]
        S += k[:, t, :, :, None] * e[:, :, None, :]
        o[:, t] = scale * (q[:, t, :, None, :] @ S)[..., 0, :]
    return o, S


def _chunked_core(q, k, v, g, beta, scale, S, *, chunk_size):
    # Chunk by chunk, vectorized over B and heads: per-chunk temporaries stay a few MB (whole-sequence
    # temporaries at T = 4096 are 100+ MB each and cost more in page faults than in arithmetic).
    B, T, HV, V = v.shape
    o = np.empty((B, T, HV, V))
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)  # a ragged final chunk is just shorter: G_last = G[e-1]
        qc, kc, vc, gc = (np.moveaxis(x[:, s:e], 1, 2) for x in (q, k, v, g))  # [B, HV, c, *]
        bc = np.moveaxis(beta[:, s:e], 1, 2)[..., None]  # [B, HV, c, 1]
        oc, S = _chunk(qc, kc, vc, gc, bc, scale, S)
        o[:, s:e] = np.moveaxis(oc, 1, 2)
    return o, S


def _chunk(q, k, v, g, beta, scale, S):
    """One chunk, spec b.9 steps 1-8. q, k, g: [B, HV, c, K]; v: [B, HV, c, V]; beta: [B, HV, c, 1];
    S: [B, HV, K, V] at the chunk start. Returns (o [B, HV, c, V], S at the chunk end)."""
    K = k.shape[-1]
    G = np.array(g)  # inclusive prefix sum within the chunk, as a running sum over rows
    for i in range(1, G.shape[-2]):
        G[..., i, :] += G[..., i - 1, :]
    G_last = G[..., -1:, :]  # [B, HV, 1, K]
    eG = np.exp(G)
    qg, kg = q * eG, k * eG
    if np.max(np.abs(G)) <= _FACTORED_RANGE_MAX:
        # exp(G_i - G_j) = exp(G_i) * exp(-G_j): both factors within e^+-600, so every product
        # (also the ones masked away below) is finite; two BLAS products instead of c*c*K exps
        k_inv = k / eG
        k_inv_t = np.swapaxes(k_inv, -1, -2)
        Aqk, Akk = qg @ k_inv_t, kg @ k_inv_t
        kd = k_inv * np.exp(G_last)  # k exp(G_last - G)
    else:
        Aqk, Akk = _pairwise(q, k, G)
        kd = k * np.exp(G_last - G)
    Aqk = scale * np.tril(Aqk)  # query-key, i >= j
    Akk = beta * np.tril(Akk, -1)  # key-key, i > j
    # WY form: solve (I + Akk) [w | u] = [beta k exp(G) | beta v]
    wu = _solve_unit_lower(Akk, beta * np.concatenate([kg, v], axis=-1))
    w, u = wu[..., :K], wu[..., K:]
    v_new = u - w @ S
    o = scale * (qg @ S) + Aqk @ v_new
    S = np.swapaxes(np.exp(G_last), -1, -2) * S + np.swapaxes(kd, -1, -2) @ v_new
    return o, S


def _pairwise(q, k, G, rows=16):
    """``sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for x = q and x = k, [B,HV,c,c], zero for j > i.

    The exponent is set to -inf for j > i BEFORE exp: with strong decays those differences exceed
    float64's exp range. Blocks of ``rows`` query rows bound the [.., rows, c, K] temporaries."""
    c = G.shape[-2]
    Aqk = np.zeros(G.shape[:-1] + (c,))
    Akk = np.zeros_like(Aqk)
    for r0 in range(0, c, rows):
        r1 = min(r0 + rows, c)  # rows r0..r1-1 only reach columns < r1
        diff = G[..., r0:r1, None, :] - G[..., None, :r1, :]  # [B, HV, i, j, K]
        causal = (np.arange(r0, r1)[:, None] >= np.arange(r1)[None, :])[:, :, None]
        kd = np.exp(np.where(causal, diff, -np.inf)) * k[..., None, :r1, :]
        Aqk[..., r0:r1, :r1] = np.einsum("...ik,...ijk->...ij", q[..., r0:r1, :], kd)
        Akk[..., r0:r1, :r1] = np.einsum("...ik,...ijk->...ij", k[..., r0:r1, :], kd)
    return Aqk, Akk


def _solve_unit_lower(A, rhs, block=16):
    """X with (I + A) X = rhs for strictly lower A [..., c, c] (spec b.9 step 4).

    Blocked forward substitution: the diagonal ``block x block`` blocks of I + A are inverted row by
    row (all at once), then block row I is ``X_I = inv(I + A_II) (rhs_I - A_I,<I X_<I)``: the
    product M rhs with M = (I + A)^-1 of the spec, in a handful of numpy calls per chunk."""
    c = A.shape[-1]
    cp = -(-c // block) * block
    if cp != c:  # zero padding extends I + A by an identity block: inert
        A = np.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, cp - c), (0, cp - c)])
        rhs = np.pad(rhs, [(0, 0)] * (rhs.ndim - 2) + [(0, cp - c), (0, 0)])
    starts = range(0, cp, block)
    D = np.stack([A[..., s : s + block, s : s + block] for s in starts], axis=-3)
    N = np.broadcast_to(np.eye(block), D.shape).copy()  # -> inv(I + D), row i after rows < i
    for i in range(1, block):
        N[..., i, :] -= np.einsum("...j,...jk->...k", D[..., i, :i], N[..., :i, :])
    X = np.empty_like(rhs)
    for b, s in enumerate(starts):
        r = rhs[..., s : s + block, :]
        if s:
            r = r - A[..., s : s + block, :s] @ X[..., :s, :]
        X[..., s : s + block, :] = N[..., b, :, :] @ r
    return X[..., :c, :]
