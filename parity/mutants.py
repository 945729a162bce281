"""Mutation teeth: named semantic bugs, and the controls every check must reject. Each op family's
mutants are its ``mutants`` module (``parity/ops/<family>/mutants.py``); this module makes them.

Two kinds of mutant (:class:`parity.registry.Mutant`; ``wrap`` and ``internal`` make them):

- ``wrap``: the real candidate runs, with its inputs, keyword arguments or outputs transformed so
  that the result is exactly what the bug would compute (``A_log + 1`` feeds ``A_log + 1``; "state
  stored transposed" reinterprets the returned ``[K, V]`` state's memory as ``[V, K]`` then reads it
  back as ``[K, V]``, which only a K != V shape or a non-symmetric state can reveal).
- ``internal``: the bug lives inside the algorithm (a chunk boundary off by one, a skipped l2norm
  in a fused kernel), so the mutant is a mutated float evaluation at the candidate's dtype
  (the family's ``emulate`` with ``mutation=``): it proves the check would see that bug, not that the
  kernel has it.

A mutant is killed when the check fails on at least one drawn input; its teeth ratio is the worst
error in bound units it produced (inf for a shape, NaN-pattern or degenerate failure). Every op
also rejects two controls, an all-zeros and an all-NaN candidate.
"""
from __future__ import annotations

from functools import partial

import torch

from .emulate import torch_dtype
from .registry import Mutant


def wrap(name: str, doc: str, *, inputs=None, kwargs=None, outputs=None, aux: bool = False,
         dirty: bool = False) -> Mutant:
    """A mutant around the real candidate: ``inputs(d) -> d`` (tensors by name; ``aux=True``:
    ``inputs(d, aux) -> d`` with the case's aux arrays, which the op does not take), ``kwargs(kw) ->
    kw``, ``outputs(out, inputs) -> out``. ``dirty``: the bug shows only on dirty memory
    (``OpRecord.dirty``)."""

    def build(cand, record):
        def mutated(inp, kw, extra=None):
            original = dict(inp)
            if inputs is not None:
                inp = inputs(dict(inp), extra) if aux else inputs(dict(inp))
            if kwargs is not None:
                kw = kwargs(dict(kw))
            out = cand(inp, kw)
            if outputs is not None:
                out = outputs(dict(out), original)
            return out

        return mutated

    return Mutant(name, doc, "wrap", build, aux=aux, dirty=dirty)


def internal(name: str, doc: str, fn, mutation: str | None = None) -> Mutant:
    """A mutant evaluated by ``fn`` (a family's emulation, ``parity/ops/<family>/emulate.py``) with
    ``mutation=`` (default: name)."""

    def build(cand, record):
        return record.candidate(partial(fn, mutation=mutation or name))

    return Mutant(name, doc, "internal", build)


def zeros_candidate(record, prepared):
    """A control: every float output all zeros (integer outputs zeros too)."""
    def cand(inp, kw):
        out = {}
        for n in record.outputs:
            r = prepared.ref[n]
            dt = torch.int64 if r.dtype.kind in "iu" else torch_dtype(prepared.dtype)
            out[n] = torch.zeros(r.shape, dtype=dt)
        return out

    return cand


def nan_candidate(record, prepared):
    """A control: every float output all NaN (integer outputs copied from the reference, so only the
    NaNs can fail it)."""
    def cand(inp, kw):
        out = {}
        for n in record.outputs:
            r = prepared.ref[n]
            if r.dtype.kind in "iu":
                out[n] = torch.from_numpy(r.copy())
            else:
                out[n] = torch.full(r.shape, float("nan"), dtype=torch_dtype(prepared.dtype))
        return out

    return cand


CONTROLS = {"zeros": zeros_candidate, "nan": nan_candidate}
