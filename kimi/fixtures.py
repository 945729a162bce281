"""Synthetic checkpoints on disk: what ``parity fixture`` writes, and the bundled default fixture.

``write_fixture(preset, out_dir, seed=...)`` writes a ``SyntheticSource``'s tensors, tensor by
tensor, in their storage dtypes, as a hub-layout checkpoint (``config.json`` + ``model.safetensors``,
or ``shards`` files + ``model.safetensors.index.json``). Loading it gives bit-identical weights to
the source it was written from. The bundled default (``fixtures/default``) is preset ``tiny``,
seed 0: regenerate it with ``parity fixture tiny fixtures/default --seed 0 --force``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from .checkpoint import plan_shards, save_checkpoint
from .config import KimiConfig
from .synthetic import SyntheticSource
from .tensors import storage_dtype

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def default_checkpoint_path() -> Path:
    """The bundled default checkpoint (preset tiny, seed 0) in the repository's ``fixtures/``."""
    return Path(__file__).resolve().parent.parent / "fixtures" / "default"


class _StoredTensors(Mapping):
    """name -> storage bits of a source, generated when asked (one tensor in memory at a time)."""

    def __init__(self, source):
        self._source, self._names = source, source.names()

    def __getitem__(self, name):
        return self._source.get_raw(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def shard_limit(sizes: list[int], shards: int) -> int:
    """The smallest ``shard_max_bytes`` for which the writer's greedy split gives exactly ``shards``
    files; ``ValueError`` when no limit does (more shards than tensors)."""
    if shards < 1 or shards > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {shards} shards")
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # fewest bytes per shard with at most `shards` shards
        mid = (lo + hi) // 2
        if plan_shards(sizes, mid)[-1] + 1 <= shards:
            hi = mid
        else:
            lo = mid + 1
    if plan_shards(sizes, lo)[-1] + 1 != shards:
        raise ValueError(f"cannot split these {len(sizes)} tensors into exactly {shards} shards")
    return lo


def write_fixture(preset: str | KimiConfig, out_dir: str | os.PathLike, *, seed: int = DEFAULT_SEED,
                  shards: int | None = None, overwrite: bool = False) -> Path:
    """Write ``SyntheticSource(preset, seed)`` as a checkpoint in ``out_dir`` (one file, or exactly
    ``shards`` files). Returns the directory."""
    config = KimiConfig.from_name(preset) if isinstance(preset, str) else preset
    source = SyntheticSource(config, seed)
    limit = None
    if shards is not None and shards > 1:
        sizes = [math.prod(source.shape(n)) * _ITEMSIZE[storage_dtype(n)] for n in source.names()]
        limit = shard_limit(sizes, shards)
    return save_checkpoint(out_dir, config, _StoredTensors(source), dtypes=storage_dtype,
                           shard_max_bytes=limit, overwrite=overwrite)
