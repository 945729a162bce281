"""Small numeric helpers of the diff: conversion at the parity boundary and per-step statistics."""
from __future__ import annotations

import numpy as np

def to_f64(x) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array or torch tensor (the one place the diff converts)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64, copy=False)
    if hasattr(x, "detach"):  # torch tensor: no torch import needed here
        import torch

        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


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
