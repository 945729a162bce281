"""Inputs of the norms (hypothesis strategies of :class:`parity.registry.Case`, and the case
builders the kernel tests call with the shapes that reach their launch paths)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from parity.registry import Case
from parity.strategies import bucket, normal, rng, seeds, wide_rows


def mixed_magnitudes(r: np.random.Generator, shape, scale=1.0) -> np.ndarray:
    """Normal values with a per-row magnitude spread over four decades (1e-3 .. 10), so bounds that
    follow magnitudes are exercised and eps terms matter in the small rows."""
    rows = r.choice([1e-3, 0.05, 1.0, 10.0], size=shape[:-1] + (1,))
    return r.standard_normal(shape) * rows * scale


SHAPES = [(2, 2, 3, 32), (7, 64), (5, 3, 100)]


def rms_case(shape, eps, seed, *, gated=False) -> Case:
    """An input of the rms norms: rows over four decades of magnitude (x), a gate, a weight near 1.
    Kernel tests call it with the shapes that reach their launch paths (D past one tile)."""
    r = rng(seed)
    D = shape[-1]
    arrays = {"x": mixed_magnitudes(r, shape)}
    if gated:
        arrays["gate"] = normal(r, shape, 2.0)
    arrays["weight"] = 1.0 + 0.3 * normal(r, (D,))
    return Case(arrays, {"eps": eps}, label=f"x{list(shape)} eps={eps:g}")


def add_case(shape, eps, seed) -> Case:
    """x (a branch output, four decades of row magnitude) and the residual stream it is added to."""
    r = rng(seed)
    D = shape[-1]
    arrays = {"x": mixed_magnitudes(r, shape), "residual": normal(r, shape, 3.0),
              "weight": 1.0 + 0.3 * normal(r, (D,))}
    return Case(arrays, {"eps": eps}, label=f"x{list(shape)} eps={eps:g}")


@st.composite
def rms_cases(draw, gated=False):
    shape = draw(bucket(SHAPES))
    eps = draw(bucket([1e-5, 1e-6]))
    return rms_case(shape, eps, draw(seeds()), gated=gated)


@st.composite
def add_cases(draw):
    shape = draw(bucket(SHAPES))
    eps = draw(bucket([1e-5, 1e-6]))
    return add_case(shape, eps, draw(seeds()))


@st.composite
def wide_norm_cases(draw, space="full", kind="rms"):
    """Any row count and width (parity search); ``kind``: rms, gated or add."""
    shape, eps = draw(wide_rows(space)), draw(bucket([1e-5, 1e-6]))
    seed = draw(seeds())
    return add_case(shape, eps, seed) if kind == "add" else rms_case(shape, eps, seed, gated=kind == "gated")


@st.composite
def wide_l2_cases(draw, space="full"):
    shape = draw(wide_rows(space, dims=(1, 7, 16, 60, 64, 100, 128)))
    r = rng(draw(seeds()))
    return Case({"x": mixed_magnitudes(r, shape)}, label=f"x{list(shape)}")


@st.composite
def l2_cases(draw):
    shape = draw(bucket([(3, 5, 2, 16), (2, 3, 3, 64), (6, 4, 100)]))
    r = rng(draw(seeds()))
    return Case({"x": mixed_magnitudes(r, shape)}, label=f"x{list(shape)}")
