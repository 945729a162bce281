"""A bracket for the intermediates the chunked KDA kernels store (docs/error-bounds.md, "KDA chunk
stages"): when ``kda.chunked`` fails its bound, comparing each stage with its float64 value names the
kernel that went wrong (G: the gate/prefix-sum kernel; Aq, kg, qg: the blocks kernel; w, u: the WY
kernel; h, v_new: the state kernel). parity.ops.kda.emulate.chunked(stages=) gives the float64 stages.

Per stage and value head, relative to the stage's largest magnitude there:

    e = 16 (u_s sqrt(nc) + ua (sqrt(K + min(T, C) + nc) + Gc))

``u_s``: the run dtype's unit roundoff when the kernels store intermediates in it (bf16/fp16 runs),
else 0; ``nc``: chunks per sequence (the state picks up one rounded v_new per chunk, a random walk);
the square root of the accumulation lengths (the K-long dots, a chunk's rows, the chunks); ``Gc`` the
largest within-chunk prefix |G| (differences of prefix sums cost ua |G| in an exponent). 16 = 4
roundings per stored value, times 4 because w and u are products with the triangular inverse,
whose size the stage maximum understates. A first-order bracket for localization, per head: the op's
outputs are judged by the record's bound (parity/ops/kda/bounds.py).
"""
from __future__ import annotations

import math

import numpy as np

STAGES = ("G", "Aq", "w", "u", "kg", "qg", "h", "v_new")


def chunk_stage(name: str, ref: np.ndarray, G: np.ndarray, p, *, T: int, K: int, chunk: int) -> np.ndarray:
    """Bound of stage ``name`` (float64 values ``ref``, shaped as the kernel's buffer) given the
    float64 prefix sums ``G`` and the run's :class:`parity.bounds.core.Precision` ``p``."""
    stored = p.u if p.dtype in ("bfloat16", "float16") else 0.0
    nc = max(1, math.ceil(T / chunk))
    Gc = float(np.max(np.abs(G))) if G.size else 0.0
    e = 16 * (stored * math.sqrt(nc) + p.ua * (math.sqrt(K + min(T, chunk) + nc) + Gc))
    per_head = (0, 2, 3) if name == "h" else (0, 1, 3)
    return e * np.max(np.abs(ref), axis=per_head, keepdims=True) * np.ones_like(ref)
