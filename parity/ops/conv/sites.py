"""The model's short-convolution calls captured as records (parity/record/capture/sites.py)."""
from __future__ import annotations

from parity.registry import Site, picked


def _prefill(a):
    # state_dtype is the model's pool dtype for the final state, not an argument of the op
    return {"x": a["x"], "weight": a["weight"], "initial_state": a["initial_state"]}, {}


SITES = (
    Site("short_conv", "conv.short_conv", _prefill),
    Site("short_conv_step_", "conv.short_conv_step_", picked("x", "weight", "state_pool", "slot_ids")),
)
