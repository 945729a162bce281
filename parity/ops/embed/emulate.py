"""Embedding and LM head in torch (see parity.emulate)."""
from __future__ import annotations

from parity.emulate import cdt


def embedding(ids, table):
    return table[ids.long()]


def lm_head(h, weight):
    cd = cdt(h.dtype)
    return (h.to(cd) @ weight.to(cd).T).to(h.dtype)
