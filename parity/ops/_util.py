"""Helpers shared by the record modules."""
from __future__ import annotations

import numpy as np

ROWS = {"inputs": {"x": 0}, "outputs": {"y": 0}}

STALE_SEED = 0x5EED


def fill_values(shape, fill: str) -> np.ndarray:
    """What dirty memory holds (parity.registry.FILLS): NaN, +Inf, or stale finite values (seeded
    normal values four times the scale of a state, as another sequence's row would hold)."""
    if fill == "nan":
        return np.full(shape, np.nan)
    if fill == "inf":
        return np.full(shape, np.inf)
    if fill == "stale":
        return np.random.default_rng(STALE_SEED).standard_normal(shape) * 4.0
    raise ValueError(f"fill: expected one of nan, inf, stale, got {fill!r}")


def poison(fill: str) -> float:
    """The scalar a blanking-by-multiplication bug multiplies by zero when memory holds ``fill``:
    NaN and Inf make the product NaN; stale finite values give 0 (that bug is harmless there)."""
    return {"nan": float("nan"), "inf": float("inf")}.get(fill, 0.0)
