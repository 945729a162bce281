"""Inputs of the short convolution (hypothesis strategies of :class:`parity.registry.Case`)."""
from __future__ import annotations

from hypothesis import strategies as st

from parity.ops import _slots
from parity.registry import Case
from parity.strategies import bucket, normal, rng, seeds, wide_rows


def conv_case(B, T, C, W, seed, *, has_state) -> Case:
    """A prefill input: ``x [B, T, C]``, taps ``[C, W]``, and a carried state when ``has_state``."""
    r = rng(seed)
    arrays = {"x": normal(r, (B, T, C), 2.0), "weight": normal(r, (C, W), 0.5)}
    arrays["initial_state"] = normal(r, (B, C, W - 1), 2.0) if has_state else None
    return Case(arrays, label=f"B={B} T={T} C={C} W={W}{' state' if has_state else ''}")


@st.composite
def conv_cases(draw):
    B, T, C, W = draw(bucket([(2, 2, 20, 3), (1, 33, 16, 4), (2, 9, 48, 4)]))
    has_state = draw(bucket([True, False]))
    return conv_case(B, T, C, W, draw(seeds()), has_state=has_state)


@st.composite
def wide_conv_cases(draw, space="full"):
    """Any batch, length, channel count and width up to 4 (parity search)."""
    W = draw(bucket([2, 3, 4]))
    T, C = draw(wide_rows(space, dims=(1, 7, 16, 48, 100, 256), max_rows=256))
    B = draw(bucket([1, 2]))
    has_state = draw(st.booleans())
    return conv_case(B, T, C, W, draw(seeds()), has_state=has_state)


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
