"""Per-step statistics of the diff (conversion at the parity boundary: ``parity.metrics.to_numpy``)."""
from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    z = x - m
    return z - np.log(np.sum(np.exp(z)))


def kl_divergence(ref_logits: np.ndarray, opt_logits: np.ndarray) -> float:
    """KL(ref || opt) of the two next-token distributions, in nats (float64)."""
    lr, lo = log_softmax(ref_logits), log_softmax(opt_logits)
    return float(np.sum(np.exp(lr) * (lr - lo)))


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN/Inf: non-finite numbers are written as null."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None
