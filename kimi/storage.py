"""Storage bits and the host thread pool: the leaf every other module of the reference builds on.

A checkpoint stores a weight as bits of its storage dtype (``uint16`` for bf16, ``float16``,
``float32``, ``float64``). This module turns values into those bits (``to_storage``: round to
nearest, ties to even, correctly rounded from float64 too) and bits back into float64
(``raw_to_float64``: exact), and holds the one thread pool the host conversions and the streamed
products (``reference.streamed``) share. It imports NumPy only, and nothing of the package.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# storage dtype -> NumPy dtype of its bits (bf16 has none in NumPy: its bit patterns as uint16)
RAW_NUMPY = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4"),
             "float64": np.dtype("<f8")}
# float dtypes that hold every value of a storage dtype exactly (a shared tensor may be wider)
HOLDS_EXACTLY = {"bfloat16": ("bfloat16", "float32", "float64"),
                 "float16": ("float16", "float32", "float64"), "float32": ("float32", "float64"),
                 "float64": ("float64",)}


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# -- the thread pool: NumPy's loops and BLAS release the GIL, so threads scale ------------------------

_CONVERT_BLOCK = 1 << 20  # elements per task at most: 4 MB of uint32 + 8 MB of float64, cache-friendly
_MIN_BLOCK = 1 << 16  # and at least (a task costs ~10 us to hand out)
_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process's pool of one worker per core (made on first use)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=cpu_count(), thread_name_prefix="reference-bf16")
    return _POOL


def parallel_blocks(fn, n: int, block: int) -> None:
    """``fn(lo, hi)`` for the blocks of ``range(n)``, on every core (for NumPy work on disjoint
    slices of an output: NumPy's loops release the GIL, so threads scale)."""
    if n <= block or cpu_count() == 1:
        for lo in range(0, n, block):
            fn(lo, min(n, lo + block))
        return
    jobs = [pool().submit(fn, lo, min(n, lo + block)) for lo in range(0, n, block)]
    for j in jobs:
        j.result()


def _block(n: int) -> int:
    """Elements per task: at most ``_CONVERT_BLOCK``, and small enough that a tensor of ``n`` (one
    48B expert matrix is 2.4M) gives every core two tasks."""
    return max(_MIN_BLOCK, min(_CONVERT_BLOCK, -(-n // (2 * cpu_count()))))


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of a float NumPy array is finite: block sums on every core (a sum of
    finite storage values, |x| < 3.5e38 each, cannot overflow float64, so it is finite exactly
    when they all are)."""
    flat = a.reshape(-1)
    size = _block(flat.size)
    if flat.size <= size:
        return math.isfinite(float(np.sum(flat)))
    ok = [True] * (-(-flat.size // size))

    def block(lo, hi):
        ok[lo // size] = math.isfinite(float(np.sum(flat[lo:hi])))

    parallel_blocks(block, flat.size, size)
    return all(ok)


# -- bits -> float64 ----------------------------------------------------------------------------------

def _bf16_block(src: np.ndarray, dst: np.ndarray) -> None:
    # bf16 is the top half of a float32: shift the 16 bits up, reinterpret, widen (all exact)
    dst[...] = np.left_shift(src, np.uint32(16), dtype=np.uint32).view(np.float32)


def bf16_bits_to_float64(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (``uint16``) -> float64, exactly; blocks of 1M elements on every core
    (NumPy's ufuncs release the GIL), so a 48B layer converts at memory speed."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {bits.dtype}")
    out = np.empty(bits.shape, dtype=np.float64)
    if bits.size <= _block(bits.size):
        _bf16_block(bits, out)
        return out
    src, dst = bits.reshape(-1), out.reshape(-1)  # reshape(-1) of a non-contiguous view copies: fine
    parallel_blocks(lambda lo, hi: _bf16_block(src[lo:hi], dst[lo:hi]), src.size, _block(src.size))
    return out


def raw_to_float64(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Storage bits -> float64 (exact)."""
    if dtype == "bfloat16":
        return bf16_bits_to_float64(raw)
    return np.asarray(raw).astype(np.float64)


# -- values -> bits -----------------------------------------------------------------------------------

def _float64_to_float32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 bits rounded toward zero with the last bit forced to 1 when inexact.

    Rounding to odd into a format with >= p+2 bits and then to nearest-even gives the correctly
    rounded result, so float64 -> (odd) float32 -> bf16 rounds once, not twice."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        back = t.astype(np.float64)
    finite = np.isfinite(x)
    inexact = finite & (back != x)
    t = np.where(inexact & (np.abs(back) > np.abs(x)), np.nextafter(t, np.float32(0)), t)
    return t.view(np.uint32) | inexact.astype(np.uint32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float16/32/64 values to bf16 (round to nearest, ties to even; correctly rounded from
    float64 too); returns the ``uint16`` bit patterns. NaN stays NaN, overflow goes to +-inf."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        u = _float64_to_float32_round_to_odd(x)
    elif x.dtype in (np.float32, np.float16):
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    else:
        raise TypeError(f"cannot round {x.dtype} to bfloat16")
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values -> storage bits of ``dtype`` (``uint16`` for bf16). An array that already holds the
    storage representation (``uint16`` for bf16, ``float16``, ``float32``) is kept as it is."""
    x = np.asarray(x)
    if dtype not in RAW_NUMPY:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {sorted(RAW_NUMPY)}")
    if x.dtype == RAW_NUMPY[dtype]:
        return x
    if dtype == "bfloat16":
        return float_to_bf16_bits(x)
    if x.dtype.kind != "f":
        raise TypeError(f"cannot store {x.dtype} values as {dtype}")
    with np.errstate(over="ignore"):
        return x.astype(RAW_NUMPY[dtype])  # numpy rounds float64 -> float16/32 correctly
