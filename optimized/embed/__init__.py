"""Token embedding and LM head (spec b.15). Plain torch: a gather and one GEMM are already at their
memory/compute floors in torch; nothing to fuse at this boundary.

float32 ``lm_head`` runs with TF32 off (asserted, see ``optimized._checks``).
"""
from __future__ import annotations

import torch

from .. import _counters
from .._checks import check_float, check_same_device, require_ieee_fp32_matmul

__all__ = ["embedding", "lm_head"]


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[ids]``: ids [T] integer, each in ``[0, vocab)``; table [vocab, D]. Returns [T, D] in
    table's dtype.

    Ids are validated: on CPU with an error naming the first bad id; on CUDA with an asynchronous
    device assert (no host sync in the decode loop).
    """
    op = "embed.embedding"
    _counters.record(op)
    check_float(op, "table", table)
    if table.dim() != 2:
        raise ValueError(f"{op}: table: expected [vocab, D], got {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise ValueError(f"{op}: ids: expected [T] int32/int64, got {tuple(ids.shape)} {ids.dtype}")
    check_same_device(op, ids=ids, table=table)
    V = table.shape[0]
    if ids.numel():
        if ids.device.type == "cpu":
            bad = ((ids < 0) | (ids >= V)).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise IndexError(f"{op}: ids[{i}] = {int(ids[i])} out of range [0, {V}) "
                                 f"({bad.numel()} bad ids)")
        else:
            torch._assert_async(((ids >= 0) & (ids < V)).all(), f"{op}: ids out of range [0, {V})")
    return table.index_select(0, ids)


def lm_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T``: h [T, D]; weight [vocab, D] (same dtype). Returns logits [T, vocab] in h's
    dtype (bf16 GEMMs accumulate in fp32; float32 runs refuse TF32)."""
    op = "embed.lm_head"
    _counters.record(op)
    check_float(op, "h", h)
    check_float(op, "weight", weight)
    if h.dim() != 2:
        raise ValueError(f"{op}: h: expected [T, D], got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"{op}: weight: expected [vocab, D] with D = {h.shape[1]}, got {tuple(weight.shape)}")
    if weight.dtype != h.dtype:
        raise TypeError(f"{op}: weight: dtype {weight.dtype} differs from h's {h.dtype}")
    check_same_device(op, h=h, weight=weight)
    require_ieee_fp32_matmul(op, h, weight)
    return h @ weight.T
