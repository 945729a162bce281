"""Records: conv.short_conv, conv.short_conv_step, conv.short_conv_step_ (the in-place decode
step over a state pool, by slot id: parity/ops/_slots.py)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from reference import conv as ref

from ..bounds import conv as bounds
from ..emulate import conv as emu
from ..mutants import internal, wrap
from ..registry import Case, OpRecord, Ref
from ..strategies import bucket, normal, rng, seeds, wide_rows
from . import _slots


@st.composite
def conv_cases(draw):
    B, T, C, W = draw(bucket([(2, 2, 20, 3), (1, 33, 16, 4), (2, 9, 48, 4)]))
    has_state = draw(bucket([True, False]))
    r = rng(draw(seeds()))
    arrays = {"x": normal(r, (B, T, C), 2.0), "weight": normal(r, (C, W), 0.5)}
    arrays["initial_state"] = normal(r, (B, C, W - 1), 2.0) if has_state else None
    return Case(arrays, label=f"B={B} T={T} C={C} W={W}{' state' if has_state else ''}")


@st.composite
def wide_conv_cases(draw, space="full"):
    """Any batch, length, channel count and width up to 4 (parity search)."""
    W = draw(bucket([2, 3, 4]))
    T, C = draw(wide_rows(space, dims=(1, 7, 16, 48, 100, 256), max_rows=256))
    B = draw(bucket([1, 2]))
    has_state = draw(st.booleans())
    r = rng(draw(seeds()))
    arrays = {"x": normal(r, (B, T, C), 2.0), "weight": normal(r, (C, W), 0.5)}
    arrays["initial_state"] = normal(r, (B, C, W - 1), 2.0) if has_state else None
    return Case(arrays, label=f"B={B} T={T} C={C} W={W}{' state' if has_state else ''}")


@st.composite
def step_cases(draw):
    B, C, W = draw(bucket([(1, 16, 4), (2, 20, 3), (3, 48, 4)]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (B, C), 2.0), "weight": normal(r, (C, W), 0.5),
                 "state": normal(r, (B, C, W - 1), 2.0)}, label=f"B={B} C={C} W={W}")


@st.composite
def pool_step_cases(draw):
    B, C, W = draw(bucket([(3, 16, 3), (4, 48, 4)]))
    r = rng(draw(seeds()))
    n = B + 3
    return Case({"x": normal(r, (B, C), 2.0), "weight": normal(r, (C, W), 0.5),
                 "state_pool": normal(r, (n, C, W - 1), 2.0), "slot_ids": _slots.slot_ids(r, B, n)},
                label=f"B={B} slots={n} C={C} W={W}")


# -- the in-place step: the optimized op returns y and updates the pool; the record compares both --
def pool_step(x, weight, state_pool, slot_ids):
    """optimized.conv.short_conv_step_, returning (y, the pool it updated in place)."""
    from optimized.conv import short_conv_step_  # here: importing optimized picks the Triton backend

    return short_conv_step_(x, weight, state_pool, slot_ids), state_pool


def pool_step_reference(x, weight, state_pool, slot_ids):
    """reference.conv.short_conv_step on each named pool row."""
    def step(b, s):
        y, st_ = ref.short_conv_step(x[b, ...][None, ...], weight, s[None, ...])
        return y[0, ...], st_[0, ...]

    return _slots.per_row(step, x, state_pool, slot_ids)


def pool_step_emulated(x, weight, state_pool, slot_ids, *, mutation=None):
    y = torch.zeros_like(x)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        yb, sb = emu.short_conv_step(x[b][None], weight, state_pool[s][None], mutation=mutation)
        y[b] = yb[0]
        state_pool[s] = sb[0]
    return y, state_pool


def pool_step_bound(x, kw, r, p):
    """conv.short_conv_step's model on the named rows; padding outputs and the whole pool exact."""
    rows, slots = _slots.valid(x)
    y_b = np.zeros(np.shape(r["y"]))
    if rows.size:
        sub = {"x": x["x"][rows], "weight": x["weight"], "state": x["state_pool"][slots]}
        rr = {"y": r["y"][rows], "new_state": r["state_pool"][slots]}
        y_b[rows] = bounds.short_conv_step(sub, kw, rr, p)["y"]
    return {"y": y_b, "state_pool": np.zeros(np.shape(r["state_pool"]))}


def _flip_taps(d):
    d["weight"] = d["weight"].flip(-1).contiguous()
    return d


def _shift_taps(d):
    d["weight"] = d["weight"].roll(1, dims=-1).contiguous()
    return d


def _drop_state(d):
    d["initial_state"] = None
    return d


def _state_off_by_one(out, inp):
    # the state keeps inputs t-W .. t-2 instead of t-W+2 .. t (one step stale)
    x, h0 = inp["x"], inp.get("initial_state")
    B, T, C = x.shape
    W1 = out["final_state"].shape[-1]
    h0 = torch.zeros(B, C, W1, dtype=x.dtype, device=x.device) if h0 is None else h0
    xp = torch.cat([h0.to(x.dtype).transpose(1, 2), x], dim=1)
    out["final_state"] = xp[:, T - 1:T - 1 + W1, :].transpose(1, 2).contiguous().to(out["final_state"].dtype)
    return out


def _not_rolled(out, inp):
    out["new_state"] = inp["state"].clone()
    return out


ACT = "|silu'(z)| (gamma_W(ua) sum|w x| + ua |z|) + ((6 + |z|) ua + uo) |y|"

SHORT_CONV = OpRecord(
    name="conv.short_conv", reference=ref.short_conv, optimized=Ref("optimized.conv", "short_conv"),
    emulated=emu.short_conv, inputs=conv_cases, wide=wide_conv_cases, bound=bounds.short_conv,
    outputs=("y", "final_state"), args=("x", "weight"),
    kwarg_arrays=("initial_state",), exact=("final_state",), reductions="W",
    batch={"inputs": {"x": 0, "initial_state": 0}, "outputs": {"y": 0, "final_state": 0}},
    bound_doc=f"y: {ACT}; final_state: exact (a copy of inputs)",
    mutants=(
        wrap("taps_reversed", "taps applied in reverse order (weight[:, 0] on the current token)",
             inputs=_flip_taps),
        wrap("initial_state_ignored", "the carried state is not read (zero history)", inputs=_drop_state),
        wrap("state_off_by_one", "the final state is one token stale", outputs=_state_off_by_one),
        internal("no_activation", "SiLU not applied after the convolution", emu.short_conv),
        wrap("taps_shifted", "taps shifted by one (weight[:, j] applied to input t - W + j + 2)",
             inputs=_shift_taps),
    ))

SHORT_CONV_STEP = OpRecord(
    name="conv.short_conv_step", reference=ref.short_conv_step, optimized=Ref("optimized.conv", "short_conv_step"),
    emulated=emu.short_conv_step, inputs=step_cases, bound=bounds.short_conv_step, outputs=("y", "new_state"), args=("x", "weight", "state"),
    exact=("new_state",), reductions="W",
    batch={"inputs": {"x": 0, "state": 0}, "outputs": {"y": 0, "new_state": 0}},
    bound_doc=f"y: {ACT}; new_state: exact",
    mutants=(
        wrap("taps_reversed", "taps applied in reverse order", inputs=_flip_taps),
        wrap("state_not_rolled", "the state is returned unchanged", outputs=_not_rolled),
        internal("no_activation", "SiLU not applied", emu.short_conv_step),
    ))

SHORT_CONV_STEP_ = OpRecord(
    name="conv.short_conv_step_", reference=pool_step_reference, optimized=pool_step,
    emulated=pool_step_emulated, inputs=pool_step_cases, bound=pool_step_bound, outputs=("y", "state_pool"),
    args=("x", "weight", "state_pool", "slot_ids"), policy={"state_pool": "io", "slot_ids": "int"},
    in_place=True, exact=("state_pool",), reductions="W", dirty=_slots.dirty,
    batch={"inputs": {"x": 0, "slot_ids": 0}, "outputs": {"y": 0}},
    bound_doc="conv.short_conv_step's model on the named rows; the pool exact (shifted copies), padding rows exact",
    mutants=_slots.MUTANTS + (wrap("taps_reversed", "taps applied in reverse order", inputs=_flip_taps),
                              _slots.blanked_by_zero("y")))


def records() -> list[OpRecord]:
    return [SHORT_CONV, SHORT_CONV_STEP, SHORT_CONV_STEP_]
