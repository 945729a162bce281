"""Records of the in-place decode ops over a state pool: kda.fused_recurrent_decode and
conv.short_conv_step_. Each sequence b reads and writes only pool row ``slot_ids[b]``; a negative
slot id is a padding row (output 0, no state touched). The whole pool is an output: rows named by
the batch get the op's bound, every other row a bound of 0, so slot isolation (untouched rows
bit-identical) is part of the check."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from .. import bounds
from ..emulate import conv as emu_conv
from ..emulate import kda as emu_kda
from ..mutants import wrap
from ..registry import Case, Mutant, OpRecord, register
from ..strategies import bucket, normal, rng, seeds
from .kda import _A_plus_one, _compose


def _slots(r, B, n_slots):
    ids = r.permutation(n_slots)[:B].astype(np.int64)
    if B >= 3:
        ids[1] = -1                           # one padding row
    return ids


@st.composite
def kda_decode_cases(draw):
    B, H, HV, K, V = draw(bucket([(4, 2, 2, 16, 32), (3, 1, 2, 32, 16)]))
    r = rng(draw(seeds()))
    n = B + 3
    a = {"q": normal(r, (B, H, K), 2.0), "k": normal(r, (B, H, K), 2.0), "v": normal(r, (B, HV, V)),
         "g_raw": normal(r, (B, HV, K), 1.5), "beta_logits": normal(r, (B, HV)),
         "A_log": r.uniform(-2.0, 1.0, size=HV), "dt_bias": normal(r, (HV * K,), 0.5),
         "state_pool": normal(r, (n, HV, K, V), 0.5), "slot_ids": _slots(r, B, n)}
    return Case(a, label=f"B={B} slots={n} H={H} HV={HV} K={K} V={V}")


@st.composite
def conv_step_cases(draw):
    B, C, W = draw(bucket([(4, 48, 4), (3, 16, 3)]))
    r = rng(draw(seeds()))
    n = B + 3
    return Case({"x": normal(r, (B, C), 2.0), "weight": normal(r, (C, W), 0.5),
                 "state_pool": normal(r, (n, C, W - 1), 2.0), "slot_ids": _slots(r, B, n)},
                label=f"B={B} slots={n} C={C} W={W}")


# -- the three sides -------------------------------------------------------------------------------
def kda_decode_adapter(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None):
    """optimized.kda.fused_recurrent_decode, returning (o, the pool it updated in place)."""
    from optimized.kda import fused_recurrent_decode

    o = fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, scale=scale)
    return o, state_pool


def _per_row(step, n_out_rows, pool, slot_ids):
    pool = pool.copy()
    outs = None
    for b, s in enumerate(int(s) for s in slot_ids):
        if s < 0:
            continue
        o, st_ = step(b, pool[s])
        if outs is None:
            outs = np.zeros((n_out_rows,) + o.shape)
        outs[b] = o
        pool[s] = st_
    return outs, pool


def kda_decode_reference(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None):
    """The composition (l2norm, gate, sigmoid, recurrence) one token per named slot."""
    fused = _compose("recurrent")

    def step(b, s):
        o, st_ = fused(q[b][None, None], k[b][None, None], v[b][None, None], g_raw[b][None, None],
                       beta_logits[b][None, None], A_log, dt_bias, initial_state=s[None], scale=scale)
        return o[0, 0], st_[0]

    o, pool = _per_row(step, q.shape[0], state_pool, slot_ids)
    return (np.zeros(v.shape) if o is None else o), pool


def kda_decode_emulated(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None,
                        mutation=None):
    o = torch.zeros_like(v)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        ob, sb = emu_kda.fused_recurrent(q[b][None, None], k[b][None, None], v[b][None, None],
                                         g_raw[b][None, None], beta_logits[b][None, None], A_log, dt_bias,
                                         initial_state=state_pool[s][None], scale=scale, mutation=mutation)
        o[b] = ob[0, 0]
        state_pool[s] = sb[0].to(state_pool.dtype)
    return o, state_pool


def conv_step_adapter(x, weight, state_pool, slot_ids):
    from optimized.conv import short_conv_step_

    return short_conv_step_(x, weight, state_pool, slot_ids), state_pool


def conv_step_reference(x, weight, state_pool, slot_ids):
    from reference import conv

    def step(b, s):
        y, st_ = conv.short_conv_step(x[b][None], weight, s[None])
        return y[0], st_[0]

    y, pool = _per_row(step, x.shape[0], state_pool, slot_ids)
    return (np.zeros(x.shape) if y is None else y), pool


def conv_step_emulated(x, weight, state_pool, slot_ids, *, mutation=None):
    y = torch.zeros_like(x)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        yb, sb = emu_conv.short_conv_step(x[b][None], weight, state_pool[s][None], mutation=mutation)
        y[b] = yb[0]
        state_pool[s] = sb[0]
    return y, state_pool


# -- bounds: the per-row models scattered into the pool, 0 elsewhere ------------------------------
def _valid(x):
    ids = np.asarray(x["slot_ids"]).astype(np.int64)
    rows = np.nonzero(ids >= 0)[0]
    return rows, ids[rows]


def kda_decode_bound(x, kw, ref, p):
    rows, slots = _valid(x)
    o_b = np.zeros(np.shape(ref["o"]))
    pool_b = np.zeros(np.shape(ref["state_pool"]))
    if rows.size:
        sub = {n: x[n][rows][:, None] for n in ("q", "k", "v", "g_raw", "beta_logits")}
        sub.update(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["state_pool"][slots], cu_seqlens=None)
        r = {"o": ref["o"][rows][:, None], "final_state": ref["state_pool"][slots]}
        pp = dataclasses.replace(p, out={"o": p.uo("o"), "final_state": p.uo("state_pool")})
        b = bounds.kda.fused(sub, kw, r, pp)
        o_b[rows] = b["o"][:, 0]
        pool_b[slots] = b["final_state"]
    return {"o": o_b, "state_pool": pool_b}


def conv_step_bound(x, kw, ref, p):
    rows, slots = _valid(x)
    y_b = np.zeros(np.shape(ref["y"]))
    if rows.size:
        sub = {"x": x["x"][rows], "weight": x["weight"], "state": x["state_pool"][slots]}
        r = {"y": ref["y"][rows], "new_state": ref["state_pool"][slots]}
        y_b[rows] = bounds.conv.short_conv_step(sub, kw, r, p)["y"]
    return {"y": y_b, "state_pool": np.zeros(np.shape(ref["state_pool"]))}


# -- slot mutants ----------------------------------------------------------------------------------
def _shift_slots(d):
    n = d["state_pool"].shape[0]
    ids = d["slot_ids"]
    d["slot_ids"] = torch.where(ids >= 0, (ids + 1) % n, ids)
    return d


def _fill_padding(d):
    """The padding row is given a free slot: it computes and writes a state it must not touch."""
    ids = d["slot_ids"].clone()
    used = set(int(i) for i in ids.tolist() if i >= 0)
    free = [s for s in range(d["state_pool"].shape[0]) if s not in used]
    ids[ids < 0] = free[0]
    d["slot_ids"] = ids
    return d


class _NotWrittenBack:
    """The updated states are computed but never stored: the pool comes back as it went in."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            before = inp["state_pool"].clone()
            out = dict(cand(inp, kw))
            out["state_pool"] = before
            return out

        return mutated


SLOT_MUTANTS = (
    wrap("slot_ids_shifted", "each sequence reads and writes the next pool row", inputs=_shift_slots),
    Mutant("state_not_written_back", "the updated states never reach the pool", "wrap", _NotWrittenBack()),
    wrap("padding_row_computed", "a padding row (slot -1) is computed and written", inputs=_fill_padding),
)
POLICY = {"state_pool": "fp32", "slot_ids": "int", "A_log": "fp32", "dt_bias": "fp32"}


def _l2_skipped(fn):
    def build(cand, record):
        import functools

        return record.candidate(functools.partial(fn, mutation="l2norm_skipped"))

    return Mutant("l2norm_skipped", "q, k not l2-normalized in the kernel", "internal", build)


register(OpRecord(
    name="kda.fused_recurrent_decode", reference=kda_decode_reference,
    optimized="parity.ops.slots:kda_decode_adapter", emulated=kda_decode_emulated, inputs=kda_decode_cases,
    bound=kda_decode_bound, outputs=("o", "state_pool"),
    args=("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "state_pool", "slot_ids"),
    policy=POLICY, counter="kda.fused_recurrent_decode", in_place=True, reductions="K",
    batch={"inputs": {n: 0 for n in ("q", "k", "v", "g_raw", "beta_logits", "slot_ids")}, "outputs": {"o": 0}},
    bound_doc="kda.fused_recurrent's model (T = 1) on the named slots; untouched pool rows and padding outputs exact",
    mutants=SLOT_MUTANTS + (wrap("A_log_plus_one", "A_log + 1 inside the fused gate", inputs=_A_plus_one),
                            _l2_skipped(kda_decode_emulated))))

register(OpRecord(
    name="conv.short_conv_step_", reference=conv_step_reference, optimized="parity.ops.slots:conv_step_adapter",
    emulated=conv_step_emulated, inputs=conv_step_cases, bound=conv_step_bound, outputs=("y", "state_pool"),
    args=("x", "weight", "state_pool", "slot_ids"), policy={"state_pool": "io", "slot_ids": "int"},
    counter="conv.short_conv_step_", in_place=True, exact=("state_pool",), reductions="W",
    batch={"inputs": {"x": 0, "slot_ids": 0}, "outputs": {"y": 0}},
    bound_doc="conv.short_conv_step's model on the named rows; the pool exact (shifted copies), padding rows exact",
    mutants=SLOT_MUTANTS + (wrap("taps_reversed", "taps applied in reverse order",
                                 inputs=lambda d: dict(d, weight=d["weight"].flip(-1).contiguous())),)))
