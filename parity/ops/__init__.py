"""The op records: one package per op family, each with a ``records()`` function; :func:`records`
returns them all, in family order, as a plain list (nothing registers itself on import).

A family's package holds everything of that family on the parity side, under the same module names
in every family: the records (``__init__``), ``inputs`` (its input builders), ``bounds`` (its
error-bound models), ``emulate`` (its float32 stand-in), ``mutants`` (its named bugs) and ``sites``
(the model's calls of it captured by ``parity capture``; not in ``elementwise``, whose ops the model
runs fused inside others); KDA adds ``args`` (argument names, the sequences of a batch) and
``stages`` (a bracket of its chunk kernels' intermediates). What the families share stays outside:
``parity.bounds.core``, ``parity.emulate``, ``parity.mutants``, ``parity.strategies``, and here
``_slots`` (the in-place decode over a state pool) and ``_util``.

    >>> from parity import ops
    >>> ops.get("kda.chunked").bound_doc
    >>> [r.name for r in ops.select(["conv"])]
"""
from __future__ import annotations

from ..registry import OpRecord
from . import conv, elementwise, embed, kda, mla, moe, norm

FAMILIES = (elementwise, norm, conv, kda, mla, moe, embed)


def records() -> list[OpRecord]:
    """Every op's record, family by family. ValueError if two records share a name."""
    out = [r for family in FAMILIES for r in family.records()]
    seen = set()
    for r in out:
        if r.name in seen:
            raise ValueError(f"op {r.name!r} has two records")
        seen.add(r.name)
    return out


def names() -> list[str]:
    return [r.name for r in records()]


def get(name: str) -> OpRecord:
    """The record of ``name``; KeyError naming the known ops."""
    table = {r.name: r for r in records()}
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered: {', '.join(table)}") from None


def select(patterns) -> list[OpRecord]:
    """Records named by ``patterns``: full names (``kda.chunked``) or families (``kda``); every
    record when ``patterns`` is empty. KeyError naming an unknown one."""
    every = records()
    if not patterns:
        return every
    out: list[OpRecord] = []
    for p in patterns:
        hits = [r for r in every if r.name == p or r.family == p]
        if not hits:
            raise KeyError(f"unknown op or family {p!r}; registered: {', '.join(r.name for r in every)}")
        out += [h for h in hits if h.name not in {o.name for o in out}]
    return out


def cases(op: str):
    """The input builder of ``op`` (a hypothesis strategy of :class:`parity.registry.Case`), for
    users' own properties: ``@given(parity.ops.cases("kda.chunked"))``."""
    return get(op).inputs()
