"""The model's norm calls captured as records (parity/record/capture/sites.py)."""
from __future__ import annotations

from parity.registry import Site, picked

SITES = (
    Site("rms_norm", "norm.rms_norm", picked("x", "weight", kw=("eps",))),
    Site("add_rms_norm", "norm.add_rms_norm", picked("x", "residual", "weight", kw=("eps",))),
    Site("gated_rms_norm", "norm.gated_rms_norm", picked("x", "gate", "weight", kw=("eps",))),
)
