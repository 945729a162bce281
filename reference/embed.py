"""Token embedding and LM head (spec b.15), float64, on any array API executor."""
from __future__ import annotations

from .executor import namespace, to_numpy
from .streamed import StreamedWeight, arrays, linear


def embedding(ids, table):
    """Row lookup ``table[ids]``.

    ids: [T] integer token ids, each in ``[0, vocab)`` (checked: a negative id would otherwise
    silently wrap around); table: [vocab, D]. Returns [T, D] float64.
    """
    xp = namespace(ids, table)
    ids = xp.asarray(ids)
    table = xp.asarray(table, dtype=xp.float64)
    if table.ndim != 2:
        raise ValueError(f"table: expected [vocab,D], got {tuple(table.shape)}")
    if ids.ndim != 1 or not xp.isdtype(ids.dtype, "integral"):
        raise ValueError(f"ids: expected integer [T], got {ids.dtype} {tuple(ids.shape)}")
    vocab = table.shape[0]
    bad = (ids < 0) | (ids >= vocab)
    if bool(xp.any(bad)):
        host, where = to_numpy(ids), to_numpy(bad).nonzero()[0]
        raise ValueError(f"ids: token id {int(host[where[0]])} at position {int(where[0])} is outside "
                         f"the vocabulary [0, {vocab}) ({where.size} such ids)")
    return xp.take(table, ids, axis=0)


def lm_head(h, weight):
    """Logits ``h @ weight.T`` (untied, no bias, no logit scale).

    h: [T, D] (or [D] for one position); weight: [vocab, D] (an array or a
    ``streamed.StreamedWeight``). Returns [T, vocab] (or [vocab]).
    """
    xp = namespace(h, *arrays(weight))
    h = xp.asarray(h, dtype=xp.float64)
    if not isinstance(weight, StreamedWeight):
        weight = xp.asarray(weight, dtype=xp.float64)
    if weight.ndim != 2 or h.ndim not in (1, 2) or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"lm_head: expected h [T,D] and weight [vocab,D] with the same D, "
                         f"got h {tuple(h.shape)}, weight {tuple(weight.shape)}")
    return linear(h, weight)
