"""Reverse adapters: a recorded call of an outside function, fitted to a registered op's inputs.

``parity certify --impl`` calls an outside kernel through an adapter with the record's signature
(``parity.peers``); ``parity.watch`` goes the other way. The adapter that fits fla-core's
``chunk_kda`` to ``kda.chunked`` also declares (``parity.certify.candidate.adapter(reverse=)``) how a call
of ``chunk_kda`` made by someone else maps back: which op its flags compute, which argument is which
input, what it returned. A reverse adapter takes the call's arguments bound by name (defaults
applied, ``**kwargs`` spread) and returns a :class:`Mapping`, or raises :class:`Mismatch` naming
the argument that fits no record.

Where a target's adapter comes from (:func:`for_target`): a user's copy of a known function names it
(:func:`same_as`); else the target's ``module:function`` (or that of the function it wraps,
``__wrapped__``) is one an adapter of ``parity.peers`` wraps; else it is one of this repository's
optimized ops (identity: the op's own names).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from parity import ops
from parity.registry import describe

PEER_MODULES = ("parity.peers.fla", "parity.peers.transformers")
# our optimized functions whose record's optimized callable is an adapter in parity.ops, not the function
OURS = {"optimized.kda:fused_recurrent_decode": "kda.fused_recurrent_decode"}


class Mismatch(ValueError):
    """A call no record fits: ``argument`` is the one that did not fit."""

    def __init__(self, argument: str, why: str):
        super().__init__(f"argument {argument}: {why}")
        self.argument = argument


@dataclass(frozen=True)
class Mapping:
    """What one call computes, in a record's terms: ``op`` (a registered op, or a variant of
    ``parity.ops.kda.variants()``), ``inputs`` (the record's input names -> the call's tensors, None
    for an absent optional one), ``kwargs`` (the record's scalar keyword arguments),
    ``outputs(result, arguments) -> {output name: tensor}`` (read after the call: an in-place output
    from its argument; an output the call did not produce is left out and not judged), the
    arithmetic ``contract`` the implementation claims, and a ``note`` saying what was fused."""

    op: str
    inputs: dict
    kwargs: dict = field(default_factory=dict)
    outputs: Callable = None
    contract: str = "ieee"
    note: str = ""


def returned(*names: str) -> Callable:
    """``outputs`` for a call returning ``names`` in order (a single value or a tuple); a None in
    the result (a final state not asked for) leaves that output out."""
    def outputs(result, arguments) -> dict:
        vals = result if isinstance(result, (tuple, list)) else (result,)
        return {n: v for n, v in zip(names, vals) if v is not None}

    return outputs


def flag(arguments: dict, name: str) -> bool:
    v = arguments.get(name, False)
    if not isinstance(v, bool):
        raise Mismatch(name, f"expected True or False, got {type(v).__name__}")
    return v


def require_none(arguments: dict, names, why: str) -> None:
    """Arguments that change what the call computes beyond any record: absent, None or False."""
    for n in names:
        v = arguments.get(n)
        if v is not None and v is not False:
            raise Mismatch(n, f"{v!r} given; {why}")


# -- finding a target's adapter --------------------------------------------------------------------
def same_as(known: str):
    """Mark a user's own copy of a known function (the same signature): ``@same_as("fla.ops.kda:chunk_kda")``
    makes ``parity.watch`` map its calls with that function's adapter."""
    def mark(fn):
        fn.parity_same_as = known
        return fn

    return mark


def _peer_reverses() -> dict:
    out = {}
    for mod in PEER_MODULES:
        m = importlib.import_module(mod)
        for obj in vars(m).values():
            rev, wraps = getattr(obj, "parity_reverse", None), getattr(obj, "parity_wraps", None)
            if callable(rev) and wraps:
                out.setdefault(wraps, rev)
    return out


def _ours(spec: str):
    op = OURS.get(spec)
    if op is None:   # the first record of the function: a gated KDA op's softplus one
        op = next((r.name for r in ops.records() if describe(r.optimized) == spec and spec.startswith("optimized.")), None)
    if op is None:
        return None
    known = set(ops.names())

    def reverse(arguments: dict) -> Mapping:
        # a call with lower_bound is the bounded KDA gate's record of the op
        name = op + "+lower_bound" if arguments.get("lower_bound") is not None and op + "+lower_bound" in known else op
        rec = ops.get(name)
        names = set(rec.args) | set(rec.kwarg_arrays)
        inputs = {n: arguments.get(n) for n in (*rec.args, *rec.kwarg_arrays)}
        scalars = {k: v for k, v in arguments.items() if k not in names and k in _scalar_names(rec)}
        produced = [n for n in rec.outputs if not (rec.in_place and n in names)]

        def outputs(result, args) -> dict:
            out = returned(*produced)(result, args)
            out.update({n: args[n] for n in rec.outputs if n not in produced})
            return out

        return Mapping(name, inputs, scalars, outputs, "ieee", "this repository's op, by its own names")

    return reverse


def _scalar_names(rec) -> set:
    return set(inspect.signature(rec.reference).parameters) - set(rec.args) - set(rec.kwarg_arrays)


def _takes_anything(sig: inspect.Signature) -> bool:
    kinds = {p.kind for p in sig.parameters.values()}
    return kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def call_signature(fn) -> inspect.Signature:
    """The signature a call of ``fn`` binds to, so that its arguments are found by name whether the
    caller passes them by position or by keyword. A callable object whose own signature takes
    anything (``*args, **kwargs``: a torch module, a ``kernels`` function module as transformers
    5.25 puts in place of its KDA functions) binds to its ``forward``'s. TypeError or ValueError
    where there is none."""
    sig = inspect.signature(fn)
    forward = getattr(fn, "forward", None)
    if _takes_anything(sig) and callable(forward):
        return inspect.signature(forward)
    return sig


def name_of(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def for_target(spec: str, fn) -> tuple[Callable, str]:
    """(reverse adapter, the known function's ``module:function`` it is the adapter of) for the
    watched ``fn`` named ``spec``; LookupError, one line, when none fits."""
    table = _peer_reverses()
    candidates = []
    known = getattr(fn, "parity_same_as", None)
    if known:
        if known not in table and _ours(known) is None:
            raise LookupError(f"{spec}: names {known} (same_as), which no adapter knows; known: {', '.join(sorted(table))}")
        candidates = [known]
    else:
        candidates = [spec, name_of(fn)]
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None:
            candidates.append(name_of(inner))
    for c in candidates:
        if c in table:
            return table[c], c
        ours = _ours(c)
        if ours is not None:
            return ours, c
    raise LookupError(f"{spec}: no adapter maps this function's calls to an op (known: {', '.join(sorted(table))}, "
                      "this repository's optimized ops; a copy of one of them: parity.watch.same_as)")
