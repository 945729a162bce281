"""The arguments of the KDA ops: the array arguments of the core and fused ops by name, in order,
and the sequences a batch holds (``cu_seqlens``)."""
from __future__ import annotations

import numpy as np

CORE = ("q", "k", "v", "g", "beta")
FUSED = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")
KWARG_ARRAYS = ("initial_state", "cu_seqlens")


def segments(B, T, cu_seqlens) -> list[tuple[int, int, int, int]]:
    """The sequences of a batch as ``(row b, first token, end token, sequence n)``: each row one
    sequence, or with ``cu_seqlens`` (``[N+1]``, B = 1; a NumPy array, a torch tensor on any device
    or a list) row 0 cut into N."""
    if cu_seqlens is None:
        return [(b, 0, T, b) for b in range(B)]
    cu = [int(c) for c in np.ravel(cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    return [(0, cu[i], cu[i + 1], i) for i in range(len(cu) - 1)]
