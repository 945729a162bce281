"""The trace an engine may fill: names, shapes, and the check every call's trace passes.

One call (a prefill of ``T`` tokens, or a decode of one) covers ``T`` consecutive positions. A trace
is either empty (the engine does not trace) or holds, for every layer ``i`` (0-indexed), the three
outputs on the residual stream and, for every MoE layer, the router's decisions:

=============================  ===========  ===================================================
name                           shape        what
=============================  ===========  ===================================================
``layers.{i}.mixer``           ``[T, D]``   the KDA or MLA block's output (before the residual add)
``layers.{i}.ffn``             ``[T, D]``   the dense MLP or MoE output (before the residual add)
``layers.{i}.hidden``          ``[T, D]``   the residual stream after the layer
``layers.{i}.router.ids``      ``[T, k_e]`` the chosen experts (MoE layers)
``layers.{i}.router.scores``   ``[T, E]``   ``sigmoid(router logits)``, every expert (MoE layers)
``layers.{i}.router.selection`` ``[T, E]``  optional: ``scores + e_score_correction_bias``
``final_norm``                 ``[T, D]``   optional: the normed final hidden state
=============================  ===========  ===================================================

These are the optimized model's names (``optimized/model.py``), so the localization reads every
engine's trace the same way. Scores are needed for every expert, not only the chosen ones: whether
a router flip is noise depends on the passed-over expert's score too (``parity/diff/router.py``).
A missing ``selection`` is computed here from the scores and the checkpoint's bias.
"""
from __future__ import annotations

import numpy as np

from parity.metrics import to_numpy

LAYER_KEYS = ("mixer", "ffn", "hidden")
ROUTER_KEYS = ("ids", "scores")


class TraceError(ValueError):
    """A trace that does not follow the names and shapes above (one-line message)."""


def expected(config) -> dict[str, str]:
    """Every required trace name -> its width symbol ``D``, ``k_e`` or ``E``."""
    out = {}
    for i in range(config.num_hidden_layers):
        out.update({f"layers.{i}.{k}": "D" for k in LAYER_KEYS})
        if config.is_moe_layer(i):
            out[f"layers.{i}.router.ids"] = "k_e"
            out[f"layers.{i}.router.scores"] = "E"
    return out


def optional(config) -> dict[str, str]:
    out = {"final_norm": "D"}
    out.update({f"layers.{i}.router.selection": "E" for i in range(config.num_hidden_layers)
                if config.is_moe_layer(i)})
    return out


def widths(config) -> dict[str, int]:
    return {"D": config.hidden_size, "k_e": config.num_experts_per_token, "E": config.num_experts}


def check_trace(trace: dict, config, rows: int, *, where: str, bias=None) -> dict:
    """Validate one call's ``trace`` (empty, or complete as above) over ``rows`` positions, and add
    the router ``selection`` where it is missing (``bias(layer) -> [E]``: the checkpoint's
    ``e_score_correction_bias``). Raises ``TraceError`` naming the entry; returns ``trace``."""
    if not trace:
        return trace
    need, extra, width = expected(config), optional(config), widths(config)
    missing = [k for k in need if k not in trace]
    if missing:
        raise TraceError(f"{where}: trace has no {missing[0]}"
                         + (f" (and {len(missing) - 1} more entries)" if len(missing) > 1 else "")
                         + "; a trace holds every layer's mixer, ffn, hidden and every MoE layer's "
                           "router ids and scores, or nothing")
    unknown = sorted(k for k in trace if k not in need and k not in extra)
    if unknown:
        raise TraceError(f"{where}: unknown trace entry {unknown[0]!r}")
    for name, value in trace.items():
        w = width[{**need, **extra}[name]]
        shape = tuple(getattr(value, "shape", np.shape(value)))
        if int(np.prod(shape)) != rows * w or (shape and shape[-1] != w):
            raise TraceError(f"{where}: trace {name}: expected shape ({rows}, {w}), got {shape}")
        if name.endswith(".ids"):
            ids = to_numpy(value)
            if ids.dtype.kind not in "iu":
                raise TraceError(f"{where}: trace {name}: expected integer expert ids, got {ids.dtype}")
            if ids.size and not (0 <= ids.min() and ids.max() < config.num_experts):
                raise TraceError(f"{where}: trace {name}: expert id outside [0, {config.num_experts})")
    for i in range(config.num_hidden_layers):
        key = f"layers.{i}.router"
        if config.is_moe_layer(i) and f"{key}.selection" not in trace:
            scores = trace[f"{key}.scores"]
            b = np.asarray(bias(i), dtype=np.float64)
            if hasattr(scores, "detach"):  # stay in the engine's dtype: its rounding of the sum
                trace[f"{key}.selection"] = scores + scores.new_tensor(b)
            else:
                s = np.asarray(scores)
                trace[f"{key}.selection"] = s + b.astype(s.dtype)
    return trace
