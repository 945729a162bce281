"""Which op calls of the optimized model are captured, and as which registered op.

The model makes its op calls through one object, ``model.ops`` (``optimized.backends.Ops``); each
of its methods is fitted to the record of the op it runs (the record's input names, scalar keyword
arguments as the op receives them) by a :class:`parity.registry.Site` of the op's family
(``parity/ops/<family>/sites.py``). A method mapped to ``None`` runs unrecorded, with the reason;
:data:`UNCAPTURED` lists what the model computes outside ``model.ops``.
"""
from __future__ import annotations

import inspect

from parity.ops.conv import sites as conv
from parity.ops.embed import sites as embed
from parity.ops.kda import sites as kda
from parity.ops.mla import sites as mla
from parity.ops.moe import sites as moe
from parity.ops.norm import sites as norm

SITES = {s.method: s for family in (embed, norm, conv, kda, mla, moe) for s in family.SITES}

# only MLA's records have mutants that need an array the model never hands over
AUX = dict(mla.AUX)

UNCAPTURED = (
    "the projections (torch GEMMs: KDA/MLA in/out projections, f_b/g_b, the prefill router logits "
    "x.float() @ W_r.T)",
    "elementwise silu/sigmoid/softplus, kda.gate, the beta sigmoid and the q/k l2norm (fused inside "
    "the kernels above)",
    "in a continued prefill, the MLA cache gather (data movement)",
)


def scalar_defaults(record) -> dict:
    """Scalar keyword parameters the op takes without the model passing them, with the defaults the
    optimized op applies (only those the reference takes too: ``chunk_size``, ``scale``); recorded
    so that a replay never depends on the two sides agreeing on a default."""
    arrays = set(record.args) | set(record.kwarg_arrays)
    ref = inspect.signature(record.reference).parameters
    out = {}
    for name, p in inspect.signature(record.optimized_callable()).parameters.items():
        if p.kind is not p.KEYWORD_ONLY or name in arrays or name.startswith("_") or name not in ref:
            continue
        if name == "lower_bound":   # the KDA gate's b: the bounded gate's records carry it, never a default
            continue
        if p.default is not p.empty:
            out[name] = p.default
    return out


def aux(op: str, arrays: dict) -> dict:
    """Arrays a mutant of ``op`` needs that the op does not take, derived from its inputs ``arrays``
    (:data:`AUX`); none for most ops."""
    derive = AUX.get(op)
    return derive(arrays) if derive else {}
