"""Token embedding and LM head (spec b.15), float64."""
from __future__ import annotations

import numpy as np


def embedding(ids, table):
    """Row lookup ``table[ids]``.

    ids: [T] integer token ids, each in ``[0, vocab)`` (checked: a negative id would otherwise
    silently wrap around); table: [vocab, D]. Returns [T, D] float64.
    """
    ids = np.asarray(ids)
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2:
        raise ValueError(f"table: expected [vocab,D], got {table.shape}")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids: expected integer [T], got {ids.dtype} {ids.shape}")
    vocab = table.shape[0]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise ValueError(f"ids: token id {int(ids[bad[0]])} at position {int(bad[0])} is outside "
                         f"the vocabulary [0, {vocab}) ({bad.size} such ids)")
    return table[ids]


def lm_head(h, weight):
    """Logits ``h @ weight.T`` (untied, no bias, no logit scale).

    h: [T, D] (or [D] for one position); weight: [vocab, D]. Returns [T, vocab] (or [vocab]).
    """
    h = np.asarray(h, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2 or h.ndim not in (1, 2) or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"lm_head: expected h [T,D] and weight [vocab,D] with the same D, "
                         f"got h {h.shape}, weight {weight.shape}")
    return h @ weight.T
