"""Synthetic weights: every tensor a pure function of ``(seed, tensor name, element index)``.

``SyntheticSource(config, seed)`` is a ``WeightSource`` (see ``checkpoint.py``) that generates each
tensor on demand, nothing cached, so any preset up to kimi-linear-48b can be used without a
checkpoint on disk. ``synthetic_values`` is the generator itself and ``synthetic_init`` the per-tensor
(mean, std); together with the recipe below they are all the optimized side needs to generate the
same weights on a GPU, bit for bit.

Scales are chosen so that a forward pass looks like a real model's: RMSNorm weights around 1,
projections ``~1/sqrt(fan_in)``, O(1) final logits, KDA decays per step between ~0.4 and ~0.999,
and a router correction bias comparable to the spread of the sigmoid scores.
"""
from __future__ import annotations

import math
import zlib

import array_api_compat
import numpy as np

from .checkpoint import CheckpointError, WeightSource
from .config import PRESETS, KimiConfig
from .storage import parallel_blocks, raw_to_float64, to_storage
from .tensors import expected_tensors, storage_dtype

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D  # both multipliers < 2**31: a 32-bit value times one fits in int64
MUL2 = 0x5BD1E995
GOLDEN = 0x9E3779B9
_BLOCK = 1 << 16  # elements per NumPy task: its int64 temporaries stay in cache
_PART = 1 << 23  # values generated at a time for ``linear`` (32 MB of float32 temporaries)
_DEVICE_BLOCK = 1 << 24  # elements per pass on a GPU library (~400 MB of temporaries)


def mix32(x: int) -> int:
    """The 32-bit mixing function on a Python int in ``[0, 2**32)`` (see ``synthetic_values``)."""
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def tensor_keys(seed: int, name: str) -> tuple[int, int]:
    """The two per-tensor keys ``(k1, k2)`` of ``synthetic_values``."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed <= MASK32:
        raise ValueError(f"seed: expected an integer in [0, 2**32), got {seed!r}")
    k1 = mix32(mix32(int(seed)) ^ zlib.crc32(name.encode("utf-8")))
    k2 = mix32(k1 ^ GOLDEN)
    return k1, k2


def _mix32_inplace(x):
    # int64 holding values < 2**32: every product is < 2**63 and the mask keeps 32 bits. In-place
    # operators of the standard, on an array this module allocated: cache-sized blocks of int64
    # then run within 12% of NumPy's uint32 arithmetic (out-of-place int64 is 2.5x slower).
    x ^= x >> 16
    x *= MUL1
    x &= MASK32
    x ^= x >> 15
    x *= MUL2
    x &= MASK32
    x ^= x >> 16
    return x


def values_at(xp, k1: int, k2: int, index, mean: float, std: float):
    """float32 values of the flat element indices ``index`` (int64 ``[n]`` of namespace ``xp``):
    the recipe of ``synthetic_values``, written once for every executor (NumPy; torch on CPU or
    GPU, with which the optimized side generates its weights on the device)."""
    h = index + k1  # a new array: the in-place steps below write nothing of the caller's
    h &= MASK32
    h = _mix32_inplace(h)
    h ^= k2
    h = _mix32_inplace(h)
    h >>= 9
    h *= 2
    h += 1 - (1 << 23)  # 2u + 1 - 2**23: odd, |.| < 2**23
    z = xp.astype(h, xp.float64)
    z *= 2.0 ** -23  # exact
    z *= std * math.sqrt(3.0)  # the two rounded operations of the recipe: multiply, then add
    z += mean
    return xp.astype(z, xp.float32)


def synthetic_values(seed: int, name: str, count: int, *, start: int = 0, mean: float = 0.0,
                     std: float = 1.0, xp=None, device=None):
    """Elements ``start .. start+count-1`` (flat, row-major) of tensor ``name``: float32 ``[count]``,
    a NumPy array (computed on every core), or an array of namespace ``xp`` on ``device``.

    The exact recipe (integers are unsigned 32-bit values held in int64, ``& M`` with
    ``M = 0xFFFFFFFF``; every product is of a value < 2**32 and a constant < 2**31, so it fits in int64
    and torch computes the same with int64 tensors):

        mix32(x):  x ^= x >> 16;  x = (x * 0x7FEB352D) & M;  x ^= x >> 15;
                   x = (x * 0x5BD1E995) & M;  x ^= x >> 16
        k1 = mix32(mix32(seed) ^ crc32(name))      # crc32 = zlib.crc32 of the UTF-8 name, unsigned
        k2 = mix32(k1 ^ 0x9E3779B9)
        h  = mix32(mix32((i + k1) & M) ^ k2)       # i = flat element index, 0 <= i < 2**32
        z  = (2 * (h >> 9) + 1 - 2**23) * 2**-23   # odd multiples of 2**-23 in (-1, 1), exact
        value = float32( z * (std * sqrt(3)) + mean )

    where ``std * sqrt(3)`` is computed in Python float (IEEE double), the product and the sum are
    two separately rounded float64 operations (no fused multiply-add), and the cast to float32 rounds
    to nearest even. ``value`` is uniform with the given mean and standard deviation.
    ``SyntheticSource`` then rounds it to the storage dtype (bf16: round to nearest even)."""
    if not isinstance(count, (int, np.integer)) or count < 0 or start < 0 or start + count > 1 << 32:
        raise ValueError(f"synthetic_values: need 0 <= start, 0 <= count, start + count <= 2**32; "
                         f"got start={start}, count={count}")
    k1, k2 = tensor_keys(seed, name)
    if xp is not None and not array_api_compat.is_numpy_namespace(xp):
        return _values_blocks(xp, device, k1, k2, start, count, mean, std)
    out = np.empty(count, dtype=np.float32)

    def block(lo, hi):
        out[lo:hi] = values_at(np, k1, k2, np.arange(start + lo, start + hi, dtype=np.int64), mean, std)

    parallel_blocks(block, count, _BLOCK)
    return out


def _values_blocks(xp, device, k1, k2, start, count, mean, std):
    # another library (a GPU): large blocks, one kernel per step over 16M elements
    parts = [values_at(xp, k1, k2, xp.arange(start + lo, start + min(count, lo + _DEVICE_BLOCK),
                                             dtype=xp.int64, device=device), mean, std)
             for lo in range(0, count, _DEVICE_BLOCK)]
    if not parts:
        return xp.zeros(0, dtype=xp.float32, device=device)
    return parts[0] if len(parts) == 1 else xp.concat(parts)


# The decay parameters: exp(A_log) uniform in log space over [1/16, 1] ("log U(1,16)" scaled down by
# 16) and softplus(dt_bias) in [0.01, 0.97], so alpha = exp(-exp(A_log) * softplus(dt_bias + g_raw))
# lies between ~0.4 and ~0.999 per step (~0.6 to ~0.99 for most heads).
_A_LOG_RANGE = (-math.log(16.0), 0.0)
_DT_BIAS_RANGE = (-4.6, 0.5)


def _uniform(lo: float, hi: float) -> tuple[float, float]:
    return (lo + hi) / 2, (hi - lo) / 2 / math.sqrt(3.0)


def synthetic_init(config: KimiConfig, name: str) -> tuple[float, float]:
    """(mean, std) of tensor ``name`` in a synthetic model of ``config``."""
    shape = expected_tensors_cached(config)[name]
    if name.endswith("norm.weight"):  # every RMSNorm / gated norm / kv_a_layernorm weight
        return 1.0, 0.05
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name.endswith(".A_log"):
        return _uniform(*_A_LOG_RANGE)
    if name.endswith(".dt_bias"):
        return _uniform(*_DT_BIAS_RANGE)
    if name.endswith(".e_score_correction_bias"):
        return 0.0, 0.1  # the sigmoid scores spread by ~0.2 (router logits ~N(0, 1))
    if name.endswith(".f_b_proj.weight"):
        return 0.0, 0.5 / math.sqrt(shape[-1])  # g_raw ~0.5: the decay is set mostly by dt_bias
    return 0.0, 1.0 / math.sqrt(shape[-1])  # projections (fan_in = last dim) and conv taps (W)


_TABLES: dict[KimiConfig, dict[str, tuple[int, ...]]] = {}


def expected_tensors_cached(config: KimiConfig) -> dict[str, tuple[int, ...]]:
    table = _TABLES.get(config)
    if table is None:
        table = _TABLES[config] = expected_tensors(config)
    return table


class SyntheticSource(WeightSource):
    """A ``WeightSource`` whose tensors are generated from ``(seed, name)`` on demand, rounded to the
    storage dtype of ``tensors.storage_dtype`` (bf16; float32 for A_log, dt_bias and the router bias),
    exactly as they would be after a round trip through a checkpoint written from it."""

    def __init__(self, config: KimiConfig, seed: int = 0):
        tensor_keys(seed, "")  # validates the seed
        self.config, self.seed = config, int(seed)
        self._shapes = expected_tensors_cached(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"{name}: no such tensor in {self.describe()}") from None

    def storage_dtype(self, name: str) -> str:
        self.shape(name)
        return storage_dtype(name)

    def describe(self) -> str:
        preset = next((k for k, v in PRESETS.items() if v == self.config), "custom config")
        return f"synthetic {preset}, seed {self.seed}"

    def get_raw(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        mean, std = synthetic_init(self.config, name)
        values = synthetic_values(self.seed, name, math.prod(shape), mean=mean, std=std)
        return to_storage(values, storage_dtype(name)).reshape(shape)

    def get_rows(self, name: str, rows) -> np.ndarray:
        dtype = storage_dtype(name)
        values = self._row_values(name, rows, np, None)
        return self.check_finite(name, raw_to_float64(to_storage(values, dtype), dtype))

    def get_raw_rows(self, name: str, rows) -> np.ndarray:
        return to_storage(self._row_values(name, rows, np, None), storage_dtype(name))

    def raw_parts(self, name: str):
        # rows of at most _PART values at a time: the 48B lm_head is not generated whole
        shape = self.shape(name)
        rows = max(1, _PART // max(1, math.prod(shape[1:])))
        for lo in range(0, shape[0], rows):
            yield self.get_raw_rows(name, np.arange(lo, min(shape[0], lo + rows)))

    def values_on(self, name: str, rows, xp, device):
        """Generated by ``xp`` where the model runs on a GPU (no host work, no copy); None on the
        CPU, where NumPy makes the bits on every core (torch's int64 CPU kernels are ~5x slower at
        this hash)."""
        if device == "cpu":
            return None
        if rows is not None:
            return self._row_values(name, rows, xp, device)
        shape = self.shape(name)
        mean, std = synthetic_init(self.config, name)
        values = synthetic_values(self.seed, name, math.prod(shape), mean=mean, std=std, xp=xp, device=device)
        return xp.reshape(values, shape)

    def _row_values(self, name: str, rows, xp, device):
        """float32 values ``[len(rows), *shape[1:]]`` of rows ``rows`` (host ints) of ``name``."""
        shape = self.shape(name)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= shape[0])):
            raise IndexError(f"{name}: rows must be 1-D indices in [0, {shape[0]})")
        width = math.prod(shape[1:])
        mean, std = synthetic_init(self.config, name)
        k1, k2 = tensor_keys(self.seed, name)
        if xp is np:
            values = np.empty((rows.size, width), dtype=np.float32)

            def block(lo, hi):  # rows lo..hi-1 of the request
                index = (rows[lo:hi, None] * width + np.arange(width, dtype=np.int64)).reshape(-1)
                values[lo:hi] = values_at(np, k1, k2, index, mean, std).reshape(hi - lo, width)

            parallel_blocks(block, rows.size, max(1, _BLOCK // max(width, 1)))
        else:
            r = xp.asarray(rows, device=device)
            index = xp.reshape(r[:, None] * width + xp.arange(width, dtype=xp.int64, device=device), (-1,))
            values = xp.reshape(values_at(xp, k1, k2, index, mean, std), (rows.size, width))
        return xp.reshape(values, (rows.size, *shape[1:]))


__all__ = ["SyntheticSource", "synthetic_values", "synthetic_init", "tensor_keys", "mix32",
           "CheckpointError"]
