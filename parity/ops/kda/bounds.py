"""Bounds of the KDA ops (docs/error-bounds.md, section 4).

The recurrence is linear in the state: an error dS made at step t is carried by
``dS <- (I - beta k k^T) diag(exp(g)) dS``, whose 2-norm is at most ``max_d exp(g_d) *
max(1, |1 - beta |k|^2|)`` (<= 1 for unit keys). So per value column j the state error obeys

    E_t^2 = rho_t^2 E_{t-1}^2 + lam_t^2          (independent local errors add in quadrature)

with lam_t the norm bound of what step t rounds (decay, the K-long dot k^T S, the delta, the outer
product, the add), and a linear part D (errors of one sign, worst case) carried by the same rho. The
chunked kernels round more: intermediates in the run dtype (u, not ua) --
the key-key matrix A and its inverse M = (I + A)^-1, the WY rows w and u, v_new, the chunk-start
state h and the query-key matrix Q -- which enter through |M| (|A| + I) (Skeel's bound of the
triangular solve), |Q| and the decayed keys. Their products take operands rounded to the run dtype,
so A and Q err relative to the sums of their absolute terms (|k||k|, |q||k|), not to |A|, |Q|,
and M built from its diagonal blocks' inverses by such products errs relative to its terms' sum.
These storage terms are worst-case bounds of each chunk's contribution, so they join D.
Every magnitude is evaluated in float64 from the same inputs the candidate saw. The fused ops add
the errors of their prologue (l2norm, gate, sigmoid) as perturbations of the core inputs.

Arithmetic contracts (parity.bounds.core.CONTRACTS) reach these models through ``Precision.uop``:
what a matrix product does to its operands (TF32 reads float32 operands with 10 mantissa bits).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from parity.bounds.core import LAMBDA, exp_rel, gamma, sig, underflow
from parity.ops import _slots
from parity.ops.norm.bounds import rms_rel
from reference.executor import device_of, namespace

from .args import segments


def gate(x, kw, ref, p):
    """g = -exp(A_log) softplus(z), z = g_raw + dt_bias: the add (ua |z|) reaches softplus through
    its slope sigmoid(z); softplus itself (see parity.ops.elementwise.bounds.softplus); exp(A_log) and
    the product. With ``lower_bound``: the bounded gate's model, :func:`bounded_gate_err`."""
    g_raw, A_log, dt = x["g_raw"], x["A_log"], x["dt_bias"]
    b = kw.get("lower_bound")
    if b is not None:
        return {"g": bounded_gate_err(g_raw, A_log, dt, b, p, p.uo("g"))}
    return {"g": _gate_err(g_raw, A_log, dt, ref["g"], p, p.uo("g"))}


def _gate_err(g_raw, A_log, dt, g, p, uo):
    HV, K = g_raw.shape[2:]
    z = g_raw + dt.reshape(HV, K)
    e = np.exp(A_log)[:, None]
    zz = np.exp(-np.abs(z))
    sp = np.maximum(z, 0) + np.log1p(zz)
    dsp = sig(z) * p.ua * np.abs(z) + p.ua * (exp_rel(z) * zz / (1 + zz) + 4 * sp)
    return e * dsp + (p.ua * (exp_rel(A_log)[:, None] + 1.0) + uo) * np.abs(g)


def bounded_gate(g_raw, A_log, dt, b):
    """``(g, s, y)`` of the bounded gate in float64: ``y = exp(A_log) (g_raw + dt_bias)`` (no factor
    without A_log), ``s = sigmoid(y)``, ``g = b s``."""
    HV, K = g_raw.shape[2:]
    y = g_raw + dt.reshape(HV, K)
    if A_log is not None:
        y = np.exp(np.reshape(A_log, (HV,)))[:, None] * y
    s = sig(y)
    return b * s, s, y


def bounded_gate_err(g_raw, A_log, dt, b, p, uo):
    """Bound of ``g = b sigmoid(y)``, ``y = exp(A_log) (g_raw + dt_bias)`` (docs/error-bounds.md,
    "The bounded gate"), per element:

    - ``y`` errs by ``|dy| <= ua |y| (1 + [A] (exp_rel(A_log) + 1))``: the add's rounding carried by
      the factor, exp(A_log)'s own error and the product (only the add without A_log);
    - sigmoid's slope is ``s (1 - s)``, so that error moves ``s`` by ``(1 - s) |dy|`` relative to ``s``:
      damped where the gate saturates at the bound (s -> 1), the exponential's conditioning |y| where
      s -> 0. Its evaluation, ``1 / (1 + z)`` or ``z / (1 + z)`` with ``z = exp(-|y|)`` (or ``1 / (1 +
      exp(-y))``), carries exp's relative error ``exp_rel(y) ua`` damped the same way, ``z / (1 + z) =
      1 - s`` for ``y >= 0`` and ``1 / (1 + z) = 1 - s`` otherwise, plus three roundings (add,
      divide, multiply);
    - the product with ``b`` and ``b``'s own rounding to the arithmetic dtype: ``2 ua``; the store ``uo``;
    - where sigmoid underflows (``s`` below the arithmetic dtype's smallest normal, ``tiny``: y below
      about -87 in float32) a kernel returns 0 or a subnormal (flushed on a GPU): relative error means
      nothing there, so the bound is absolute, ``2 |b| tiny``, everywhere (it is below float32's
      resolution of any gate that does not underflow)."""
    g, s, y = bounded_gate(g_raw, A_log, dt, b)
    ea = 0.0 if A_log is None else exp_rel(np.reshape(A_log, (-1,)))[:, None] + 1.0
    dy = p.ua * np.abs(y) * (1.0 + ea)
    rel = (1.0 - s) * (dy + p.ua * exp_rel(y)) + 5.0 * p.ua + uo
    return rel * np.abs(g) + 2.0 * abs(b) * underflow(p.dtype)


def _norm(a, axis):
    return np.sqrt(np.sum(a * a, axis=axis))


def core_bound(q, k, v, g, beta, h0, scale, cu, p, *, chunk=None, stored=False, extra=None,
               o_ref=None, s_ref=None, uo_o=None, uo_s=None):
    """Per-element bounds of (o, final_state) of KDA (recurrent if ``chunk`` is None, else the
    chunked algorithm with chunk length ``chunk``; ``stored``: intermediates kept in the run dtype).

    ``extra`` (fused ops): per-token perturbation bounds of the core inputs: ``dq, dk`` ([B,T,H]
    norm bounds of the normalized q, k errors), ``dg`` ([B,T,HV,K] absolute), ``dbeta``
    ([B,T,HV]).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G_ = HV // H
    hmap = np.arange(HV) // G_
    us = p.us(stored)
    ua = p.ua
    o_b = np.zeros((B, T, HV, V))
    segs = segments(B, T, cu)
    s_b = np.zeros((len(segs), HV, K, V))
    # a K-long product of register operands: its accumulation, and under a contract that rounds the
    # operands (TF32: truncation, errors of one sign) their rounding, carried linearly in D
    ud0 = 2 * p.uop(False)
    gK = gamma(K, ua) + ud0
    for (b, t0, t1, n) in segs:
        S = np.zeros((HV, K, V)) if h0 is None else h0[n].copy()
        E2 = np.zeros((HV, V))
        D = np.zeros((HV, V))
        L = t1 - t0
        C = L if chunk is None else chunk
        for c0 in range(t0, t1, C if chunk else max(L, 1)):
            c1 = min(c0 + C, t1) if chunk else t1
            S0 = S.copy()
            Gc = np.zeros((HV, K))
            rows = []
            for t in range(c0, c1):
                gt = g[b, t]
                a = np.exp(gt)
                kt, qt = k[b, t, hmap], q[b, t, hmap]
                vt, bt = v[b, t], beta[b, t]
                Sp = a[:, :, None] * S
                kS = np.einsum("hk,hkv->hv", kt, Sp)
                e = bt[:, None] * (vt - kS)
                S = Sp + kt[:, :, None] * e[:, None, :]
                nSp, nS = _norm(Sp, 1), _norm(S, 1)
                nk, nq = _norm(kt, 1), _norm(qt, 1)
                # the K-long dot k^T S~ errs by gamma_K(ua) |k| |S~| (Cauchy-Schwarz): absolute, not a
                # multiple of ua like the one-rounding terms
                lam = ua * (exp_rel(np.max(np.abs(gt), axis=1))[:, None] * nSp
                            + nSp + nk[:, None] * (bt[:, None] * (np.abs(vt) + np.abs(kS)) + np.abs(e)) + nS) \
                    + bt[:, None] * nk[:, None] * (gamma(K, ua) * nk[:, None] * nSp)
                if extra is not None:
                    dk = extra["dk"][b, t, hmap][:, None]
                    dg = np.max(extra["dg"][b, t], axis=1)[:, None]
                    db = extra["dbeta"][b, t][:, None]
                    lam = lam + dk * (np.abs(e) + bt[:, None] * nk[:, None] * nSp) + dg * nSp \
                        + nk[:, None] * db * np.abs(vt - kS)
                rho = np.max(a, axis=1) * np.maximum(1.0, np.abs(1.0 - bt * nk * nk))
                E2 = rho[:, None] ** 2 * E2 + lam ** 2
                D = rho[:, None] * D + bt[:, None] * nk[:, None] * (ud0 * nk[:, None] * nSp)
                Gc = Gc + gt
                ob = scale * (nq[:, None] * (LAMBDA * np.sqrt(E2) + D)
                              + gK * np.einsum("hk,hkv->hv", np.abs(qt), np.abs(S)))
                if extra is not None:
                    ob = ob + scale * extra["dq"][b, t, hmap][:, None] * nS
                o_b[b, t] = ob
                rows.append((t, qt, kt, e, bt, Gc.copy()))
            if chunk and stored:   # worst-case terms: to the linear part, not the quadrature LAMBDA scales
                D = D + _chunk_extras(rows, S0, scale, us, ua, o_b, b, chunk, ud=p.uop(stored))
        s_b[n] = (LAMBDA * np.sqrt(E2) + D)[:, None, :]
    o_b = o_b + (ua + uo_o) * np.abs(o_ref)
    s_b = s_b + uo_s * np.abs(s_ref)
    return o_b, s_b


def _chunk_extras(rows, S0, scale, us, ua, o_b, b, chunk, ud=None):
    """Add the chunked algorithm's storage roundings of one chunk to the output bounds (in place)
    and return their contribution to the state error at the chunk end, per value column: first-order
    worst-case bounds (each rounding at its full ``u``), so the caller adds it to the linear part of
    the state error, which ``LAMBDA`` does not scale. ``ud``: the unit roundoff of a
    stored intermediate as a matrix product reads it (``Precision.uop(True)``; default ``us``, IEEE):
    every ``2 ud`` below is a product's two rounded operands, every ``us`` a storage alone."""
    ud = us if ud is None else ud
    C = len(rows)
    ts = [r[0] for r in rows]
    Q = np.stack([r[1] for r in rows], 1)          # [HV, C, K]
    Kc = np.stack([r[2] for r in rows], 1)
    Ev = np.stack([r[3] for r in rows], 1)         # [HV, C, V] = v_new
    Bt = np.stack([r[4] for r in rows], 1)         # [HV, C]
    G = np.stack([r[5] for r in rows], 1)          # [HV, C, K]
    HV, _, K = Q.shape
    gC, gK = gamma(C, ua), gamma(K, ua)
    low = np.tril(np.ones((C, C)), -1).astype(bool)
    lowd = np.tril(np.ones((C, C))).astype(bool)
    D = G[:, :, None, :] - G[:, None, :, :]         # G_i - G_j
    Dm = np.where(lowd[None, :, :, None], D, -np.inf)
    W = np.exp(Dm)                                  # masked decays, <= 1
    A = np.where(low[None], Bt[:, :, None] * np.einsum("hik,hjk,hijk->hij", Kc, Kc, W), 0.0)
    Qm = np.where(lowd[None], scale * np.einsum("hik,hjk,hijk->hij", Q, Kc, W), 0.0)
    # |terms| of the K-long dots behind A and Q: their operands (decayed k and q rows) are rounded to
    # the run dtype, so each errs relative to these sums, not to |A| or |Q|, which cancel (keys
    # that repeat or span few directions: 3.3x past the bound without it, T = 9, K = 32)
    Ab = np.where(low[None], np.einsum("hik,hjk,hijk->hij", np.abs(Kc), np.abs(Kc), W) * Bt[:, :, None], 0.0)
    Qb = np.where(lowd[None], scale * np.einsum("hik,hjk,hijk->hij", np.abs(Q), np.abs(Kc), W), 0.0)
    I = np.eye(C)[None]
    M = np.linalg.inv(I + A)
    Mabs = np.abs(M)
    Rw = Bt[..., None] * Kc * np.exp(G)             # the right-hand sides: beta k exp(G) ...
    w = np.einsum("hij,hjk->hik", M, Rw)
    nS0 = _norm(S0, 1)                              # [HV, V]
    # u = M (beta v); recover beta v from v_new + w S0 (v_new = u - w S0)
    uu = Ev + np.einsum("hik,hkv->hiv", w, S0)
    Ru = np.abs(np.einsum("hij,hjv->hiv", I + A, uu))   # ... and beta v
    # triangular solve (Skeel): |dX| <= |M| (|dA| + gamma_C(ua) (I + Ab)) |X|, |dA| <= us |A| +
    # (2 us + gamma_K(ua)) Ab; M and the right-hand side R are rounded as operands of X = M R
    # (2 us |M| |R|); then X's storage
    P = np.einsum("hij,hjl->hil", Mabs, ud * np.abs(A) + (2 * ud + gK) * Ab + gC * (I + Ab))
    Mop = 2 * ud * Mabs + _merge_roundings(A, ud, chunk)   # what M errs by as the operand of X = M R
    du = np.einsum("hil,hlv->hiv", P, np.abs(uu)) + np.einsum("hij,hjv->hiv", Mop, Ru) + us * np.abs(uu)
    dw = _norm(np.einsum("hil,hlk->hik", P, np.abs(w)) + np.einsum("hij,hjk->hik", Mop, np.abs(Rw))
               + us * np.abs(w), 2)                 # [HV, C]
    nw = _norm(w, 2)
    # w h: h read as an operand (ud), w's storage already in dw, its read by the product (ud - us)
    dv = du + (dw + (2 * ud - us + gK) * nw)[..., None] * nS0[:, None, :] + us * np.abs(Ev)  # [HV, C, V]
    # outputs: h (chunk-start state) times scale q exp(G), both operands stored; Q (from rounded
    # operands, then stored) and v_new stored; their dots
    qg = np.abs(Q) * np.exp(G)
    oh = scale * (2 * ud + gK) * np.einsum("hik,hkv->hiv", qg, np.abs(S0))
    oq = (np.einsum("hij,hjv->hiv", np.abs(Qm), (2 * ud + gC) * np.abs(Ev) + dv)
          + np.einsum("hij,hjv->hiv", (2 * ud + gK) * Qb, np.abs(Ev)))
    for i, t in enumerate(ts):
        o_b[b, t] += oh[:, i] + oq[:, i]
    # state: kg = k exp(G_last - G) and v_new stored, C-long dot
    kg = Kc * np.exp(G[:, -1:, :] - G)
    nkg = _norm(kg, 2)                              # [HV, C]
    st = np.einsum("hi,hiv->hv", nkg, (2 * ud + gC) * np.abs(Ev) + dv) + us * nS0
    return st


BLOCK = 16  # rows of the diagonal blocks a chunk's inverse is built from (ours and fla's)


def _merge_roundings(A, us, chunk):
    """``|dM|`` of ``M = (I + A)^-1`` built from the inverses ``D`` of its 16-row diagonal blocks
    by products whose operands are rounded to the run dtype: ``(I + N)^-1 D``, ``N = D A_off``, as
    ``(I - N)(I + N^2)...`` (log2(C/16) levels, 2 dots each, less one). Every term of every such
    product is a path of ``|D|`` and ``|A_off|`` factors, a term of ``sum_k |N|^k |D|`` with
    ``|N| = |D| |A_off|``, and each dot rounds both operands: ``|dM| <= 2 dots us sum_k |N|^k |D|``
    (first order). Zero for one block (``D`` itself: formed in ACC, rounded once as M's operand).
    The levels are the chunk size's, also in a ragged last chunk (its missing rows are zeros)."""
    HV, C, _ = A.shape
    nb = -(-C // BLOCK)
    levels = int(np.ceil(np.log2(max(1, -(-chunk // BLOCK)))))
    if nb <= 1 or levels == 0:
        return np.zeros_like(A)
    D = np.zeros_like(A)
    for b0 in range(0, C, BLOCK):
        sl = slice(b0, min(b0 + BLOCK, C))
        n = sl.stop - sl.start
        D[:, sl, sl] = np.linalg.inv(np.eye(n)[None] + A[:, sl, sl])
    off = A.copy()
    for b0 in range(0, C, BLOCK):
        off[:, b0:b0 + BLOCK, b0:b0 + BLOCK] = 0.0
    N = np.abs(D) @ np.abs(off)                      # strictly block-lower: N^nb = 0
    term, chain = np.abs(D), np.abs(D)
    for _ in range(nb - 1):
        term = N @ term
        chain = chain + term
    dots = 2 * levels   # N = D A_off, then per level X += P X, and P = P P but at the last
    return 2 * dots * us * chain


def recurrent(x, kw, ref, p, *, chunk=None, stored=False):
    o, s = core_bound(x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("initial_state"),
                      _scale(kw, x["q"]), x.get("cu_seqlens"), p, chunk=chunk, stored=stored,
                      o_ref=ref["o"], s_ref=ref["final_state"], uo_o=p.uo("o"), uo_s=p.uo("final_state"))
    return {"o": o, "final_state": s}


def chunked(x, kw, ref, p):
    return recurrent(x, kw, ref, p, chunk=int(kw.get("chunk_size", 64)), stored=True)


def _scale(kw, q):
    s = kw.get("scale")
    return q.shape[-1] ** -0.5 if s is None else float(s)


def _l2(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def fused(x, kw, ref, p, *, chunk=None, stored=False):
    """Fused ops: the core bound evaluated at the composed inputs, with the prologue's errors
    (l2norm in ua, then stored in the run dtype by the chunked path; the gate; sigmoid(beta)) added
    as perturbations of q, k, g, beta."""
    q, k = _l2(x["q"]), _l2(x["k"])
    K = q.shape[-1]
    us = p.us(stored)
    relqk = rms_rel(K, p) + p.ua + us
    dq = relqk * np.linalg.norm(q, axis=-1)
    dk = relqk * np.linalg.norm(k, axis=-1)
    HV, Kk = x["g_raw"].shape[2:]
    b = kw.get("lower_bound")
    if b is None:
        z = x["g_raw"] + x["dt_bias"].reshape(HV, Kk)
        g = -np.exp(x["A_log"])[:, None] * (np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z))))
        dg = _gate_err(x["g_raw"], x["A_log"], x["dt_bias"], g, p, p.ua)
    else:   # the bounded gate: its error (absolute where it underflows) perturbs g like the softplus gate's
        g = bounded_gate(x["g_raw"], x["A_log"], x["dt_bias"], b)[0]
        dg = bounded_gate_err(x["g_raw"], x["A_log"], x["dt_bias"], b, p, p.ua)
    bl = x["beta_logits"]
    beta = sig(bl)
    db = p.ua * (exp_rel(bl) + 3.0) * beta
    o, s = core_bound(q, k, x["v"], g, beta, x.get("initial_state"), _scale(kw, q),
                      x.get("cu_seqlens"), p, chunk=chunk, stored=stored,
                      extra={"dq": dq, "dk": dk, "dg": dg, "dbeta": db},
                      o_ref=ref["o"], s_ref=ref["final_state"], uo_o=p.uo("o"), uo_s=p.uo("final_state"))
    return {"o": o, "final_state": s}


def qk_l2norm(x, kw, ref, p, *, chunk=None, stored=False):
    """The core ops with only the q, k l2norm fused in the call (fla's ``use_qk_l2norm_in_kernel``
    with the gate and beta given; transformers' KimiLinear calls): the core bound at the normalized
    q, k, with the l2norm's error (in ``ua``, then stored in the run dtype by the chunked path) as
    a perturbation of q and k, exactly as :func:`fused` counts it; g and beta are exact inputs."""
    q, k = _l2(x["q"]), _l2(x["k"])
    K = q.shape[-1]
    relqk = rms_rel(K, p) + p.ua + p.us(stored)
    g, beta = x["g"], x["beta"]
    extra = {"dq": relqk * np.linalg.norm(q, axis=-1), "dk": relqk * np.linalg.norm(k, axis=-1),
             "dg": np.zeros(np.shape(g)), "dbeta": np.zeros(np.shape(beta))}
    o, s = core_bound(q, k, x["v"], g, beta, x.get("initial_state"), _scale(kw, q), x.get("cu_seqlens"), p,
                      chunk=chunk, stored=stored, extra=extra, o_ref=ref["o"], s_ref=ref["final_state"],
                      uo_o=p.uo("o"), uo_s=p.uo("final_state"))
    return {"o": o, "final_state": s}


def qk_l2norm_recurrent(x, kw, ref, p):
    return qk_l2norm(x, kw, ref, p)


def qk_l2norm_chunked(x, kw, ref, p):
    return qk_l2norm(x, kw, ref, p, chunk=int(kw.get("chunk_size", 64)), stored=True)


def fused_recurrent(x, kw, ref, p):
    return fused(x, kw, ref, p)


def fused_chunked(x, kw, ref, p):
    return fused(x, kw, ref, p, chunk=int(kw.get("chunk_size", 64)), stored=True)


def fused_recurrent_decode(x, kw, r, p):
    """:func:`fused_recurrent`'s model (T = 1) on the named slots; untouched rows and padding exact."""
    rows, slots = _slots.valid(x)
    o_b = np.zeros(np.shape(r["o"]))
    pool_b = np.zeros(np.shape(r["state_pool"]))
    if rows.size:
        sub = {n: x[n][rows][:, None] for n in ("q", "k", "v", "g_raw", "beta_logits")}
        sub.update(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["state_pool"][slots], cu_seqlens=None)
        rr = {"o": r["o"][rows][:, None], "final_state": r["state_pool"][slots]}
        pp = dataclasses.replace(p, out={"o": p.uo("o"), "final_state": p.uo("state_pool")})
        b = fused(sub, kw, rr, pp)
        o_b[rows] = b["o"][:, 0]
        pool_b[slots] = b["final_state"]
    return {"o": o_b, "state_pool": pool_b}


READOUT_BLOCK = 64  # positions whose states are held to take their read-outs' kappa together


def readout_condition(q, k, v, g, beta, initial_state=None):
    """Condition number of the read-out ``o_t = scale S_t^T q_t`` at every position, per value head
    (docs/error-bounds.md, "Model level"): ``kappa = ||diag(q_t) S_t||_F / ||S_t^T q_t||``.

    If every element of ``q_t`` and ``S_t`` errs relatively by at most ``eps`` through independent
    roundings, each ``o_t[j]`` errs by at most ``LAMBDA eps sqrt(2 sum_d q_d^2 S_dj^2)`` (Hoeffding),
    so the relative error of ``o_t`` is at most ``sqrt(2) LAMBDA eps kappa``: ``kappa`` is how much
    the read-out amplifies the relative error its operands carry. It is about 1 for a generic query
    and large where ``S^T q`` cancels. One sequence: ``q, k [T, H, K]``, ``v [T, HV, V]``,
    ``g [T, HV, K]``, ``beta [T, HV]`` (the core's inputs, q and k normalized),
    ``initial_state [HV, K, V]`` or None. Returns ``(kappa [T, HV], final state)``; a read-out that is
    exactly zero has ``kappa`` inf unless its terms are all zero (then 1). Float64 arrays of any
    array API library (the diff's replay passes the reference's own, on its device); the result
    is of that library.
    """
    xp = namespace(q, k, v, g, beta, initial_state)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV != H:  # GVA: value head hv reads qk head hv // (HV // H)
        q, k = xp.repeat(q, HV // H, axis=1), xp.repeat(k, HV // H, axis=1)
    dev = device_of(v)
    S = (xp.zeros((HV, K, V), dtype=xp.float64, device=dev) if initial_state is None
         else xp.asarray(initial_state, dtype=xp.float64))
    kappa, states = [], []
    for t in range(T):
        kt = k[t, ...]
        S = xp.exp(g[t, ...])[:, :, None] * S
        e = beta[t, ...][:, None] * (v[t, ...] - (kt[:, None, :] @ S)[:, 0, :])
        S = S + kt[:, :, None] * e[:, None, :]
        states.append(S)
        if len(states) == READOUT_BLOCK or t == T - 1:  # the read-outs of a block of positions at once
            kappa.append(read_out_kappa(q[t + 1 - len(states):t + 1, ...], xp.stack(states, axis=0)))
            states = []
    out = xp.concat(kappa, axis=0) if kappa else xp.ones((0, HV), dtype=xp.float64, device=dev)
    return out, S


def read_out_kappa(q, S):
    """``kappa [..., HV]`` of read-outs ``S^T q`` (``q [..., HV, K]``, ``S [..., HV, K, V]``, any array
    API library): ``||diag(q) S||_F / ||S^T q||``, 1 where every term is zero."""
    xp = namespace(q, S)
    with np.errstate(divide="ignore", invalid="ignore"):  # NumPy's; other libraries divide silently
        terms = xp.sqrt(xp.sum(q * q * xp.sum(S * S, axis=-1), axis=-1))
        out = xp.sqrt(xp.sum(((q[..., None, :] @ S)[..., 0, :]) ** 2, axis=-1))
        return xp.where(terms > 0, terms / out, 1.0)
