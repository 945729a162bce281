"""The model's embedding and LM-head calls captured as records (parity/record/capture/sites.py)."""
from __future__ import annotations

from parity.registry import Site, picked

SITES = (
    Site("embedding", "embed.embedding", picked("ids", "table")),
    Site("lm_head", "embed.lm_head", picked("h", "weight")),
)
