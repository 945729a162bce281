"""Checks of the model-level arguments both models take (``reference.load`` / ``optimized.load``
and their ``forward / prefill / decode``): the semantic variants and token ids. One-line
``ValueError``s that name the argument; optimized/ imports these (reference/ imports neither)."""
from __future__ import annotations

import math
import numbers

import numpy as np

MOE_COMBINES = ("unbiased", "biased")


def check_variants(*, moe_combine, kv_norm_eps) -> None:
    """``ValueError`` for an unknown ``moe_combine`` or a non-positive / non-finite ``kv_norm_eps``."""
    if moe_combine not in MOE_COMBINES:
        raise ValueError(f"moe_combine: expected one of {MOE_COMBINES}, got {moe_combine!r}")
    if (not isinstance(kv_norm_eps, numbers.Real) or isinstance(kv_norm_eps, bool)
            or not math.isfinite(kv_norm_eps) or kv_norm_eps <= 0):
        raise ValueError(f"kv_norm_eps: expected a positive finite number, got {kv_norm_eps!r}")


def check_token_ids(ids, vocab_size: int, what: str = "token_ids") -> np.ndarray:
    """``ids`` (a sequence or array) as a non-empty 1-D int64 array of ids in ``[0, vocab_size)``."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected integer token ids, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise ValueError(f"{what}: token id {int(arr[pos])} at position {pos} is outside the "
                         f"vocabulary [0, {vocab_size})")
    return arr.astype(np.int64)


def check_token_id(token_id, vocab_size: int) -> int:
    """One integer token id (a Python or NumPy integer, or a one-element array) in ``[0, vocab_size)``."""
    if isinstance(token_id, np.ndarray) and token_id.size == 1 and token_id.ndim <= 1:
        token_id = token_id.reshape(()).item()
    if np.ndim(token_id) != 0 or not isinstance(token_id, (numbers.Integral, np.integer)) \
            or isinstance(token_id, bool):
        got = f"shape {np.shape(token_id)}" if np.ndim(token_id) else repr(token_id)
        raise ValueError(f"token_id: expected one integer token id, got {got}")
    token_id = int(token_id)
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token_id: token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id
