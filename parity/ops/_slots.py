"""Shared pieces of the in-place decode records over a state pool (kda.fused_recurrent_decode,
conv.short_conv_step_). Each sequence b reads and writes only pool row ``slot_ids[b]``; a negative
slot id is a padding row (output 0, no state touched). The whole pool is an output: rows named by
the batch get the op's bound, every other row a bound of 0, so slot isolation (untouched rows
bit-identical) is part of the check."""
from __future__ import annotations

import numpy as np
import torch

from reference.executor import namespace

from ..mutants import wrap
from ..registry import Case, Mutant
from ._util import fill_values


def slot_ids(r, B, n_slots):
    """``B`` distinct pool rows in random order, the second a padding row (-1) when B >= 3."""
    ids = r.permutation(n_slots)[:B].astype(np.int64)
    if B >= 3:
        ids[1] = -1
    return ids


def per_row(step, out_like, pool, slots):
    """The float64 side, on any array API executor: ``step(b, state) -> (out_b, new state)`` on each
    named row of the pool; padding rows output zeros. ``out_like``: an array of the outputs' shape
    (``[B, ...]``). Returns ``(outputs, new pool)``; the input pool is left as it is."""
    xp = namespace(pool, out_like)
    rows = [pool[i, ...] for i in range(pool.shape[0])]
    outs = [xp.zeros_like(out_like[b, ...]) for b in range(out_like.shape[0])]
    for b in range(slots.shape[0]):
        s = int(slots[b])
        if s >= 0:
            outs[b], rows[s] = step(b, rows[s])
    return xp.stack(outs), xp.stack(rows)


def free_rows(slots, n_slots) -> list:
    """The pool rows no sequence names (their content is unused by the op's contract)."""
    used = {int(i) for i in np.asarray(slots).tolist() if i >= 0}
    return [s for s in range(n_slots) if s not in used]


def dirty(case: Case, fill: str) -> Case:
    """``case`` with the pool's free rows holding ``fill`` (parity.registry.FILLS): the op must
    neither read them into an output nor change them."""
    a = dict(case.arrays)
    pool = np.array(a["state_pool"], dtype=np.float64, copy=True)
    free = free_rows(a["slot_ids"], pool.shape[0])
    pool[free] = fill_values(pool[free].shape, fill)
    a["state_pool"] = pool
    return Case(a, dict(case.kwargs), dict(case.aux), case.label, case.source)


def blanked_by_zero(output: str):
    """The vLLM pull 43961 bug class: a padding row (slot -1) computed on a free pool row and blanked
    by multiplying by zero instead of a masked store; harmless on finite memory, NaN where the free
    row holds NaN or Inf."""
    def outputs(out, inp):
        ids, pool = inp["slot_ids"], inp["state_pool"]
        pad = ids < 0
        free = free_rows(ids.cpu(), pool.shape[0])
        if not bool(pad.any()) or not free:
            return out
        y = out[output]
        junk = pool[free[0]].float().sum()
        shape = (-1,) + (1,) * (y.dim() - 1)
        out[output] = torch.where(pad.to(y.device).reshape(shape), y + (0.0 * junk).to(y.dtype), y)
        return out

    return wrap("padding_blanked_by_zero", "a padding row computed on a free pool row and blanked by "
                "multiplying by zero instead of masking (NaN once the free row holds NaN or Inf)",
                outputs=outputs, dirty=True)


def valid(x):
    """(batch rows with a slot, their slots)."""
    ids = np.asarray(x["slot_ids"]).astype(np.int64)
    rows = np.nonzero(ids >= 0)[0]
    return rows, ids[rows]


def _shift_slots(d):
    n = d["state_pool"].shape[0]
    ids = d["slot_ids"]
    d["slot_ids"] = torch.where(ids >= 0, (ids + 1) % n, ids)
    return d


def _fill_padding(d):
    """The padding row is given a free slot: it computes and writes a state it must not touch. An input
    without a padding row or a free slot (a model's decode step, replayed) cannot show the bug: the
    mutant is then the op itself, and survives that input rather than raising."""
    ids = d["slot_ids"].clone()
    used = set(int(i) for i in ids.tolist() if i >= 0)
    free = [s for s in range(d["state_pool"].shape[0]) if s not in used]
    if not free or bool((ids >= 0).all()):
        return d
    ids[ids < 0] = free[0]
    d["slot_ids"] = ids
    return d


class _NotWrittenBack:
    """The updated states are computed but never stored: the pool comes back as it went in."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            before = inp["state_pool"].clone()
            out = dict(cand(inp, kw))
            out["state_pool"] = before
            return out

        return mutated


MUTANTS = (
    wrap("slot_ids_shifted", "each sequence reads and writes the next pool row", inputs=_shift_slots),
    Mutant("state_not_written_back", "the updated states never reach the pool", "wrap", _NotWrittenBack()),
    wrap("padding_row_computed", "a padding row (slot -1) is computed and written", inputs=_fill_padding),
)
