"""Records: conv.short_conv, conv.short_conv_step."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .. import bounds
from ..emulate import conv as emu
from ..mutants import internal, wrap
from ..registry import Case, OpRecord, register
from ..strategies import bucket, normal, rng, seeds
from ._util import lazy


@st.composite
def conv_cases(draw):
    B, T, C, W = draw(bucket([(2, 9, 48, 4), (1, 33, 16, 4), (2, 2, 20, 3)]))
    has_state = draw(bucket([True, False]))
    r = rng(draw(seeds()))
    arrays = {"x": normal(r, (B, T, C), 2.0), "weight": normal(r, (C, W), 0.5)}
    arrays["initial_state"] = normal(r, (B, C, W - 1), 2.0) if has_state else None
    return Case(arrays, label=f"B={B} T={T} C={C} W={W}{' state' if has_state else ''}")


@st.composite
def step_cases(draw):
    B, C, W = draw(bucket([(3, 48, 4), (1, 16, 4), (2, 20, 3)]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (B, C), 2.0), "weight": normal(r, (C, W), 0.5),
                 "state": normal(r, (B, C, W - 1), 2.0)}, label=f"B={B} C={C} W={W}")


def _flip_taps(d):
    d["weight"] = d["weight"].flip(-1).contiguous()
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

register(OpRecord(
    name="conv.short_conv", reference=lazy("reference.conv:short_conv"),
    optimized="optimized.conv:short_conv", emulated=emu.short_conv, inputs=conv_cases,
    bound=bounds.conv.short_conv, outputs=("y", "final_state"), args=("x", "weight"),
    kwarg_arrays=("initial_state",), exact=("final_state",), reductions="W",
    batch={"inputs": {"x": 0, "initial_state": 0}, "outputs": {"y": 0, "final_state": 0}},
    bound_doc=f"y: {ACT}; final_state: exact (a copy of inputs)",
    mutants=(
        wrap("taps_reversed", "taps applied in reverse order (weight[:, 0] on the current token)",
             inputs=_flip_taps),
        wrap("initial_state_ignored", "the carried state is not read (zero history)", inputs=_drop_state),
        wrap("state_off_by_one", "the final state is one token stale", outputs=_state_off_by_one),
        internal("no_activation", "SiLU not applied after the convolution", emu.short_conv),
    )))

register(OpRecord(
    name="conv.short_conv_step", reference=lazy("reference.conv:short_conv_step"),
    optimized="optimized.conv:short_conv_step", emulated=emu.short_conv_step, inputs=step_cases,
    bound=bounds.conv.short_conv_step, outputs=("y", "new_state"), args=("x", "weight", "state"),
    exact=("new_state",), reductions="W",
    batch={"inputs": {"x": 0, "state": 0}, "outputs": {"y": 0, "new_state": 0}},
    bound_doc=f"y: {ACT}; new_state: exact",
    mutants=(
        wrap("taps_reversed", "taps applied in reverse order", inputs=_flip_taps),
        wrap("state_not_rolled", "the state is returned unchanged", outputs=_not_rolled),
        internal("no_activation", "SiLU not applied", emu.short_conv_step),
    )))
