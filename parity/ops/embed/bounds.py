"""Bounds of the embedding and the LM head (docs/error-bounds.md, section 7): the gather is exact;
the head is a D-long dot per logit, accumulated in ua (``Precision.dot``: plus the rounding of its
operands under a TF32 or bf16 contract)."""
from __future__ import annotations

import numpy as np


def embedding(x, kw, ref, p):
    return {"y": np.zeros_like(ref["y"])}


def lm_head(x, kw, ref, p):
    h, W = x["h"], x["weight"]
    return {"logits": p.dot(h.shape[-1]) * (np.abs(h) @ np.abs(W).T) + p.uo("logits") * np.abs(ref["logits"])}
