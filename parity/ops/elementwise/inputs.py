"""Inputs of the elementwise ops (hypothesis strategies of :class:`parity.registry.Case`)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from parity.registry import Case
from parity.strategies import bucket, rng, seeds, wide_rows


def elementwise_values(r: np.random.Generator, shape) -> np.ndarray:
    """Values for the scalar functions: the bulk around 0, tails to +-30 (past the softplus
    threshold), exact landmarks (0, +-20, +-1)."""
    x = r.standard_normal(shape) * 3.0
    tail = r.random(shape) < 0.15
    x = np.where(tail, r.uniform(-30, 30, size=shape), x)
    flat = x.reshape(-1)
    marks = np.array([0.0, 20.0, -20.0, 1.0, -1.0, 19.9, 20.1])
    flat[: min(len(marks), flat.size)] = marks[: flat.size]
    return flat.reshape(shape)


@st.composite
def cases(draw):
    shape = draw(bucket([(2, 3, 33), (257,), (6, 50)]))
    r = rng(draw(seeds()))
    return Case({"x": elementwise_values(r, shape)}, label=f"x{list(shape)}")


@st.composite
def wide_cases(draw, space="full"):
    """Any row count and width (parity search)."""
    shape = draw(wide_rows(space))
    r = rng(draw(seeds()))
    return Case({"x": elementwise_values(r, shape)}, label=f"x{list(shape)}")
