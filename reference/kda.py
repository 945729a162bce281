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

Written against the array API standard (``reference.executor``): runs on NumPy, torch float64 (CPU
or CUDA) and array-api-strict alike; no op writes into an array.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .elementwise import sigmoid, softplus
from .checks import check_lower_bound
from .executor import device_of, namespace, to_numpy
from .norm import l2norm

# The chunked form evaluates exp(G_i - G_j) as exp(G_i) * exp(-G_j) when every |G| of a chunk is
# at most this (both factors then lie in [e^-600, e^600], far from float64 over/underflow, and
# every product, also the ones masked away, stays finite); otherwise it falls back to the pairwise
# difference masked to -inf before exp. Both are accurate to a few ulp; the first is BLAS-fast,
# the second costs c*c*K exps per chunk and head.
_FACTORED_RANGE_MAX = 600.0
# The chunked form's state-free work runs on blocks of chunks of about this many bytes an array: on
# a GPU 128 MB (64 chunks at the 48B model's 32 heads of 128: a few dozen launches a block, where one
# chunk at a time took ~100 a chunk; a 32k-token 48B layer took 0.207 s on an H200, 0.242 s with
# 32 MB blocks), on a CPU 2 MB (one chunk there; larger blocks measured 10-20% slower on NumPy,
# their temporaries out of cache; small heads still take many chunks a block)
CHUNK_BLOCK_BYTES = 1 << 27
CPU_CHUNK_BLOCK_BYTES = 1 << 21


def gate(g_raw, A_log, dt_bias, *, lower_bound=None):
    """KDA forget gate (spec b.6): the log-space decay ``g [B, T, HV, K]`` (<= 0).

    ``lower_bound`` None, the softplus gate of Kimi-Linear-48B: ``g = -exp(A_log[hv]) *
    softplus(g_raw + dt_bias)`` (torch's threshold 20). ``lower_bound`` a number ``b`` in [-5, 0),
    the bounded ("safe") gate of the later KDA models: ``g = b * sigmoid(exp(A_log[hv]) * (g_raw +
    dt_bias))``, in (b, 0); there ``A_log`` may be None: ``g = b * sigmoid(g_raw + dt_bias)``.

    g_raw: [B, T, HV, K]; A_log: [HV] (the checkpoint's [1, 1, HV, 1] is accepted too); dt_bias:
    [HV*K] (flat index ``hv*K + d``).
    """
    b = check_lower_bound(lower_bound)
    xp = namespace(g_raw, dt_bias) if A_log is None else namespace(g_raw, A_log, dt_bias)
    g_raw = xp.asarray(g_raw, dtype=xp.float64)
    dt_bias = xp.asarray(dt_bias, dtype=xp.float64)
    if g_raw.ndim != 4:
        raise ValueError(f"g_raw: expected [B,T,HV,K], got {tuple(g_raw.shape)}")
    HV, K = g_raw.shape[2:]
    if tuple(dt_bias.shape) != (HV * K,):
        raise ValueError(f"dt_bias: expected [HV*K] = ({HV * K},), got {tuple(dt_bias.shape)}")
    z = g_raw + xp.reshape(dt_bias, (HV, K))
    if A_log is None:
        if b is None:
            raise ValueError("A_log: None is the bounded gate's form only (give lower_bound, or A_log)")
        return b * sigmoid(z)
    A_log = xp.asarray(A_log, dtype=xp.float64)
    if tuple(A_log.shape) == (1, 1, HV, 1):
        A_log = xp.reshape(A_log, (HV,))
    if tuple(A_log.shape) != (HV,):
        raise ValueError(f"A_log: expected [HV] = ({HV},) or [1,1,HV,1], got {tuple(A_log.shape)}")
    a = xp.exp(A_log)[:, None]
    if b is None:
        return -a * softplus(z)
    return b * sigmoid(a * z)


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
    past 709 within a chunk) therefore give finite results equal to the recurrence's. Blocks of
    chunks (``block_chunks``) run in sequence: a block's steps before the state vectorized over B,
    heads and its chunks, the state's steps chunk by chunk.
    """
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    args = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return _over_sequences(partial(_chunked_core, chunk_size=int(chunk_size)), args, cu_seqlens)


def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None,
                    initial_state=None, cu_seqlens=None, lower_bound=None):
    """``recurrent`` after the fused prologue: l2norm(q), l2norm(k) (eps 1e-6), ``gate(g_raw,
    A_log, dt_bias, lower_bound=lower_bound)`` (None: the softplus gate; a number: the bounded
    gate, where A_log may be None), ``sigmoid(beta_logits)``. g_raw: [B, T, HV, K]; beta_logits:
    [B, T, HV]; other arguments and the result as in ``recurrent``."""
    q, k, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, lower_bound)
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     cu_seqlens=cu_seqlens)


def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None,
                  initial_state=None, cu_seqlens=None, chunk_size=64, lower_bound=None):
    """``chunked`` after the same fused prologue as ``fused_recurrent``."""
    q, k, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, lower_bound)
    return chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# validation and sequence handling


def _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, lower_bound=None):
    return l2norm(q), l2norm(k), gate(g_raw, A_log, dt_bias, lower_bound=lower_bound), sigmoid(beta_logits)


def _expect(name, x, letters, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected [{letters}] = {tuple(shape)}, got {tuple(x.shape)}")


def _cu_seqlens(cu_seqlens, B, T, shape):
    """``cu_seqlens`` as host ints (it is metadata: the loop bounds), validated."""
    if B != 1:
        raise ValueError(f"cu_seqlens: requires B == 1, got q of shape {shape}")
    cu = to_numpy(cu_seqlens)
    if (cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer)
            or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0)):
        raise ValueError(f"cu_seqlens: expected non-decreasing ints [N+1] from 0 to T = {T}, "
                         f"got {cu_seqlens!r}")
    return [int(c) for c in cu]


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Validate and cast; expand q, k to the HV value heads; returns the core's arguments."""
    xp = namespace(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (xp.asarray(x, dtype=xp.float64) for x in (q, k, v, g, beta))
    if q.ndim != 4:
        raise ValueError(f"q: expected [B,T,H,K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    _expect("k", k, "B,T,H,K", q.shape)
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] % H != 0 or v.shape[2] == 0:
        raise ValueError(f"v: expected [B,T,HV,V] with B,T = {(B, T)} and HV a multiple of "
                         f"H = {H}, got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    _expect("g", g, "B,T,HV,K", (B, T, HV, K))
    _expect("beta", beta, "B,T,HV", (B, T, HV))
    N = B if cu_seqlens is None else len(_cu_seqlens(cu_seqlens, B, T, tuple(q.shape))) - 1
    if initial_state is None:
        state = xp.zeros((N, HV, K, V), dtype=xp.float64, device=device_of(q))
    else:  # no core writes its state: the caller's array stays untouched without a copy
        state = xp.asarray(initial_state, dtype=xp.float64)
        _expect("initial_state", state, "B,HV,K,V" if cu_seqlens is None else "N,HV,K,V",
                (N, HV, K, V))
    scale = K ** -0.5 if scale is None else float(scale)
    if HV != H:  # GVA: value head hv reads qk head hv // (HV // H)
        q, k = xp.repeat(q, HV // H, axis=2), xp.repeat(k, HV // H, axis=2)
    return q, k, v, g, beta, scale, state


def _over_sequences(core, args, cu_seqlens):
    """Run ``core`` on the whole batch, or on each ``cu_seqlens`` segment with its own state."""
    q, k, v, g, beta, scale, state = args
    if cu_seqlens is None:
        return core(q, k, v, g, beta, scale, state)
    xp = namespace(q)
    cu = _cu_seqlens(cu_seqlens, 1, q.shape[1], tuple(q.shape))
    outs, states = [], []
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        o, st = core(q[:, s:e, ...], k[:, s:e, ...], v[:, s:e, ...], g[:, s:e, ...], beta[:, s:e, ...], scale,
                     state[n : n + 1, ...])
        outs.append(o)
        states.append(st)
    return xp.concat(outs, axis=1), xp.concat(states, axis=0)


# ---------------------------------------------------------------------------------------------
# cores: q, k already expanded to [B, T, HV, K]; S [B, HV, K, V] at the start; nothing is written


def _recurrent_core(q, k, v, g, beta, scale, S):
    xp = namespace(q)
    B, T, HV, V = v.shape
    outs = []
    for t in range(T):
        S = S * xp.exp(g[:, t, ...])[..., None]
        kt = k[:, t, :, None, :]  # [B, HV, 1, K]
        e = beta[:, t, :, None] * (v[:, t, ...] - (kt @ S)[..., 0, :])  # [B, HV, V]
        S = S + k[:, t, :, :, None] * e[:, :, None, :]
        outs.append(scale * (q[:, t, :, None, :] @ S)[..., 0, :])
    o = xp.stack(outs, axis=1) if outs else xp.zeros((B, 0, HV, V), dtype=xp.float64, device=device_of(q))
    return o, S


def _chunked_core(q, k, v, g, beta, scale, S, *, chunk_size):
    # Blocks of whole chunks: each block's state-free work (prefix sums, the masked products, the
    # WY solve) runs on all its chunks at once, vectorized over B, heads and chunks; only the three
    # products that carry the state run chunk by chunk (block sizes: CHUNK_BLOCK_BYTES). A ragged
    # final chunk runs on its own.
    xp = namespace(q)
    B, T, HV, V = v.shape
    c = chunk_size
    step = block_chunks(B, HV, q.shape[-1], V, c, gpu=getattr(device_of(q), "type", None) == "cuda") * c
    full = T - T % c
    bounds = [(s, min(s + step, full)) for s in range(0, full, step)] + ([(full, T)] if full < T else [])
    outs = []
    for s, e in bounds:
        n = max(1, (e - s) // c)
        oc, S = _chunks(*(x[:, s:e, ...] for x in (q, k, v, g, beta)), scale, S, n)
        outs.append(oc)
    o = xp.concat(outs, axis=1) if outs else xp.zeros((B, 0, HV, V), dtype=xp.float64, device=device_of(q))
    return o, S


def block_chunks(B: int, HV: int, K: int, V: int, chunk_size: int = 64, *, gpu: bool = True) -> int:
    """How many chunks the chunked form takes at a time: ``CHUNK_BLOCK_BYTES`` (on a CPU
    ``CPU_CHUNK_BLOCK_BYTES``) of ``[B, HV, c, max(K, V, c)]`` float64 arrays, at least one chunk."""
    budget = CHUNK_BLOCK_BYTES if gpu else CPU_CHUNK_BLOCK_BYTES
    return max(1, budget // (B * HV * chunk_size * max(K, V, chunk_size) * 8))


def block_bytes(B: int, T: int, HV: int, K: int, V: int, chunk_size: int = 64) -> int:
    """Bytes of one ``[B, HV, n, c, max(K, V, c)]`` float64 array of the largest block of chunks a
    ``T``-token call takes on any device (``reference.memory`` counts a few dozen of them)."""
    n = min(max(block_chunks(B, HV, K, V, chunk_size, gpu=gpu) for gpu in (True, False)), -(-T // chunk_size))
    return n * B * HV * chunk_size * max(K, V, chunk_size) * 8


def _chunks(q, k, v, g, beta, scale, S, n):
    """``n`` consecutive chunks of equal length ``c`` (the tokens of ``q [B, n c, HV, K]`` etc.):
    ``(o [B, n c, HV, V], S after the last)``. Every chunk whose ``|G|`` stays within
    ``_FACTORED_RANGE_MAX`` takes the factored products; if any chunk does not, each chunk chooses
    for itself (``_chunk``)."""
    xp = namespace(q)
    B, Tn, HV, V = v.shape
    c = Tn // n
    split = lambda x: xp.permute_dims(xp.reshape(x, (B, n, c, HV, x.shape[-1])), (0, 3, 1, 2, 4))  # noqa: E731
    qc, kc, vc, gc, bc = (split(x) for x in (q, k, v, g, beta[..., None]))  # [B, HV, n, c, *]
    G = xp.cumulative_sum(gc, axis=-2)  # inclusive prefix sum within each chunk (sequential adds)
    factored = bool(xp.max(xp.abs(G)) <= _FACTORED_RANGE_MAX)
    if n > 1 and not factored:
        outs = []
        for j in range(n):
            oc, S = _chunk(*(x[:, :, j, ...] for x in (qc, kc, vc, gc, bc)), scale, S)
            outs.append(oc)
        o = xp.stack(outs, axis=2)
    else:
        o, S = _chunk(qc, kc, vc, gc, bc, scale, S, G=G, factored=factored)
    return xp.reshape(xp.permute_dims(o, (0, 2, 3, 1, 4)), (B, Tn, HV, V)), S


def _chunk(q, k, v, g, beta, scale, S, *, G=None, factored=None):
    """Spec b.9 steps 1-8 on chunks of c tokens. q, k, g: [B, HV, (n,) c, K]; v: [B, HV, (n,) c, V];
    beta: [B, HV, (n,) c, 1]; S: [B, HV, K, V] at the first chunk's start; ``G``: the prefix sums
    of ``g`` and ``factored``: whether every ``|G|`` is within ``_FACTORED_RANGE_MAX``, if known.
    With the chunk axis ``n`` (all chunks factored), steps 1-4 run on every chunk at once and the
    state's steps chunk by chunk. Returns (o shaped like v, S at the end)."""
    xp = namespace(q, k, v, g, beta, S)
    K = k.shape[-1]
    G = xp.cumulative_sum(g, axis=-2) if G is None else G  # inclusive prefix sum within the chunk
    G_last = G[..., -1:, :]  # [B, HV, (n,) 1, K]
    eG = xp.exp(G)
    qg, kg = q * eG, k * eG
    if bool(xp.max(xp.abs(G)) <= _FACTORED_RANGE_MAX) if factored is None else factored:
        # exp(G_i - G_j) = exp(G_i) * exp(-G_j): both factors within e^+-600, so every product
        # (also the ones masked away below) is finite; two BLAS products instead of c*c*K exps
        k_inv = k / eG
        k_inv_t = xp.matrix_transpose(k_inv)
        Aqk, Akk = qg @ k_inv_t, kg @ k_inv_t
        kd = k_inv * xp.exp(G_last)  # k exp(G_last - G)
    else:
        Aqk, Akk = _pairwise(q, k, G)
        kd = k * xp.exp(G_last - G)
    Aqk = scale * xp.tril(Aqk)  # query-key, i >= j
    Akk = beta * xp.tril(Akk, k=-1)  # key-key, i > j
    # WY form: solve (I + Akk) [w | u] = [beta k exp(G) | beta v]
    wu = _solve_unit_lower(Akk, beta * xp.concat([kg, v], axis=-1))
    w, u = wu[..., :K], wu[..., K:]
    decay, kd_t = xp.matrix_transpose(xp.exp(G_last)), xp.matrix_transpose(kd)
    if q.ndim == 4:
        return _carry(w, u, qg, Aqk, decay, kd_t, scale, S)
    outs = []
    for j in range(q.shape[2]):
        oc, S = _carry(*(x[:, :, j, ...] for x in (w, u, qg, Aqk, decay, kd_t)), scale, S)
        outs.append(oc)
    return xp.stack(outs, axis=2), S


def _carry(w, u, qg, Aqk, decay, kd_t, scale, S):
    """One chunk's steps that read the state (spec b.9 steps 5-8): ``(o [B, HV, c, V], new S)``."""
    v_new = u - w @ S
    o = scale * (qg @ S) + Aqk @ v_new
    return o, decay * S + kd_t @ v_new


def _pairwise(q, k, G, rows=16):
    """``sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for x = q and x = k, [B,HV,c,c], zero for j > i.

    The exponent is set to -inf for j > i BEFORE exp: with strong decays those differences exceed
    float64's exp range. Blocks of ``rows`` query rows bound the [.., rows, c, K] temporaries."""
    xp = namespace(q, k, G)
    c = G.shape[-2]
    dev = device_of(G)
    Aqk, Akk = [], []
    for r0 in range(0, c, rows):
        r1 = min(r0 + rows, c)  # rows r0..r1-1 only reach columns < r1
        diff = G[..., r0:r1, None, :] - G[..., None, :r1, :]  # [B, HV, i, j, K]
        causal = (xp.arange(r0, r1, device=dev)[:, None] >= xp.arange(r1, device=dev)[None, :])[:, :, None]
        kd = xp.exp(xp.where(causal, diff, -xp.inf)) * k[..., None, :r1, :]  # [B, HV, i, j, K]
        pad = xp.zeros(G.shape[:-2] + (r1 - r0, c - r1), dtype=xp.float64, device=dev)
        for x, out in ((q, Aqk), (k, Akk)):
            blk = (kd @ x[..., r0:r1, :, None])[..., 0]  # [B, HV, i, j]: sum over K per (i, j)
            out.append(xp.concat([blk, pad], axis=-1))
    return xp.concat(Aqk, axis=-2), xp.concat(Akk, axis=-2)


def _solve_unit_lower(A, rhs, block=16):
    """X with (I + A) X = rhs for strictly lower A [..., c, c] (spec b.9 step 4).

    Blocked forward substitution: the diagonal ``block x block`` blocks of I + A are inverted row by
    row (all at once), then block row I is ``X_I = inv(I + A_II) (rhs_I - A_I,<I X_<I)``: the
    product M rhs with M = (I + A)^-1 of the spec, in a handful of array calls per chunk."""
    xp = namespace(A, rhs)
    c = A.shape[-1]
    cp = -(-c // block) * block
    dev = device_of(A)
    if cp != c:  # zero padding extends I + A by an identity block: inert
        lead = tuple(A.shape[:-2])
        A = xp.concat([A, xp.zeros(lead + (c, cp - c), dtype=xp.float64, device=dev)], axis=-1)
        A = xp.concat([A, xp.zeros(lead + (cp - c, cp), dtype=xp.float64, device=dev)], axis=-2)
        rhs = xp.concat([rhs, xp.zeros(tuple(rhs.shape[:-2]) + (cp - c, rhs.shape[-1]),
                                       dtype=xp.float64, device=dev)], axis=-2)
    starts = range(0, cp, block)
    D = xp.stack([A[..., s : s + block, s : s + block] for s in starts], axis=-3)  # [..., nb, b, b]
    eye = xp.broadcast_to(xp.eye(block, dtype=xp.float64, device=dev), D.shape)
    rows = [eye[..., 0, :]]  # row i of inv(I + D) after rows < i: e_i - D[i, :i] N[:i]
    for i in range(1, block):
        rows.append(eye[..., i, :] - (D[..., i, None, :i] @ xp.stack(rows, axis=-2))[..., 0, :])
    N = xp.stack(rows, axis=-2)  # [..., nb, b, b]
    X = []
    for b, s in enumerate(starts):
        r = rhs[..., s : s + block, :]
        if s:
            r = r - A[..., s : s + block, :s] @ xp.concat(X, axis=-2)
        X.append(N[..., b, :, :] @ r)
    return xp.concat(X, axis=-2)[..., :c, :]
