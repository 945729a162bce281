"""One captured input: its exact bytes (hashed, and kept when small) or, above the store limit, the
statistics it is regenerated from.

Regeneration: per channel (the trailing dims but the first, as many as fit in :data:`MAX_CHANNELS`
values: a head's features, a hidden column), the mean, standard deviation, minimum and maximum over all other
positions; the replay draws ``clip(mean + std z, min, max)``, ``z`` standard normal from the
recorded seed, rounded to the captured dtype. Per-channel scale and range are kept (a KDA gate
channel's decays stay inside the range it had: ``log_decay``); the joint structure across tokens
is not. Integer inputs (ids, slot ids, lengths, cu_seqlens) are always kept exactly.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

MAX_CHANNELS = 4096          # values per statistics tensor (a 32 x 128 head block, a 2304-wide row)
STORE_LIMIT = 1 << 20        # bytes: a float input above it is regenerated (docs/cli.md says why)
HASH_CHUNK = 1 << 26         # bytes per host transfer while hashing a large device tensor

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
               "int32": "I32", "int64": "I64"}
STATS = ("mean", "std", "min", "max")


def dtype_name(t: torch.Tensor) -> str:
    for name, d in DTYPES.items():
        if t.dtype == d:
            return name
    raise ValueError(f"unsupported dtype {t.dtype}")


def is_int(dtype: str) -> bool:
    return dtype.startswith("int")


@dataclass
class Frozen:
    """An input as captured: ``values`` (a CPU tensor of the captured dtype) when stored, else
    ``stats`` (name -> float64 array of the channel shape: the last ``channels`` dims) and ``seed``."""

    dtype: str
    shape: tuple
    sha256: str
    values: torch.Tensor | None = None
    stats: dict | None = None
    channels: int = 0
    seed: int = 0

    @property
    def stored(self) -> bool:
        return self.values is not None


def digest(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes as the op received them: its dtype, C order, little endian
    (device tensors are copied to the host in chunks)."""
    h = hashlib.sha256()
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    for lo in range(0, raw.numel(), HASH_CHUNK):
        h.update(raw[lo:lo + HASH_CHUNK].cpu().numpy().tobytes())
    return h.hexdigest()


def channels_of(shape) -> int:
    """How many trailing dims the statistics keep: as many as fit in MAX_CHANNELS values, never the
    first dim (the statistics are taken over something: rows, tokens, experts, slots)."""
    n, k = 1, 0
    for d in reversed(tuple(shape)[1:]):
        if n * d > MAX_CHANNELS:
            break
        n, k = n * d, k + 1
    return k


def derive_seed(base: int, index: int, name: str) -> int:
    """A 32-bit seed per (capture seed, case index, input name): recorded in the file."""
    return int.from_bytes(hashlib.sha256(f"{base}/{index}/{name}".encode()).digest()[:4], "little")


def freeze(t: torch.Tensor, *, limit: int, seed: int, what: str) -> Frozen:
    """``t`` as captured: its values when integer or at most ``limit`` bytes, else its per-channel
    statistics and ``seed``. ValueError naming ``what`` for a non-finite float input."""
    name = dtype_name(t)
    shape = tuple(int(d) for d in t.shape)
    f = Frozen(name, shape, digest(t))
    if not is_int(name) and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: non-finite values reached the op (the model run is no workload to certify)")
    if is_int(name) or t.numel() * t.element_size() <= limit:
        f.values = t.detach().to("cpu", copy=True).contiguous()
        return f
    f.channels, f.seed = channels_of(shape), seed
    f.stats = statistics(t, f.channels)
    return f


def statistics(t: torch.Tensor, channels: int) -> dict:
    """Mean, std, min, max over every position but the last ``channels`` dims (float64, on t's device)."""
    width = math.prod(t.shape[t.dim() - channels:]) if channels else 1
    x = t.detach().reshape(-1, width).to(torch.float64)
    cshape = tuple(t.shape[t.dim() - channels:])
    out = {"mean": x.mean(0), "std": x.std(0, correction=0), "min": x.amin(0), "max": x.amax(0)}
    return {k: v.reshape(cshape).cpu().numpy() for k, v in out.items()}


def regenerate(shape, dtype: str, stats: dict, seed: int) -> np.ndarray:
    """float64 values of ``shape`` drawn as the module docstring says, rounded to ``dtype``."""
    z = np.random.default_rng(seed).standard_normal(tuple(shape))
    x = np.clip(stats["mean"] + stats["std"] * z, stats["min"], stats["max"])
    return torch.from_numpy(x).to(DTYPES[dtype]).to(torch.float64).numpy()


def log_decay_range(g_raw, A_log, dt_bias) -> list:
    """[min, max] of the KDA gate's log-decay ``-exp(A_log) softplus(g_raw + dt_bias)`` over every
    position and channel (g_raw [..., HV, K]; any array namespace torch takes)."""
    g_raw = torch.as_tensor(g_raw).to(torch.float64)
    HV, K = g_raw.shape[-2:]
    A = torch.as_tensor(A_log).to(g_raw.device, torch.float64).reshape(HV, 1)
    b = torch.as_tensor(dt_bias).to(g_raw.device, torch.float64).reshape(HV, K)
    g = -torch.exp(A) * torch.nn.functional.softplus(g_raw + b)
    return [float(g.min()), float(g.max())]


def extras(op: str, arrays: dict) -> dict:
    """Per-input facts the file keeps beside the statistics: the fused KDA ops' log-decay range."""
    if op in ("kda.fused_chunked", "kda.fused_recurrent_decode") and arrays["g_raw"].numel():
        return {"g_raw": {"log_decay": log_decay_range(arrays["g_raw"], arrays["A_log"], arrays["dt_bias"])}}
    return {}
