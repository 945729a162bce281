"""The model's KDA calls captured as records (parity/record/capture/sites.py): the chunked prefill as
kda.fused_chunked (one sequence per batch row, no cu_seqlens), the decode step as
kda.fused_recurrent_decode; a model of the bounded gate passes ``lower_bound``, and its calls are
those ops' ``+lower_bound`` records (the recorder reads it from the kwargs)."""
from __future__ import annotations

from parity.registry import Site

from .args import FUSED


def _gate(a) -> dict:
    return {} if a.get("lower_bound") is None else {"lower_bound": a["lower_bound"]}


def _prefill(a):
    arrays = {n: a[n] for n in FUSED}
    arrays.update(initial_state=a["initial_state"], cu_seqlens=None)
    return arrays, _gate(a)


def _decode(a):
    return {n: a[n] for n in (*FUSED, "state_pool", "slot_ids")}, _gate(a)


SITES = (
    Site("kda_prefill", "kda.fused_chunked", _prefill),
    Site("kda_decode_", "kda.fused_recurrent_decode", _decode),
)
