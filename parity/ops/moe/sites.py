"""The model's MoE calls captured as records (parity/record/capture/sites.py)."""
from __future__ import annotations

from parity.registry import Site, picked

SITES = (
    Site("router_logits", "moe.router_logits", picked("x", "weight")),
    Site("router", "moe.router", lambda a: ({"logits": a["logits"], "bias": a["bias"]}, dict(a["kw"]))),
    Site("experts", "moe.experts", picked("x", "weights", "ids", "w1", "w2", "w3"),
         note="in decode the model runs the grouped form with its fixed decode tiles and the shared expert "
              "fused as one more group (moe._experts(form='grouped', shared=..., launch=GROUPED_DECODE)); "
              "the replay certifies the registered moe.experts (the form its pair count picks) on the routed "
              "inputs, not that fused launch"),
    Site("swiglu", "moe.swiglu", picked("x", "w_gate", "w_up", "w_down")),
)
