"""Recurrent KDA (spec b.8) as one fused Triton kernel, plus batched decode on a state pool.

One program per (sequence, value head, V-block of ``BV`` columns) walks the tokens in order with its
``[K, BV]`` slice of the state in registers (the update of column block ``V_b`` only reads that
block: ``e = beta (v - S~^T k)`` is per column). Per token::

    S~ = diag(exp(g_t)) S;  e = beta_t (v_t - S~^T k_t);  S = S~ + k_t e^T;  o_t = scale S^T q_t

The fused forms compute, in registers, ``l2norm`` of q and k (``x / sqrt(sum x^2 + 1e-6)``), the gate
``g = -exp(A_log) softplus(g_raw + dt_bias)`` (constexpr ``GATE = 0``) or the bounded gate ``g = b
sigmoid(exp(A_log) (g_raw + dt_bias))`` (``GATE = 1``, b = ``lower_bound``; ``HAS_A = False``: without
the ``exp(A_log)`` factor) and ``beta = sigmoid(beta_logits)``.

Storage/compute dtypes: every input is widened on load to ACC (float32, or float64 for fp64 inputs;
for decode, the state pool's dtype); nothing intermediate is stored; o is written once per token in
the input dtype and the state once per call in ACC. No ``tl.dot`` (matrix-vector work is
elementwise + reductions), so every float dtype, float64 included, runs.

Determinism: the arithmetic of one (sequence, head, column) never depends on the other sequences in
the batch or on the batch size (fixed ``BV``/``num_warps``), so a batched decode is bitwise equal to
decoding each sequence alone.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .._jit import jit
from .. import _counters, _pdl
from .._pdl import pdl_wait
from .._checks import out_or_new
from ._common import (SUM, acc_dtype, block_k, cdiv, check_bound, check_device, check_gate_params, check_qkv,
                      check_shape, check_tensor, gate_kind, next_pow2, prepare_cu_seqlens, prepare_state,
                      state_tile)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_BV = 32  # value columns per program: fixed (bitwise batch invariance), small (decode parallelism)


@jit
def _recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, slots, scale: tl.float64, T,
                      sq, sk, sv, sg, sb, lower_bound: tl.float64, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FUSED: tl.constexpr,
                      HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, USE_SLOTS: tl.constexpr,
                      PDL: tl.constexpr = False, GATE: tl.constexpr = 0, HAS_A: tl.constexpr = True):
    # lower_bound: the bounded gate's b (GATE 1), an fp64 argument (a plain float arrives as fp32)
    ACC = ht.dtype.element_ty
    pdl_wait(PDL)
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    dk, mk, dv, mv, mkv, kv_off = state_tile(i_v, K, V, BK, BV)
    if USE_SLOTS:
        slot = tl.load(slots + i_n).to(tl.int64)
        if slot < 0:  # padding entry: no state is read or written, the output is 0
            tl.store(o + (bos * HV + i_hv) * V + dv, tl.zeros([BV], dtype=ACC).to(o.dtype.element_ty),
                     mask=mv)
            return
        s_off = (slot * HV + i_hv) * K * V
    else:
        s_off = i_nh.to(tl.int64) * K * V
    if HAS_H0:
        S = tl.load(h0 + s_off + kv_off, mask=mkv, other=0.0).to(ACC)
    else:
        S = tl.zeros([BK, BV], dtype=ACC)
    if FUSED:
        if HAS_A:
            a = tl.exp(tl.load(A_log + i_hv).to(ACC))
        bias = tl.load(dt_bias + i_hv * K + dk, mask=mk, other=0.0).to(ACC)
    # per-token pointers, advanced by one token each step (s*: the inputs' token strides, so decode
    # reads q/k/v/g/beta rows in place from the projection's output)
    p_q = q + bos * sq + i_h * K + dk
    p_k = k + bos * sk + i_h * K + dk
    p_v = v + bos * sv + i_hv * V + dv
    p_g = g + bos * sg + i_hv * K + dk
    p_b = beta + bos * sb + i_hv
    p_o = o + (bos * HV + i_hv) * V + dv
    for _ in range(bos, eos):
        qt = tl.load(p_q, mask=mk, other=0.0).to(ACC)
        kt = tl.load(p_k, mask=mk, other=0.0).to(ACC)
        vt = tl.load(p_v, mask=mv, other=0.0).to(ACC)
        gt = tl.load(p_g, mask=mk, other=0.0).to(ACC)
        bt = tl.load(p_b).to(ACC)
        if FUSED:
            # the prologue, written out inline (the same math as _common's helpers: a helper call per
            # token costs the Triton interpreter more than the arithmetic)
            qt = qt / tl.sqrt(tl.reduce(qt * qt, 0, SUM) + 1e-6)
            kt = kt / tl.sqrt(tl.reduce(kt * kt, 0, SUM) + 1e-6)
            x = gt + bias
            if GATE == 0:
                z = tl.exp(-tl.abs(x))
                zw = 1.0 + z
                zd = zw - 1.0
                l1p = tl.where(zd == 0.0, z, tl.log(zw) * (z / tl.where(zd == 0.0, 1.0, zd)))
                gt = -a * tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)
            else:
                if HAS_A:
                    x = a * x
                zs = tl.exp(-tl.abs(x))  # sigmoid as optimized.elementwise's sigmoid_f
                rs = 1.0 / (1.0 + zs)
                gt = (lower_bound * tl.where(x >= 0, rs, zs * rs)).to(ACC)
            zb = tl.exp(-tl.abs(bt))
            bt = tl.where(bt >= 0, 1.0, zb) / (1.0 + zb)
        S = S * tl.exp(gt)[:, None]
        e = bt * (vt - tl.reduce(S * kt[:, None], 0, SUM))
        S = S + kt[:, None] * e[None, :]
        # scale is an fp64 arg (a plain float arrives as fp32: wrong for fp64 runs); back to ACC
        ot = (tl.reduce(S * qt[:, None], 0, SUM) * scale).to(ACC)
        tl.store(p_o, ot.to(o.dtype.element_ty), mask=mv)
        p_q += sq
        p_k += sk
        p_v += sv
        p_g += sg
        p_b += sb
        p_o += HV * V
    tl.store(ht + s_off + kv_off, S.to(ht.dtype.element_ty), mask=mkv)


def _launch(op, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, cu_seqlens, fused, lower_bound=None):
    B, T, H, HV, K, V = check_qkv(op, q, k, v)
    gname, bname = ("g_raw", "beta_logits") if fused else ("g", "beta")
    check_tensor(op, gname, g)
    check_shape(op, gname, g, (B, T, HV, K), "[B,T,HV,K]")
    check_tensor(op, bname, beta)
    check_shape(op, bname, beta, (B, T, HV), "[B,T,HV]")
    check_device(op, q, **{gname: g, bname: beta})
    if fused:
        A_log, dt_bias, lower_bound = check_gate_params(op, A_log, dt_bias, HV, K, q, lower_bound)
    acc = acc_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else float(scale)
    varlen = cu_seqlens is not None
    if varlen:
        cu, N = prepare_cu_seqlens(op, cu_seqlens, B, T, q.device)
    else:
        cu, N = None, B
    h0 = prepare_state(op, initial_state, N, HV, K, V, acc, q, varlen)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, HV, K, V, dtype=acc, device=q.device)
    BV = min(_BV, max(16, next_pow2(V)))
    _recurrent_kernel[(cdiv(V, BV), N * HV)](
        q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, None, scale, T,
        H * K, H * K, HV * V, HV * K, HV, 0.0 if lower_bound is None else lower_bound,
        H=H, HV=HV, K=K, V=V, BK=block_k(K), BV=BV, FUSED=fused, HAS_H0=h0 is not None,
        IS_VARLEN=varlen, USE_SLOTS=False, GATE=gate_kind(lower_bound), HAS_A=A_log is not None or not fused,
        num_warps=4)
    return o, ht


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """KDA recurrence (spec b.8), token by token in one kernel.

    q, k: [B,T,H,K] (already l2-normalized); v: [B,T,HV,V]; g: [B,T,HV,K] log-space decay; beta:
    [B,T,HV]; initial_state: [B,HV,K,V] K-first (or [N,HV,K,V] with cu_seqlens [N+1], B == 1) or
    None. scale defaults to K**-0.5. Returns ``(o [B,T,HV,V] in q.dtype, final_state float32)``
    (float64 for fp64 inputs).
    """
    _counters.record("kda.recurrent")
    return _launch("kda.recurrent", q, k, v, g, beta, None, None, scale, initial_state, cu_seqlens,
                   fused=False)


def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                    cu_seqlens=None, lower_bound=None):
    """:func:`recurrent` of ``l2norm(q), l2norm(k), gate(g_raw, A_log, dt_bias, lower_bound=lower_bound),
    sigmoid(beta_logits)``, all computed in the kernel (float32 registers).

    g_raw: [B,T,HV,K]; beta_logits: [B,T,HV]; A_log: HV elements (None: the bounded gate without
    it); dt_bias: HV*K elements; lower_bound: None (the softplus gate) or b in [-5, 0).
    """
    _counters.record("kda.fused_recurrent")
    return _launch("kda.fused_recurrent", q, k, v, g_raw, beta_logits, A_log, dt_bias, scale,
                   initial_state, cu_seqlens, fused=True, lower_bound=lower_bound)


def fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *,
                           scale=None, out=None, lower_bound=None):
    """One decode step for a batch of sequences, updating their states IN PLACE in a pool.

    q, k: [B,H,K] (raw; l2-normalized in kernel); v: [B,HV,V]; g_raw: [B,HV,K]; beta_logits: [B,HV];
    A_log: HV elements (None: the bounded gate without it); dt_bias: HV*K elements; lower_bound:
    None (the softplus gate) or b in [-5, 0) (the bounded gate, as :func:`fused_recurrent`);
    state_pool: [num_slots,HV,K,V], contiguous, float32 (float64 for fp64 runs), K-first; slot_ids: [B]
    ints on the pool's device. Sequence b reads and writes only ``state_pool[slot_ids[b]]``; other
    slots are never touched. ``slot_ids[b] < 0`` marks a
    padding entry (output 0, no state access). Slot ids must be distinct and < num_slots (not checked:
    that would need a host sync). Returns o [B,HV,V] in q.dtype; ``out`` (optional, a contiguous
    [B,HV,V] tensor of q's dtype on q's device, e.g. the first rows of a padded decode tile): o
    is written there and returned.
    """
    _counters.record("kda.fused_recurrent_decode")
    if lower_bound is not None:
        lower_bound = check_bound("kda.fused_recurrent_decode", lower_bound)
        if A_log is None:   # the A_log-free bounded gate: the kernel never reads it
            return _decode(q, k, v, g_raw, beta_logits, None, dt_bias, state_pool, slot_ids, scale, out,
                           lower_bound)
    # The per-token hot path: one combined test of everything; the detailed checks (which name the
    # offending argument) run only when it fails.
    try:
        B, H, K = q.shape
        _, HV, V = v.shape
        ok = (k.shape == q.shape and v.shape[0] == B and g_raw.shape == (B, HV, K)
              and beta_logits.shape == (B, HV) and state_pool.dim() == 4
              and state_pool.shape[1:] == (HV, K, V) and slot_ids.shape == (B,)
              and HV % H == 0 and 0 < K <= 256 and A_log.numel() == HV and dt_bias.numel() == HV * K
              and q.dtype == k.dtype == v.dtype and q.dtype in _FLOATS
              and state_pool.dtype in (torch.float32, torch.float64) and state_pool.is_contiguous()
              and not slot_ids.dtype.is_floating_point and A_log.is_contiguous()
              and dt_bias.is_contiguous()
              and q.device == k.device == v.device == g_raw.device == beta_logits.device
              == state_pool.device == slot_ids.device == A_log.device == dt_bias.device)
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        _decode_checks(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids)
    return _decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, scale, out, lower_bound,
                   checked=True)


def _decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, scale, out, lower_bound,
            checked=False):
    """The decode launch (``checked``: the arguments passed the hot path's test; else they are checked
    here in full)."""
    if not checked:
        _decode_checks(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, lower_bound,
                       valid_ok=True)
    B, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K ** -0.5 if scale is None else float(scale)
    o = out_or_new("kda.fused_recurrent_decode", out, (B, HV, V), q)
    if B == 0:
        return o
    BV = min(_BV, max(16, next_pow2(V)))
    q, k, v, g_raw, beta_logits = (_token_rows(x) for x in (q, k, v, g_raw, beta_logits))
    pdl = _pdl.enabled(q.device)
    _recurrent_kernel[(cdiv(V, BV), B * HV)](
        q, k, v, g_raw, beta_logits, A_log, dt_bias, o, state_pool, state_pool, None,
        slot_ids.contiguous(), scale, 1,
        q.stride(0), k.stride(0), v.stride(0), g_raw.stride(0), beta_logits.stride(0),
        0.0 if lower_bound is None else lower_bound,
        H=H, HV=HV, K=K, V=V, BK=block_k(K), BV=BV, FUSED=True, HAS_H0=True, IS_VARLEN=False,
        GATE=gate_kind(lower_bound), HAS_A=A_log is not None,
        USE_SLOTS=True, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return o


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [B, ...]`` unchanged when each row is contiguous (any row stride: a column slice of the
    fused projection output is read in place), else a contiguous copy."""
    inner = x[0] if x.shape[0] else x
    return x if inner.is_contiguous() else x.contiguous()


def _decode_checks(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, lower_bound=None,
                   valid_ok=False):
    """Raise the error that names what is wrong with fused_recurrent_decode's arguments (``valid_ok``:
    return when nothing is)."""
    op = "kda.fused_recurrent_decode"
    check_tensor(op, "q", q, 3, "B,H,K")
    check_tensor(op, "k", k, 3, "B,H,K")
    check_tensor(op, "v", v, 3, "B,HV,V")
    B, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    check_qkv(op, q[:, None], k[:, None], v[:, None])
    check_tensor(op, "g_raw", g_raw)
    check_shape(op, "g_raw", g_raw, (B, HV, K), "[B,HV,K]")
    check_tensor(op, "beta_logits", beta_logits)
    check_shape(op, "beta_logits", beta_logits, (B, HV), "[B,HV]")
    check_gate_params(op, A_log, dt_bias, HV, K, q, lower_bound)
    if not ((A_log is None or A_log.is_contiguous()) and dt_bias.is_contiguous()):
        raise ValueError(f"{op}: A_log and dt_bias must be contiguous")
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 4 \
            or tuple(state_pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"{op}: state_pool: expected [num_slots,HV,K,V] with HV,K,V = {(HV, K, V)}, "
                         f"got {tuple(getattr(state_pool, 'shape', ()))}")
    if state_pool.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: state_pool: expected float32 (or float64), got {state_pool.dtype}")
    if not state_pool.is_contiguous():
        raise ValueError(f"{op}: state_pool: must be contiguous (it is updated in place)")
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dim() != 1 or slot_ids.numel() != B \
            or slot_ids.dtype.is_floating_point:
        raise ValueError(f"{op}: slot_ids: expected [B] = ({B},) ints, got "
                         f"{tuple(getattr(slot_ids, 'shape', ()))} {getattr(slot_ids, 'dtype', None)}")
    check_device(op, q, g_raw=g_raw, beta_logits=beta_logits, state_pool=state_pool,
                 slot_ids=slot_ids)
    if valid_ok:
        return
    raise ValueError(f"{op}: invalid arguments")  # unreachable unless a check above is incomplete
