"""Bookkeeping of ``Model.decode_batch``, beside the math in ``reference.model``: the batch's
arguments checked, and a batch's trace split into its sequences' own traces.

A ``decode_batch`` trace holds the keys ``decode``'s trace holds, each the B sequences' values
concatenated along axis 0 in batch order: ``[B, ...]`` for the per-token entries (``[T, ...]`` in
``decode``, T = 1) and, with ``model.trace_kda_core``, ``[B * HV, K, V]`` for
``layers.{i}.kda.initial_state`` (``[HV, K, V]`` in ``decode``). ``split_trace`` cuts every entry
into B equal parts along axis 0: part ``b`` is, bit for bit, the trace ``decode`` fills for
sequence ``b``. The optimized model's ``decode_batch`` traces follow the same rule (its entries are
all per-token rows), so one split serves both paths.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kimi.config import KimiConfig

from .cache import ModelCache, check_cache
from .checks import check_token_ids
from .executor import to_numpy


def check_batch(token_ids, caches, config: KimiConfig) -> tuple[np.ndarray, list[ModelCache]]:
    """``(ids [B] int64, caches)`` of a ``decode_batch`` call: one token id in ``[0, vocab)`` for
    each of B >= 1 reference ``ModelCache``s (any lengths; one cache may appear twice: the
    reference never changes a cache). ``ValueError`` naming the argument otherwise."""
    if hasattr(token_ids, "shape") and not isinstance(token_ids, np.ndarray):
        token_ids = to_numpy(token_ids)  # a torch tensor from a GPU engine
    ids = check_token_ids(token_ids, config.vocab_size)
    if isinstance(caches, ModelCache) or not isinstance(caches, Sequence):
        raise ValueError(f"caches: expected a sequence of B reference ModelCaches, got {type(caches).__name__}")
    caches = list(caches)
    if len(caches) != len(ids):
        raise ValueError(f"decode_batch: {len(ids)} token ids for {len(caches)} caches")
    for b, cache in enumerate(caches):
        try:
            check_cache(cache, config)
        except ValueError as exc:
            raise ValueError(f"caches[{b}]: {exc}") from None
    return ids, caches


@dataclass
class Rider:
    """Rows another computation hands one layer's FFN of a ``decode_batch`` step, to run in the
    same call as the batch's own rows (each weight read once for both): ``mid [N, D]``, the stream
    after the mixer (host or executor array), and for an MoE layer the expert ids ``[N, k_e]`` to
    run them on (not the router's own). ``out``, filled by the call: their FFN outputs ``[N, D]`` on
    the executor. The diff's replay rides the engine's inputs along with the reference's step."""
    mid: Any
    ids: Any = None
    out: Any = None


def check_riders(riders, config: KimiConfig) -> dict[int, Rider]:
    """``riders`` (``{layer: Rider}`` or None) checked: layers of the model, ``mid [N, D]``, and for
    an MoE layer integer ``ids [N, k_e]`` in ``[0, E)``. ``ValueError`` naming the layer otherwise."""
    if riders is None:
        return {}
    D, k, E = config.hidden_size, config.num_experts_per_token, config.num_experts
    for i, r in riders.items():
        where = f"riders[{i}]"
        if not isinstance(r, Rider) or not (isinstance(i, int) and 0 <= i < config.num_hidden_layers):
            raise ValueError(f"{where}: expected a Rider of a layer in [0, {config.num_hidden_layers})")
        shape = tuple(r.mid.shape)
        if len(shape) != 2 or shape[1] != D:
            raise ValueError(f"{where}: mid of shape {shape}; expected (N, {D})")
        if config.is_moe_layer(i):
            ids = to_numpy(r.ids) if r.ids is not None else None
            if ids is None or ids.shape != (shape[0], k) or ids.dtype.kind not in "iu" or \
                    (ids.size and not (ids.min() >= 0 and ids.max() < E)):
                raise ValueError(f"{where}: an MoE layer's rider needs integer expert ids of shape ({shape[0]}, {k}) "
                                 f"in [0, {E})")
    return dict(riders)


def split_trace(trace: dict, B: int) -> list[dict]:
    """The B sequences' own traces of a batch's ``trace`` (module docstring): every entry cut into
    B equal parts along axis 0 (views, not copies). ``ValueError`` for an entry whose first axis B
    does not divide."""
    out: list[dict] = [{} for _ in range(B)]
    for key, value in trace.items():
        rows = value.shape[0] if value.ndim else 0
        if rows % B or not rows:
            raise ValueError(f"trace {key}: {tuple(value.shape)} is not {B} sequences' entries along axis 0")
        n = rows // B
        for b in range(B):
            out[b][key] = value[b * n:(b + 1) * n, ...]
    return out
