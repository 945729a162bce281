"""optimized.kda (gate, recurrent, chunked and their fused forms) against the float64 reference.

Error model (written once, used by every comparison). ``u_d``: unit roundoff of the input dtype
(bf16 2^-8: what the chunked form's stored intermediates w, u, v_new, h, Aqk and its tl.dot operands
are rounded to); ``u_a``: unit roundoff of the compute dtype (fp32 2^-24; fp64 2^-53), in which
every dot accumulates and the state lives. Per sequence and value head, from the float64 trajectory
of the recurrence on the same (already rounded) inputs:

    Smax     = max(|S_t[d, v]| over t, d, v incl. the initial state; max |v_t|)
    mag_o[t] = scale * ||q_t||_1 * Smax   (abs-value size of o_t = scale S_t^T q_t, and a bound on
                                           the size of every partial sum the chunked form builds:
                                           (q e^G) S, Aqk v_new, u and w S, since e^G <= 1)

    |o - o_ref| <= C * mag_o * (rho_d * sqrt(nc) + u_a * (sqrt(K + min(T, BT) + nc) + Gc))
    |S - S_ref| <= the same with Smax in place of mag_o

- ``rho_d = u_d`` for 16-bit inputs, else 0 (fp32/fp64 runs store intermediates in the compute
  dtype): a fixed number of roundings of stored intermediates per output, and the state picks up one
  rounded v_new per chunk, accumulating as a random walk over the ``nc = ceil(T / BT)`` chunks;
- ``u_a * sqrt(n)``: the accumulations (dot over K, over the chunk's rows, across chunks);
- ``u_a * Gc``, ``Gc`` = the largest within-chunk prefix |G|: the chunked form takes differences of
  prefix sums, which costs u_a |G| of *absolute* accuracy in an exponent, i.e. a relative u_a |G| in
  a decay factor. Strong decays pay this term.
- ``C = 4`` counts the roundings per output and covers the interpreter's truncating f32 -> bf16 cast
  (one ulp, 2 u_d, instead of u_d; on a GPU the cast rounds to nearest).

A check also fails on NaN/Inf patterns that differ and on all-zero outputs, and
:func:`test_mutants_are_caught` shows wrong answers fail the same comparison.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from optimized import _counters, kda
from ._bounds import assert_within

rk = pytest.importorskip("reference.kda")

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
     torch.float64: 2.0 ** -53}
C = 4.0
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


# ------------------------------------------------------------------------------------------------
# inputs, reference, magnitudes


def make_inputs(B, T, H, HV, K, V, dtype, *, seed=0, strong=False, h0=False, N=None, device=DEV):
    """Random KDA inputs. q, k, v in ``dtype``; g, beta and the raw gate inputs in float32 (float64
    for fp64 runs). Returns a dict with the normalized (q, k) and raw (q_raw, k_raw) forms."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    side = torch.float64 if dtype == torch.float64 else torch.float32
    q_raw = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    k_raw = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=f64)
    g_raw = torch.randn(B, T, HV, K, generator=gen, dtype=f64)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=f64))
    # mild: softplus(~N(-4, 1.4)) * e^A_log ~ 0.02 .. 2 per token; strong: ~6 .. 150 per token
    dt_bias = torch.randn(HV * K, generator=gen, dtype=f64) + (6.0 if strong else -4.0)
    beta_logits = torch.randn(B, T, HV, generator=gen, dtype=f64)
    N = B if N is None else N
    s0 = 0.5 * torch.randn(N, HV, K, V, generator=gen, dtype=f64) if h0 else None
    g = torch.from_numpy(rk.gate(g_raw.numpy(), A_log.numpy(), dt_bias.numpy()))
    d = dict(q=F.normalize(q_raw, dim=-1).to(dtype), k=F.normalize(k_raw, dim=-1).to(dtype),
             q_raw=q_raw.to(dtype), k_raw=k_raw.to(dtype), v=v.to(dtype), g=g.to(side),
             beta=torch.sigmoid(beta_logits).to(side), g_raw=g_raw.to(side),
             beta_logits=beta_logits.to(side), A_log=A_log.to(side), dt_bias=dt_bias.to(side),
             h0=None if s0 is None else s0.to(side))
    return {k_: (x.to(device) if x is not None else None) for k_, x in d.items()}


def np64(x):
    return None if x is None else x.detach().to(torch.float64).cpu().numpy()


def reference(d, *, fused=False, cu=None, scale=None):
    """(o, final state) of reference.kda.recurrent (or fused_recurrent) in torch float64."""
    if fused:
        o, s = rk.fused_recurrent(np64(d["q_raw"]), np64(d["k_raw"]), np64(d["v"]), np64(d["g_raw"]),
                                  np64(d["beta_logits"]), np64(d["A_log"]), np64(d["dt_bias"]),
                                  scale=scale, initial_state=np64(d["h0"]), cu_seqlens=cu)
    else:
        o, s = rk.recurrent(np64(d["q"]), np64(d["k"]), np64(d["v"]), np64(d["g"]), np64(d["beta"]),
                            scale=scale, initial_state=np64(d["h0"]), cu_seqlens=cu)
    return torch.from_numpy(np.asarray(o)), torch.from_numpy(np.asarray(s))


def prologue64(d, fused):
    """The float64 (q, k, g, beta) the core sees, on the inputs' device."""
    dev = d["q"].device
    if not fused:
        return tuple(d[n].detach().to(torch.float64) for n in ("q", "k", "g", "beta"))
    q = d["q_raw"].detach().double()
    k = d["k_raw"].detach().double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = torch.from_numpy(np.asarray(rk.gate(np64(d["g_raw"]), np64(d["A_log"]), np64(d["dt_bias"]))))
    beta = torch.sigmoid(d["beta_logits"].detach().double())
    return q, k, g.to(dev), beta


def magnitudes(d, *, fused=False, cu=None, scale=None, BT=64):
    """(mag_o [B,T,HV,1], Smax [N,HV,1,1], Gc) from the float64 trajectory (see module doc); the
    trajectory runs in torch on the inputs' device, the results come back on the CPU."""
    q, k, g, beta = prologue64(d, fused)
    v = d["v"].detach().double()
    dev = v.device
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
    scale = K ** -0.5 if scale is None else scale
    bounds = [(b, 0, T) for b in range(B)] if cu is None else \
        [(0, int(s), int(e)) for s, e in zip(list(cu)[:-1], list(cu)[1:])]
    N = len(bounds)
    h0 = d["h0"]
    Smax = torch.zeros(N, HV, 1, 1, dtype=torch.float64, device=dev)
    mag_o = torch.zeros(B, T, HV, 1, dtype=torch.float64, device=dev)
    for n, (b, s, e) in enumerate(bounds):
        S = h0[n].detach().double().clone() if h0 is not None else \
            torch.zeros(HV, K, V, dtype=torch.float64, device=dev)
        m = S.abs().amax((1, 2))
        if e > s:
            m = torch.maximum(m, v[b, s:e].abs().amax((0, 2)))
        for t in range(s, e):
            S = S * g[b, t].exp()[..., None]
            delta = beta[b, t][:, None] * (v[b, t] - (k[b, t][..., None] * S).sum(1))
            S = S + k[b, t][..., None] * delta[:, None, :]
            m = torch.maximum(m, S.abs().amax((1, 2)))
        Smax[n, :, 0, 0] = m
        mag_o[b, s:e, :, 0] = scale * q[b, s:e].abs().sum(-1) * m
    mag_o, Smax = mag_o.cpu(), Smax.cpu()
    Gc = 0.0
    for b, s, e in bounds:  # largest within-chunk prefix |G| (chunks restart at sequence starts)
        gs = g[b, s:e]
        if gs.shape[0]:
            pad = (-gs.shape[0]) % BT
            gs = torch.cat([gs, gs.new_zeros((pad,) + gs.shape[1:])]).view(-1, BT, *gs.shape[1:])
            Gc = max(Gc, float(gs.cumsum(1).abs().max()))
    return mag_o, Smax, Gc


def err_scale(dtype, T, K, BT=64, Gc=0.0):
    """The bracket of the bound: rho_d sqrt(nc) + u_a (sqrt(K + min(T, BT) + nc) + Gc)."""
    u_a = U[torch.float64] if dtype == torch.float64 else U[torch.float32]
    rho_d = U[dtype] if U[dtype] > U[torch.float32] else 0.0
    nc = max(1, math.ceil(T / BT))
    return rho_d * math.sqrt(nc) + u_a * (math.sqrt(K + min(T, BT) + nc) + Gc)


def check(what, d, o, s, *, fused=False, cu=None, BT=64, scale=None, ref=None):
    """Compare (o, state) against the reference within the bound; returns the two err/bound ratios."""
    ro, rs = ref if ref is not None else reference(d, fused=fused, cu=cu, scale=scale)
    mag_o, Smax, Gc = magnitudes(d, fused=fused, cu=cu, scale=scale, BT=BT)
    T, K = d["q"].shape[1], d["q"].shape[3]
    e = C * err_scale(d["q"].dtype, T, K, BT, Gc)
    assert s.dtype == (torch.float64 if d["q"].dtype == torch.float64 else torch.float32), \
        f"{what}: state dtype {s.dtype}"
    assert o.dtype == d["q"].dtype, f"{what}: output dtype {o.dtype}"
    return assert_within(f"{what} o", o, ro, e * mag_o), assert_within(f"{what} state", s, rs, e * Smax)


def run(op, d, **kw):
    if op in ("recurrent", "chunked"):
        args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    else:
        args = (d["q_raw"], d["k_raw"], d["v"], d["g_raw"], d["beta_logits"], d["A_log"], d["dt_bias"])
    return getattr(kda, op)(*args, initial_state=d["h0"], **kw)


# ------------------------------------------------------------------------------------------------
# gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_gate(dtype):
    # |g - g_ref| <= 8 (|x| + 1) u_a |g_ref| + tiny, x = g_raw + dt_bias: exp's argument reduction
    # on a GPU costs ~|x| u_a; softplus, exp(A_log) and the product a few u_a. Output is fp32 (fp64).
    gen = torch.Generator().manual_seed(3)
    B, T, HV, K = 2, 37, 3, 24
    g_raw = (torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64) * 8).to(dtype)
    g_raw.view(-1)[:8] = torch.tensor([20.0, 21.0, 19.5, -30.0, -80.0, 0.0, 60.0, -3.0]).to(dtype)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=torch.float64)).to(dtype)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=torch.float64).to(dtype)
    _counters.reset()
    g = kda.gate(g_raw.to(DEV), A_log.to(DEV), dt_bias.to(DEV))
    assert _counters.snapshot()["kda.gate"] == 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert g.dtype == acc and g.shape == (B, T, HV, K)
    ref = torch.from_numpy(rk.gate(np64(g_raw), np64(A_log), np64(dt_bias)))
    x = g_raw.double() + dt_bias.double().view(HV, K)
    bound = 8 * (x.abs() + 1) * U[acc] * ref.abs() + torch.finfo(acc).tiny
    assert_within("gate", g, ref, bound)
    assert bool((g <= 0).all())
    # checkpoint-shaped A_log [1,1,HV,1] is accepted
    g2 = kda.gate(g_raw.to(DEV), A_log.view(1, 1, HV, 1).to(DEV), dt_bias.to(DEV))
    assert torch.equal(g, g2)
    # teeth: A_log + 1 is e times the gate
    bad = kda.gate(g_raw.to(DEV), (A_log + 1).to(DEV), dt_bias.to(DEV))
    with pytest.raises(AssertionError):
        assert_within("gate mutant", bad, ref, bound)


# ------------------------------------------------------------------------------------------------
# recurrent / chunked against the reference


CASES = [  # (B, T, H, HV, K, V, initial state)
    pytest.param(2, 65, 1, 2, 32, 64, True, id="B2-T65-gva-K32V64-h0"),
    pytest.param(1, 1, 2, 2, 16, 32, True, id="T1"),
    pytest.param(1, 15, 1, 1, 32, 16, False, id="T15"),
    pytest.param(1, 63, 1, 1, 16, 32, False, id="T63"),
    pytest.param(1, 64, 1, 2, 32, 16, True, id="T64-gva"),
    pytest.param(1, 130, 1, 1, 64, 32, True, id="T130-K64V32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,h0", CASES)
def test_chunked_fp32(B, T, H, HV, K, V, h0):
    d = make_inputs(B, T, H, HV, K, V, torch.float32, seed=T, h0=h0)
    _counters.reset()
    o, s = run("chunked", d)
    assert _counters.snapshot()["kda.chunked"] == 1
    check("chunked fp32", d, o, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_chunked_dtypes(dtype):
    d = make_inputs(2, 65, 1, 2, 32, 64, dtype, seed=1, h0=True)
    o, s = run("chunked", d)
    check(f"chunked {dtype}", d, o, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("T", [1, 15, 65])
def test_recurrent(dtype, T):
    d = make_inputs(2, T, 1, 2, 32, 16, dtype, seed=10 + T, h0=True)
    _counters.reset()
    o, s = run("recurrent", d)
    assert _counters.snapshot()["kda.recurrent"] == 1
    check(f"recurrent {dtype}", d, o, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused(dtype):
    """fused_chunked and fused_recurrent (raw q/k, g_raw, beta logits) vs reference.fused_recurrent,
    and the chunked vs recurrent kernels against each other (sum of both bounds)."""
    d = make_inputs(1, 70, 2, 4, 32, 32, dtype, seed=5, h0=True)
    ref = reference(d, fused=True)
    _counters.reset()
    oc, sc = run("fused_chunked", d)
    orr, sr = run("fused_recurrent", d)
    snap = _counters.snapshot()
    assert snap["kda.fused_chunked"] == 1 and snap["kda.fused_recurrent"] == 1
    check("fused_chunked", d, oc, sc, fused=True, ref=ref)
    check("fused_recurrent", d, orr, sr, fused=True, ref=ref)
    mag_o, Smax, Gc = magnitudes(d, fused=True)
    e = 2 * C * err_scale(dtype, 70, 32, 64, Gc)
    assert_within("fused chunked vs recurrent o", oc, orr.double().cpu(), e * mag_o)
    assert_within("fused chunked vs recurrent state", sc, sr.double().cpu(), e * Smax)


def test_fused_fp64():
    d = make_inputs(1, 33, 1, 1, 16, 16, torch.float64, seed=6, h0=True)
    ref = reference(d, fused=True)
    check("fused_chunked fp64", d, *run("fused_chunked", d), fused=True, ref=ref)
    check("fused_recurrent fp64", d, *run("fused_recurrent", d), fused=True, ref=ref)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes(chunk_size):
    d = make_inputs(1, 50, 1, 1, 16, 16, torch.float32, seed=chunk_size, h0=True)
    o, s = run("chunked", d, chunk_size=chunk_size)
    check(f"chunked BT={chunk_size}", d, o, s, BT=chunk_size)


def test_varlen():
    """cu_seqlens with an empty and a ragged sequence, per-sequence initial states; chunked and
    recurrent, fused and not (chunks restart at every sequence start)."""
    cu = [0, 5, 5, 70, 130]
    d = make_inputs(1, 130, 1, 2, 32, 32, torch.float32, seed=7, h0=True, N=len(cu) - 1)
    for op in ("chunked", "recurrent"):
        o, s = run(op, d, cu_seqlens=torch.tensor(cu))
        assert s.shape == (4, 2, 32, 32)
        check(f"{op} varlen", d, o, s, cu=cu)
    ref_f = reference(d, fused=True, cu=cu)
    for op in ("fused_chunked", "fused_recurrent"):
        o, s = run(op, d, cu_seqlens=cu)  # a plain list works too
        check(f"{op} varlen", d, o, s, cu=cu, fused=True, ref=ref_f)
    # the empty sequence passes its initial state through unchanged
    assert torch.equal(s[1], d["h0"][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strong_decay(dtype):
    """Decays of ~6 .. 150 per token (prefix sums to ~-5000 within a chunk, pairwise differences far
    past exp's range): finite outputs, within the bound (whose u_a * Gmax term this exercises)."""
    d = make_inputs(1, 80, 1, 2, 32, 32, dtype, seed=8, strong=True, h0=True)
    ref = reference(d, fused=True)
    for op in ("fused_chunked", "fused_recurrent"):
        o, s = run(op, d)
        assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(s).all()), op
        check(f"{op} strong", d, o, s, fused=True, ref=ref)


def test_bf16_gate_and_beta_inputs():
    """g and beta given in bf16 (the kernels widen any float dtype on load)."""
    d = make_inputs(1, 40, 1, 1, 16, 16, torch.bfloat16, seed=9)
    d["g"], d["beta"] = d["g"].bfloat16(), d["beta"].bfloat16()
    check("chunked bf16 g/beta", d, *run("chunked", d))


def naive_chunk_stages(d, BT, scale=None):
    """float64 torch, chunk by chunk: the intermediates the chunk kernels store (G, Aq, w, u, h, v_new),
    shaped like their buffers (B = 1 or many, no cu_seqlens)."""
    q, k, g, beta = (x.cpu() for x in prologue64(d, False))
    v = d["v"].detach().cpu().double()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    scale = K ** -0.5 if scale is None else scale
    NT = math.ceil(T / BT)
    f64 = dict(dtype=torch.float64)
    out = dict(G=torch.zeros(B, T, HV, K, **f64), Aq=torch.zeros(B, T, HV, BT, **f64),
               w=torch.zeros(B, T, HV, K, **f64), u=torch.zeros(B, T, HV, V, **f64),
               v_new=torch.zeros(B, T, HV, V, **f64), h=torch.zeros(B * NT, HV, K, V, **f64),
               kg=torch.zeros(B, T, HV, K, **f64), qg=torch.zeros(B, T, HV, K, **f64))
    for b in range(B):
        S = (d["h0"][b].detach().cpu().double().clone() if d["h0"] is not None
             else torch.zeros(HV, K, V, **f64))
        for c in range(NT):
            s, e = c * BT, min(T, c * BT + BT)
            L = e - s
            G = g[b, s:e].cumsum(0)  # [L, HV, K]
            qc, kc, vc, bc = q[b, s:e], k[b, s:e], v[b, s:e], beta[b, s:e]
            mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[:, :, None, None]
            decay = torch.exp(torch.where(mask, G[:, None] - G[None, :], float("-inf")))  # [i, j, HV, K]
            Akk = torch.einsum("ihk,jhk,ijhk->hij", kc, kc, decay) * bc.T[:, :, None]
            Akk = Akk * torch.tril(torch.ones(L, L, **f64), -1)
            Aqk = scale * torch.einsum("ihk,jhk,ijhk->hij", qc, kc, decay)
            M = torch.linalg.inv(torch.eye(L, **f64) + Akk)  # [HV, L, L]
            w = M @ (bc.T[:, :, None] * (kc * G.exp()).transpose(0, 1))
            u = M @ (bc.T[:, :, None] * vc.transpose(0, 1))
            out["G"][b, s:e] = G
            out["Aq"][b, s:e, :, :L] = Aqk.transpose(0, 1)
            out["w"][b, s:e], out["u"][b, s:e] = w.transpose(0, 1), u.transpose(0, 1)
            out["h"][b * NT + c] = S
            vn = u - w @ S
            out["v_new"][b, s:e] = vn.transpose(0, 1)
            Gl = G[-1]  # [HV, K]
            out["kg"][b, s:e] = kc * (Gl[None] - G).exp()
            out["qg"][b, s:e] = scale * qc * G.exp()
            S = Gl.exp()[:, :, None] * S + (kc * (Gl[None] - G).exp()).permute(1, 2, 0) @ vn
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_stages(dtype):
    """Each stored intermediate of the chunk pipeline against its formula (localizes a wrong kernel:
    G -> gate kernel; Aq, kg, qg -> blocks kernel; w, u -> WY kernel; h, v_new -> state kernel). Per
    stage and head the error is judged against 4 C * (rho_d sqrt(nc) + u_a (sqrt(n) + Gc)) * max|stage| (the test_kda
    bracket; 4 C since w, u are products with the inverse, whose size the stage max understates)."""
    from optimized.kda import chunk as chunk_mod
    T, BT = 100, 64
    d = make_inputs(2, T, 1, 2, 32, 32, dtype, seed=14, h0=True)
    st = {}
    chunk_mod._pipeline("kda.chunked", d["q"], d["k"], d["v"], d["g"], d["beta"], None, None, None,
                        d["h0"], BT, None, fused=False, stages=st)
    ref = naive_chunk_stages(d, BT)
    _, _, Gc = magnitudes(d, BT=BT)
    e = 4 * C * err_scale(dtype, T, 32, BT, Gc)
    ratios = {}
    for name in ("G", "Aq", "w", "u", "kg", "qg", "h", "v_new"):
        r = ref[name]
        dims = (0, 1, 3) if name != "h" else (0, 2, 3)  # per value head
        scale_ = r.abs().amax(dim=dims, keepdim=True)
        ratios[name] = assert_within(f"stage {name} ({dtype})", st[name], r, e * scale_)
    print(f"chunk stages {dtype}: err/bound " + ", ".join(f"{n} {x:.3g}" for n, x in ratios.items()))


# ------------------------------------------------------------------------------------------------
# bytes: determinism and split invariance


def test_run_to_run_bitwise():
    d = make_inputs(1, 70, 1, 2, 32, 32, torch.bfloat16, seed=11, h0=True)
    for op in ("fused_chunked", "fused_recurrent"):
        a, b = run(op, d), run(op, d)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), op


def test_gate_channel_blocks():
    """K = 96 > 64: the gate kernel runs two channel programs per (chunk, head), the second one
    partly masked, and only the first writes beta (the real K = 128 takes two full ones)."""
    d = make_inputs(1, 70, 1, 2, 96, 16, torch.float32, seed=22, h0=True)
    o, s = run("fused_chunked", d)
    check("fused_chunked K=96", d, o, s, fused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_no_kernel_reads_unwritten_memory(dtype, monkeypatch):
    """Every buffer the chunk pipeline allocates starts as NaN: the output and state keep their bits,
    so no kernel reads an element no kernel wrote (the blocks right of Akk's and Aqk's diagonal, rows
    past a sequence end), ragged and varlen."""
    cu = [0, 5, 5, 70, 130]
    d = make_inputs(1, 130, 1, 2, 32, 32, dtype, seed=21, h0=True, N=len(cu) - 1)
    clean = [run("fused_chunked", d, cu_seqlens=cu), run("fused_chunked", d | {"h0": d["h0"][:1]})]
    empty = torch.empty

    def poisoned(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    dirty = [run("fused_chunked", d, cu_seqlens=cu), run("fused_chunked", d | {"h0": d["h0"][:1]})]
    for (o, s), (o2, s2) in zip(clean, dirty):
        assert torch.equal(o, o2) and torch.equal(s, s2)


def test_split_prefill():
    """Prefill in two calls carrying the state: bitwise equal to one call when the split is at a
    chunk boundary (chunked) or anywhere (recurrent: the state stays fp32 either way); within the
    bound at an unaligned chunked split."""
    T = 96
    d = make_inputs(1, T, 1, 2, 32, 32, torch.float32, seed=12, h0=True)

    def part(sl, h0):
        e = dict(d)
        for n in ("q_raw", "k_raw", "v", "g_raw", "beta_logits"):
            e[n] = d[n][:, sl]
        e["h0"] = h0
        return e

    for op, split, exact in (("fused_chunked", 64, True), ("fused_recurrent", 37, True),
                             ("fused_chunked", 40, False)):
        o, s = run(op, d)
        o1, s1 = run(op, part(slice(0, split), d["h0"]))
        o2, s2 = run(op, part(slice(split, T), s1))
        o12 = torch.cat([o1, o2], 1)
        if exact:
            assert torch.equal(o12, o) and torch.equal(s2, s), f"{op} split at {split}"
        else:
            mag_o, Smax, Gc = magnitudes(d, fused=True)
            e = 2 * C * err_scale(torch.float32, T, 32, 64, Gc)
            assert_within(f"{op} split {split} o", o12, o.double().cpu(), e * mag_o)
            assert_within(f"{op} split {split} state", s2, s.double().cpu(), e * Smax)


# ------------------------------------------------------------------------------------------------
# teeth and argument checks


@pytest.mark.parametrize("mutant", ["beta_dropped", "gate_sign", "state_transposed", "l2norm_skipped"])
def test_mutants_are_caught(mutant):
    """Each wrong answer fails the same comparison the real op passes (K = V here so a transposed
    state is shape-compatible)."""
    d = make_inputs(1, 70, 1, 2, 32, 32, torch.float32, seed=13, h0=True)
    ref = reference(d)
    check("unmutated", d, *run("chunked", d), ref=ref)
    e = dict(d)
    if mutant == "beta_dropped":
        e["beta"] = torch.ones_like(d["beta"])
    elif mutant == "gate_sign":  # growth capped so the mutant stays finite
        e["g"] = (-d["g"]).clamp(max=0.05)
    elif mutant == "state_transposed":
        e["h0"] = d["h0"].transpose(-1, -2).contiguous()
    elif mutant == "l2norm_skipped":
        e["q"], e["k"] = d["q_raw"], d["k_raw"]
    o, s = run("chunked", e)
    with pytest.raises(AssertionError, match="bound|pattern|degenerate"):
        check(f"mutant {mutant}", d, o, s, ref=ref)


def test_argument_errors():
    d = make_inputs(1, 8, 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="v:"):
        kda.chunked(d["q"], d["k"], d["v"][:, :4], d["g"], d["beta"])
    with pytest.raises(ValueError, match="beta"):
        kda.recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"][..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], chunk_size=48)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="dt_bias"):
        kda.fused_recurrent(d["q"], d["k"], d["v"], d["g_raw"], d["beta_logits"], d["A_log"],
                            d["dt_bias"][:5])
    with pytest.raises(TypeError, match="dtype"):
        kda.recurrent(d["q"], d["k"], d["v"].double(), d["g"], d["beta"])


# ------------------------------------------------------------------------------------------------
# GPU only: the model's shapes (the lead runs these on the H200)

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (real shapes are too slow for the interpreter)")


@gpu
@pytest.mark.parametrize("T", [1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_fused_chunked_real_shapes(T, dtype):
    d = make_inputs(1, T, 32, 32, 128, 128, dtype, seed=T, h0=True)
    ref = rk.fused_chunked(np64(d["q_raw"]), np64(d["k_raw"]), np64(d["v"]), np64(d["g_raw"]),
                           np64(d["beta_logits"]), np64(d["A_log"]), np64(d["dt_bias"]),
                           initial_state=np64(d["h0"]))
    ref = tuple(torch.from_numpy(np.asarray(x)) for x in ref)
    o, s = run("fused_chunked", d)
    ratios = check(f"gpu fused_chunked T={T}", d, o, s, fused=True, ref=ref)
    print(f"fused_chunked {dtype} T={T}: err/bound o {ratios[0]:.3g}, state {ratios[1]:.3g}")
    if T == 1000:
        orr, sr = run("fused_recurrent", d)
        ratios = check(f"gpu fused_recurrent T={T}", d, orr, sr, fused=True, ref=ref)
        print(f"fused_recurrent {dtype} T={T}: err/bound o {ratios[0]:.3g}, state {ratios[1]:.3g}")
    o2, s2 = run("fused_chunked", d)
    assert torch.equal(o, o2) and torch.equal(s, s2)


@gpu
def test_gpu_chunked_fp64_and_varlen():
    cu = [0, 1, 300, 301, 1000]
    d = make_inputs(1, 1000, 4, 8, 128, 64, torch.float64, seed=2, h0=True, N=4)
    ref = reference(d, cu=cu)
    r1 = check("gpu chunked fp64 varlen", d, *run("chunked", d, cu_seqlens=torch.tensor(cu, device=DEV)),
               cu=cu, ref=ref)
    r2 = check("gpu recurrent fp64 varlen", d, *run("recurrent", d, cu_seqlens=cu), cu=cu, ref=ref)
    print(f"fp64 varlen err/bound: chunked {r1}, recurrent {r2}")
