"""Real workloads: the inputs each registered op receives while the optimized model runs (a prefill and
a few decode steps), recorded to a file, and replayed by ``parity certify --cases`` as explicit
examples beside hypothesis' draws.

    >>> from parity import capture
    >>> rec = capture.run(model, prompt_ids, steps=2)        # model: optimized.load(..., cuda_graphs=False)
    >>> capture.casefile.write("cases.safetensors", list(rec.cases.values()), run={...})
    >>> cf = capture.casefile.read("cases.safetensors")
    >>> by_op, skipped = capture.replay_cases(cf, ["kda.fused_chunked"])

``sites`` says which model calls are captured as which op, ``recorder`` how, ``tensors`` what is
kept of an input (its bytes, or statistics and a seed above the store limit), ``casefile`` the
file (docs/cli.md, ``parity capture``).
"""
from __future__ import annotations

from collections import Counter

from parity.registry import Case

from . import casefile, recorder, sites, tensors
from .recorder import Recorder, recording
from .tensors import STORE_LIMIT

__all__ = ["run", "replay_cases", "Recorder", "recording", "STORE_LIMIT", "casefile", "sites", "tensors"]


def run(model, prompt_ids: list[int], *, steps: int = 2, store_limit: int = STORE_LIMIT,
        seed: int = 0) -> Recorder:
    """Prefill ``prompt_ids`` on ``model`` (an ``optimized.Model`` loaded with ``cuda_graphs=False``),
    then decode ``steps`` greedy tokens, recording every captured op call (``recorder``); the
    recorder's ``logits`` keeps the last row of each step (the model's own output). ValueError
    when an op receives non-finite values."""
    rec = Recorder(store_limit=store_limit, seed=seed)
    with recording(model, rec):
        logits, cache = model.prefill(prompt_ids)
        rec.logits.append(logits[-1].detach().cpu())
        for k in range(1, steps + 1):
            rec.phase = f"decode {k}"
            logits, cache = model.decode(int(rec.logits[-1].argmax()), cache)
            rec.logits.append(logits.detach().cpu())
    return rec


def replay_cases(cf: casefile.CaseFile, ops: list[str]) -> tuple[dict, Counter]:
    """The file's cases of the ops named in ``ops`` as :class:`parity.registry.Case` (inputs stored
    or regenerated, ``source`` saying which), grouped by op; and how many cases of other ops were
    left out, by op."""
    by_op: dict = {}
    skipped: Counter = Counter()
    for fc in cf.cases:
        if fc.op not in ops:
            skipped[fc.op] += 1
            continue
        arrays = fc.arrays()
        source = {"kind": fc.kind, "file": str(cf.path), "case": fc.id, "sha256": fc.entry["sha256"],
                  "call_site": fc.entry["call_site"], "calls": fc.entry["calls"]}
        by_op.setdefault(fc.op, []).append(Case(arrays, dict(fc.entry["kwargs"]), aux=sites.aux(fc.op, arrays),
                                                label=fc.label(), source=source))
    return by_op, skipped
