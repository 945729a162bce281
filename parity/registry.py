"""The op registry: one :class:`OpRecord` per op, read by the tests, the certify CLI, the pytest
plugin and the docs tables. Adding an op is adding one record (``parity/ops/<family>.py``).

A record pairs the float64 reference with the optimized callable by name (fused optimized ops with
the composition of reference ops), and carries the input builder (a hypothesis strategy of
:class:`Case`), the error-bound model, the outputs compared (every output), the named mutants and
the strengths it claims. Calls are normalized: a candidate is called as ``fn(*args, **array kwargs,
**scalar kwargs)`` with the names the record lists, and its result becomes ``{output: tensor}``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

STRENGTHS = ("bytes", "lifted", "production")

# Input precision policies: how each input is rounded for a run at dtype d.
#   "io"    the run dtype (activations, weights)
#   "fp32"  float32 in bf16/fp16 runs, else the run dtype (states, gate parameters, biases)
#   "int"   integer data, unchanged (ids, cu_seqlens, lengths)
POLICIES = ("io", "fp32", "int")


@dataclass
class Case:
    """One drawn input: ``arrays`` float64 (or integer) NumPy arrays by parameter name (positional
    ones and array keyword arguments), ``kwargs`` scalar keyword arguments, ``aux`` arrays the op does
    not take (used by mutants), ``label`` the shape bucket (``"B=2 T=33 K=16 V=32"``)."""

    arrays: dict
    kwargs: dict = field(default_factory=dict)
    aux: dict = field(default_factory=dict)
    label: str = ""


@dataclass(frozen=True)
class Mutant:
    """A named semantic bug. ``kind="wrap"``: ``build(candidate)`` returns the candidate with its
    inputs/outputs transformed to emulate the bug (the real kernel runs); ``kind="internal"``: the
    bug is inside the algorithm, so ``build`` returns a mutated float evaluation at the candidate's
    dtype (parity.emulate with ``mutation=``). Candidates here are normalized:
    ``cand(inputs: dict, kwargs: dict) -> {output: tensor}``."""

    name: str
    doc: str
    kind: str
    build: Callable


@dataclass(frozen=True)
class OpRecord:
    name: str                       # "kda.chunked": family.function
    reference: Callable             # float64 NumPy (or the composition of reference ops)
    optimized: str                  # "optimized.kda:chunked", imported on first use
    emulated: Callable              # torch port (parity.emulate): the reference-f32 stand-in
    inputs: Callable                # () -> hypothesis strategy of Case
    bound: Callable                 # parity.bounds model
    outputs: tuple                  # names of the outputs, in return order
    args: tuple                     # positional array parameters, in order
    kwarg_arrays: tuple = ()        # array keyword parameters (initial_state, cu_seqlens)
    policy: dict = field(default_factory=dict)     # input -> POLICIES (default "io")
    exact: tuple = ()               # outputs compared bit for bit (copies, ids)
    mutants: tuple = ()
    strengths: tuple = STRENGTHS
    batch: dict | None = None       # {"inputs": {name: axis}, "outputs": {name: axis}} rows independent
    bound_doc: str = ""             # one line for the docs table
    reductions: str = ""            # reduction lengths the bound uses
    counter: str | None = None      # name in optimized._counters (default: name)
    in_place: bool = False          # the candidate may write its inputs: call it on fresh copies

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def counter_name(self) -> str:
        return self.counter or self.name

    def optimized_callable(self) -> Callable:
        """Import the optimized op (``module:attr``); ImportError/AttributeError name it."""
        mod, _, attr = self.optimized.partition(":")
        module = importlib.import_module(mod)
        fn = module
        for part in attr.split("."):
            fn = getattr(fn, part)
        return fn

    def optimized_available(self) -> bool:
        try:
            self.optimized_callable()
            return True
        except (ImportError, AttributeError):
            return False

    # -- normalized calls -------------------------------------------------------------------
    def call(self, fn: Callable, inputs: dict, kwargs: dict) -> dict:
        """Call ``fn`` with the record's convention; return ``{output: value}``."""
        args = [inputs[n] for n in self.args]
        kw = {n: inputs[n] for n in self.kwarg_arrays if n in inputs and inputs[n] is not None}
        out = fn(*args, **kw, **kwargs)
        if len(self.outputs) == 1:
            out = (out,)
        if not isinstance(out, (tuple, list)) or len(out) != len(self.outputs):
            raise TypeError(f"{self.name}: expected outputs {self.outputs}, got {type(out).__name__}")
        return dict(zip(self.outputs, out))

    def candidate(self, fn: Callable) -> Callable:
        """``fn`` (op signature) as a normalized candidate ``cand(inputs, kwargs) -> dict``."""
        return lambda inputs, kwargs: self.call(fn, inputs, kwargs)

    def run_reference(self, inputs: dict, kwargs: dict) -> dict:
        out = self.call(self.reference, inputs, kwargs)
        return {k: np.asarray(v) for k, v in out.items()}


_REGISTRY: dict[str, OpRecord] = {}
_LOADED = False


def register(record: OpRecord) -> OpRecord:
    if record.name in _REGISTRY:
        raise ValueError(f"op {record.name!r} registered twice")
    if len(record.mutants) < 3:
        raise ValueError(f"op {record.name!r}: at least 3 mutants required, got {len(record.mutants)}")
    names = [m.name for m in record.mutants]
    if len(set(names)) != len(names):
        raise ValueError(f"op {record.name!r}: duplicate mutant names {names}")
    for s in record.strengths:
        if s not in STRENGTHS:
            raise ValueError(f"op {record.name!r}: unknown strength {s!r}")
    _REGISTRY[record.name] = record
    return record


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from . import ops  # noqa: F401  (registers every family)


def names() -> list[str]:
    _load()
    return list(_REGISTRY)


def get(name: str) -> OpRecord:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered: {', '.join(_REGISTRY)}") from None


def records() -> list[OpRecord]:
    _load()
    return list(_REGISTRY.values())


def select(patterns) -> list[OpRecord]:
    """Records named by ``patterns``: full names (``kda.chunked``) or families (``kda``). Raises
    KeyError naming an unknown one."""
    _load()
    if not patterns:
        return records()
    out: list[OpRecord] = []
    for p in patterns:
        hits = [r for r in _REGISTRY.values() if r.name == p or r.family == p]
        if not hits:
            raise KeyError(f"unknown op or family {p!r}; registered: {', '.join(_REGISTRY)}")
        out += [h for h in hits if h not in out]
    return out


