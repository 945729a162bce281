"""KDA in torch at float32 arithmetic (see parity.emulate): gate, the recurrence, the chunked
algorithm (a plain port of spec b.9), the fused compositions, the in-place decode step over a
state pool, and the core ops with only the q/k l2norm fused (the ``+qk_l2norm`` variants).

Mutations (the internal mutants): ``output_before_update`` (o reads the state before the step's
update), ``chunk_boundary_off_by_one`` (the carried state decays by the prefix sum one row short of
the chunk's last row), ``l2norm_skipped``, ``beta_sigmoid_skipped``, ``gate_sign_flipped`` (fused:
the gate's sign lost inside the kernel), ``clamped_softplus`` (the bounded gate as ``max(b,
-exp(A_log) softplus(g_raw + dt_bias))``, a port's mistake: the softplus gate clamped at the bound
instead of ``b sigmoid(...)``).
"""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation
from parity.ops.norm.emulate import l2norm

from .args import segments


def gate(g_raw, A_log, dt_bias, *, lower_bound=None, mutation=None):
    check_mutation("gate", mutation, ("A_log_not_exponentiated", "clamped_softplus"))
    cd = cdt(g_raw.dtype)
    HV, K = g_raw.shape[2:]
    z = g_raw.to(cd) + dt_bias.to(cd).reshape(HV, K)
    if A_log is None:
        a = torch.ones(HV, dtype=cd, device=z.device)
    else:
        a = A_log.to(cd) if mutation == "A_log_not_exponentiated" else torch.exp(A_log.to(cd))
    if lower_bound is not None and mutation != "clamped_softplus":
        return (lower_bound * torch.sigmoid(a[:, None] * z)).to(cd)
    sp = torch.clamp(z, min=0) + torch.log1p(torch.exp(-z.abs()))
    sp = torch.where(z > 20.0, z, sp)
    g = -a[:, None] * sp
    if mutation == "clamped_softplus" and lower_bound is not None:
        g = torch.clamp(g, min=lower_bound)
    return g.to(cd)


def _setup(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    cd = cdt(v.dtype)
    rep = HV // H
    qe = q.to(cd).repeat_interleave(rep, dim=2)
    ke = k.to(cd).repeat_interleave(rep, dim=2)
    scale = K ** -0.5 if scale is None else scale
    segs = segments(B, T, cu_seqlens)
    S = torch.zeros(len(segs), HV, K, V, dtype=cd, device=v.device) if initial_state is None \
        else initial_state.to(cd).clone()
    return qe, ke, v.to(cd), g.to(cd), beta.to(cd), scale, segs, S


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, mutation=None):
    check_mutation("recurrent", mutation, ("output_before_update",))
    qe, ke, vc, gc, bc, scale, segs, S = _setup(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o = torch.zeros_like(vc)
    for (b, t0, t1, n) in segs:
        St = S[n]
        for t in range(t0, t1):
            Sp = torch.exp(gc[b, t])[:, :, None] * St
            kS = torch.einsum("hk,hkv->hv", ke[b, t], Sp)
            e = bc[b, t][:, None] * (vc[b, t] - kS)
            Snew = Sp + ke[b, t][:, :, None] * e[:, None, :]
            used = St if mutation == "output_before_update" else Snew
            o[b, t] = scale * torch.einsum("hk,hkv->hv", qe[b, t], used)
            St = Snew
        S[n] = St
    return o.to(v.dtype), S.to(cdt(v.dtype))


def _stage_buffers(B, T, HV, K, V, C, dtype, device):
    NT = -(-T // C)
    z = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    return {"G": z(B, T, HV, K), "Aq": z(B, T, HV, C), "w": z(B, T, HV, K), "u": z(B, T, HV, V),
            "v_new": z(B, T, HV, V), "h": z(B * NT, HV, K, V), "kg": z(B, T, HV, K), "qg": z(B, T, HV, K)}


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
            mutation=None, stages=None):
    """``stages`` (a dict, no cu_seqlens): receives the intermediates the chunk kernels store, shaped
    like their buffers (optimized/kda/chunk.py ``_pipeline(stages=)``): G (prefix sums), Aq (the
    query-key blocks), w, u (WY rows), v_new, h (each chunk's start state), kg, qg."""
    check_mutation("chunked", mutation, ("chunk_boundary_off_by_one",))
    qe, ke, vc, gc, bc, scale, segs, S = _setup(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o = torch.zeros_like(vc)
    if stages is not None:
        B, T, HV, K = gc.shape
        stages.update(_stage_buffers(B, T, HV, K, vc.shape[-1], chunk_size, vc.dtype, vc.device))
    for (b, t0, t1, n) in segs:
        St = S[n]                                             # [HV, K, V]
        for c0 in range(t0, t1, chunk_size):
            c1 = min(c0 + chunk_size, t1)
            C = c1 - c0
            qq = qe[b, c0:c1].transpose(0, 1)                  # [HV, C, K]
            kk = ke[b, c0:c1].transpose(0, 1)
            vv = vc[b, c0:c1].transpose(0, 1)                  # [HV, C, V]
            bb = bc[b, c0:c1].transpose(0, 1)                  # [HV, C]
            G = torch.cumsum(gc[b, c0:c1].transpose(0, 1), dim=1)   # [HV, C, K]
            D = G[:, :, None, :] - G[:, None, :, :]            # G_i - G_j
            low = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device))
            Wd = torch.exp(torch.where(low[None, :, :, None], D, torch.full_like(D, -float("inf"))))
            Akk = bb[:, :, None] * torch.einsum("hik,hjk,hijk->hij", kk, kk, Wd)
            Akk = Akk.masked_fill(~torch.tril(low, -1)[None], 0)
            Aqk = scale * torch.einsum("hik,hjk,hijk->hij", qq, kk, Wd)
            I = torch.eye(C, dtype=vc.dtype, device=v.device)[None]
            M = torch.linalg.solve_triangular(I + Akk, I.expand_as(Akk).contiguous(), upper=False,
                                              unitriangular=True)
            w = M @ (bb[..., None] * kk * torch.exp(G))
            u = M @ (bb[..., None] * vv)
            vnew = u - w @ St
            o[b, c0:c1] = (scale * (qq * torch.exp(G)) @ St + Aqk @ vnew).transpose(0, 1)
            last = C - 2 if (mutation == "chunk_boundary_off_by_one" and C > 1) else C - 1
            Gl = G[:, last:last + 1, :]                        # [HV, 1, K]
            kg = kk * torch.exp(Gl - G)
            if stages is not None:
                t = slice(c0, c1)
                NT = stages["h"].shape[0] // stages["G"].shape[0]
                stages["h"][b * NT + (c0 - t0) // chunk_size] = St
                for name, val in (("G", G), ("w", w), ("u", u), ("v_new", vnew), ("kg", kg),
                                  ("qg", scale * qq * torch.exp(G))):
                    stages[name][b, t] = val.transpose(0, 1)
                stages["Aq"][b, t, :, :C] = Aqk.transpose(0, 1)
            St = torch.exp(Gl[:, 0, :])[:, :, None] * St + kg.transpose(1, 2) @ vnew
        S[n] = St
    return o.to(v.dtype), S.to(cdt(v.dtype))


_FUSED = ("l2norm_skipped", "beta_sigmoid_skipped", "gate_sign_flipped", "clamped_softplus")


def _normed_qk(q, k, mutation):
    """q, k l2-normalized in the arithmetic dtype (as given under ``l2norm_skipped``)."""
    cd = cdt(q.dtype)
    if mutation == "l2norm_skipped":
        return q.to(cd), k.to(cd)
    return l2norm(q.to(cd)), l2norm(k.to(cd))


def _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, mutation, lower_bound=None):
    cd = cdt(q.dtype)
    qn, kn = _normed_qk(q, k, mutation)
    g = gate(g_raw.to(cd), A_log, dt_bias, lower_bound=lower_bound,
             mutation="clamped_softplus" if mutation == "clamped_softplus" else None).to(cd)
    if mutation == "gate_sign_flipped":
        g = -g
    beta = beta_logits.to(cd) if mutation == "beta_sigmoid_skipped" else torch.sigmoid(beta_logits.to(cd))
    return qn, kn, g, beta


def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                    cu_seqlens=None, lower_bound=None, mutation=None):
    check_mutation("fused_recurrent", mutation, _FUSED)
    qn, kn, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, mutation, lower_bound)
    o, S = recurrent(qn, kn, v.to(qn.dtype), g, beta, scale=scale, initial_state=initial_state,
                     cu_seqlens=cu_seqlens)
    return o.to(v.dtype), S.to(cdt(v.dtype))


def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64, lower_bound=None, mutation=None):
    check_mutation("fused_chunked", mutation, _FUSED)
    qn, kn, g, beta = _prologue(q, k, g_raw, beta_logits, A_log, dt_bias, mutation, lower_bound)
    o, S = chunked(qn, kn, v.to(qn.dtype), g, beta, scale=scale, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o.to(v.dtype), S.to(cdt(v.dtype))


def fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None,
                           lower_bound=None, mutation=None):
    """:func:`fused_recurrent` (T = 1) on each sequence's pool row ``slot_ids[b]``, written back in
    place; a padding row (slot -1) outputs zeros. Returns ``(o, state_pool)``."""
    o = torch.zeros_like(v)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        ob, sb = fused_recurrent(q[b][None, None], k[b][None, None], v[b][None, None],
                                 g_raw[b][None, None], beta_logits[b][None, None], A_log, dt_bias,
                                 initial_state=state_pool[s][None], scale=scale, lower_bound=lower_bound,
                                 mutation=mutation)
        o[b] = ob[0, 0]
        state_pool[s] = sb[0].to(state_pool.dtype)
    return o, state_pool


def with_qk_l2norm(fn):
    """``fn`` (:func:`recurrent` or :func:`chunked`) of l2norm(q), l2norm(k); ``mutation=
    "l2norm_skipped"`` leaves q, k as given, other mutations reach ``fn``."""
    def run(q, k, v, g, beta, *, mutation=None, **kw):
        qn, kn = _normed_qk(q, k, mutation)
        o, S = fn(qn, kn, v.to(qn.dtype), g, beta, mutation=None if mutation == "l2norm_skipped" else mutation, **kw)
        return o.to(v.dtype), S

    return run
