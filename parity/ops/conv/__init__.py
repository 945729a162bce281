"""Records: conv.short_conv, conv.short_conv_step, conv.short_conv_step_ (the in-place decode
step over a state pool, by slot id: parity/ops/_slots.py).
"""
from __future__ import annotations

from optimized import conv as fast
from parity.ops import _slots
from parity.registry import OpRecord
from reference import conv as ref

from . import bounds, emulate, mutants
from .inputs import conv_cases, pool_step_cases, step_cases, wide_conv_cases


# -- the in-place step: the optimized op returns y and updates the pool; the record compares both --
def pool_step(x, weight, state_pool, slot_ids):
    """optimized.conv.short_conv_step_, returning (y, the pool it updated in place)."""
    return fast.short_conv_step_(x, weight, state_pool, slot_ids), state_pool


def pool_step_reference(x, weight, state_pool, slot_ids):
    """reference.conv.short_conv_step on each named pool row."""
    def step(b, s):
        y, st_ = ref.short_conv_step(x[b, ...][None, ...], weight, s[None, ...])
        return y[0, ...], st_[0, ...]

    return _slots.per_row(step, x, state_pool, slot_ids)


ACT = "|silu'(z)| (gamma_W(ua) sum|w x| + ua |z|) + ((6 + |z|) ua + uo) |y|"

SHORT_CONV = OpRecord(
    name="conv.short_conv", reference=ref.short_conv, optimized=fast.short_conv,
    emulated=emulate.short_conv, inputs=conv_cases, wide=wide_conv_cases, bound=bounds.short_conv,
    outputs=("y", "final_state"), args=("x", "weight"),
    kwarg_arrays=("initial_state",), exact=("final_state",), reductions="W",
    batch={"inputs": {"x": 0, "initial_state": 0}, "outputs": {"y": 0, "final_state": 0}},
    bound_doc=f"y: {ACT}; final_state: exact (a copy of inputs)", mutants=mutants.SHORT_CONV)

SHORT_CONV_STEP = OpRecord(
    name="conv.short_conv_step", reference=ref.short_conv_step, optimized=fast.short_conv_step,
    emulated=emulate.short_conv_step, inputs=step_cases, bound=bounds.short_conv_step, outputs=("y", "new_state"),
    args=("x", "weight", "state"), exact=("new_state",), reductions="W",
    batch={"inputs": {"x": 0, "state": 0}, "outputs": {"y": 0, "new_state": 0}},
    bound_doc=f"y: {ACT}; new_state: exact", mutants=mutants.SHORT_CONV_STEP)

SHORT_CONV_STEP_ = OpRecord(
    name="conv.short_conv_step_", reference=pool_step_reference, optimized=pool_step,
    emulated=emulate.short_conv_step_, inputs=pool_step_cases, bound=bounds.short_conv_step_,
    outputs=("y", "state_pool"),
    args=("x", "weight", "state_pool", "slot_ids"), policy={"state_pool": "io", "slot_ids": "int"},
    in_place=True, exact=("state_pool",), reductions="W", dirty=_slots.dirty,
    batch={"inputs": {"x": 0, "slot_ids": 0}, "outputs": {"y": 0}},
    bound_doc="conv.short_conv_step's model on the named rows; the pool exact (shifted copies), padding rows exact",
    mutants=mutants.SHORT_CONV_STEP_)


def records() -> list[OpRecord]:
    return [SHORT_CONV, SHORT_CONV_STEP, SHORT_CONV_STEP_]
