"""The model's KDA calls captured as records (parity/capture/sites.py): the chunked prefill as
kda.fused_chunked (one sequence per batch row, no cu_seqlens), the decode step as
kda.fused_recurrent_decode."""
from __future__ import annotations

from parity.registry import Site, picked

from .args import FUSED


def _prefill(a):
    arrays = {n: a[n] for n in FUSED}
    arrays.update(initial_state=a["initial_state"], cu_seqlens=None)
    return arrays, {}


SITES = (
    Site("kda_prefill", "kda.fused_chunked", _prefill),
    Site("kda_decode_", "kda.fused_recurrent_decode", picked(*FUSED, "state_pool", "slot_ids")),
)
