"""The record types of the op registry: :class:`OpRecord` (one per op), :class:`Case` (one drawn
input), :class:`Mutant` (a named semantic bug) and :class:`Site` (a call of the model captured as
an op). Records hold callables: the reference op, the optimized op, the emulation.
The records themselves are built by ``parity/ops/`` (``parity.ops.records()``: a plain list, one
package per op family); this module imports nothing of the project, so anything may import it.

A record pairs the float64 reference with the optimized op by name (fused optimized ops with the
reference's own fused forms), and carries the input builder (a hypothesis strategy of
:class:`Case`), the error-bound model, the outputs compared (every output), the named mutants and
the strengths it claims. Calls are normalized: a candidate is called as ``fn(*args, **array kwargs,
**scalar kwargs)`` with the names the record lists, and its result becomes ``{output: tensor}``.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Callable

STRENGTHS = ("bytes", "lifted", "production")

# Input precision policies: how each input is rounded for a run at dtype d.
#   "io"    the run dtype (activations, weights)
#   "fp32"  float32 in bf16/fp16 runs, else the run dtype (states, gate parameters, biases)
#   "int"   integer data, unchanged (ids, cu_seqlens, lengths)
POLICIES = ("io", "fp32", "int")

MIN_MUTANTS = 3

# What certify fills the memory an op's contract leaves unused with (``OpRecord.dirty``): NaN, then
# Inf, then stale finite values (a state or cache row of another sequence).
FILLS = ("nan", "inf", "stale")


class OutputsError(TypeError):
    """A callable returned another number of outputs than its record lists (or not a tuple)."""


# How widely ``parity search`` draws (``OpRecord.wide``): "cheap" (seconds per input under the Triton
# interpreter: the suite), "full" (any shape the op takes, within a cost cap), "buckets" (a few
# shapes, long inputs: on a GPU each new shape compiles)
SEARCH_SPACES = ("cheap", "full", "buckets")


@dataclass(frozen=True)
class Ref:
    """A callable named by ``module`` and ``attr`` (dotted inside the module), imported on its first
    call. Kept for records written outside this repository before records held the optimized op
    itself (importing optimized chooses nothing now); the project's records hold callables.
    Deprecated: hold the function."""

    module: str
    attr: str

    def resolve(self) -> Callable:
        """The function; ImportError / AttributeError name what is missing."""
        fn = importlib.import_module(self.module)
        for part in self.attr.split("."):
            fn = getattr(fn, part)
        return fn

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


def resolve(fn) -> Callable:
    """``fn`` itself, or the function a :class:`Ref` names."""
    return fn.resolve() if isinstance(fn, Ref) else fn


def describe(fn) -> str:
    """``module:qualname`` of a callable (for tables and certificates), the module being the
    shortest package that exports it under its name, as users import it (``optimized.kda:chunked``,
    not the file that defines it, ``optimized.kda.chunk``)."""
    if isinstance(fn, Ref):
        return str(fn)
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__name__", None)
    parts = mod.split(".")
    for i in range(1, len(parts)):
        package = sys.modules.get(".".join(parts[:i]))
        if name is not None and package is not None and getattr(package, name, None) is fn:
            mod = ".".join(parts[:i])
            break
    return f"{mod}:{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


@dataclass
class Case:
    """One drawn input: ``arrays`` float64 (or integer) NumPy arrays by parameter name (positional
    ones and array keyword arguments), ``kwargs`` scalar keyword arguments, ``aux`` arrays the op does
    not take (used by mutants), ``label`` the shape bucket (``"B=2 T=33 K=16 V=32"``), ``source``
    where a replayed case comes from (``parity capture``'s file: kind, file, case id, digest; None
    for a drawn one)."""

    arrays: dict
    kwargs: dict = field(default_factory=dict)
    aux: dict = field(default_factory=dict)
    label: str = ""
    source: dict | None = None


@dataclass(frozen=True)
class Mutant:
    """A named semantic bug. ``kind="wrap"``: ``build(candidate, record)`` returns the candidate with
    its inputs/outputs transformed to emulate the bug (the real kernel runs); ``kind="internal"``:
    the bug is inside the algorithm, so ``build`` returns a mutated float evaluation at the
    candidate's dtype (the family's emulation with ``mutation=``). Candidates here are normalized:
    ``cand(inputs: dict, kwargs: dict) -> {output: tensor}``."""

    name: str
    doc: str
    kind: str
    build: Callable
    aux: bool = False      # the built callable takes the case's aux arrays: ``(inputs, kwargs, aux)``
    dirty: bool = False    # a bug only dirty memory shows (blanking by multiplying by zero)

    def run(self, cand: Callable, record: "OpRecord", inputs: dict, kwargs: dict, aux: dict) -> dict:
        """The mutant built around the normalized ``cand``, called on ``inputs``."""
        fn = self.build(cand, record)
        return fn(inputs, kwargs, aux) if self.aux else fn(inputs, kwargs)


@dataclass(frozen=True)
class Site:
    """``method`` of ``optimized.backends.Ops`` (the one object the model makes its op calls
    through) captured by ``parity capture`` as record ``op`` (None: not captured, ``note`` says why);
    ``convert(args) -> (arrays, kwargs)`` from the method's bound arguments to the record's inputs
    (tensors, None for an absent optional input) and explicit scalar kwargs."""

    method: str
    op: str | None
    convert: Callable | None = None
    note: str = ""


def picked(*names, kw=()) -> Callable:
    """A :attr:`Site.convert` that hands over the arguments ``names`` as the record's inputs and
    ``kw`` as its scalar keyword arguments, as the model passed them."""
    def convert(a):
        return {n: a[n] for n in names}, {k: a[k] for k in kw}
    return convert


@dataclass(frozen=True)
class OpRecord:
    name: str                       # "kda.chunked": family.function
    reference: Callable             # float64 NumPy (reference/ itself, or a parity.ops adapter)
    optimized: Callable             # the optimized op (of optimized/, or a parity.ops adapter)
    emulated: Callable              # torch port (the family's emulate.py): the reference-f32 stand-in
    inputs: Callable                # () -> hypothesis strategy of Case
    bound: Callable                 # error-bound model (the family's bounds.py)
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
    dirty: Callable | None = None   # (case, fill) -> the case with the memory its contract leaves
                                    # unused (a pool's free rows, a cache's tail) holding FILLS[i]
    wide: Callable | None = None    # (space) -> strategy of Case drawn widely (parity search); None: inputs
    gate: str | None = None         # the KDA gate the op computes: "softplus", "lower_bound" (the bounded
                                    # gate, b in the kwargs), None: it takes the gate's output or none

    def __post_init__(self):
        if len(self.mutants) < MIN_MUTANTS:
            raise ValueError(f"op {self.name!r}: at least {MIN_MUTANTS} mutants required, got {len(self.mutants)}")
        names = [m.name for m in self.mutants]
        if len(set(names)) != len(names):
            raise ValueError(f"op {self.name!r}: duplicate mutant names {names}")
        for s in self.strengths:
            if s not in STRENGTHS:
                raise ValueError(f"op {self.name!r}: unknown strength {s!r}")
        if self.dirty is not None and not any(m.dirty for m in self.mutants):
            raise ValueError(f"op {self.name!r}: a record that takes a buffer (dirty=) needs a mutant that "
                             "blanks it by multiplying by zero (Mutant(dirty=True))")
        for name, pol in self.policy.items():
            if pol not in POLICIES:
                raise ValueError(f"op {self.name!r}: input {name!r}: unknown policy {pol!r}")

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def counter_name(self) -> str:
        return self.counter or self.name

    def search_cases(self, space: str = "full"):
        """The strategy ``parity search`` draws from: the record's wide inputs within ``space``
        (``"cheap"``, ``"full"``, ``"buckets"``), or its own input builder where it has none."""
        return self.wide(space) if self.wide is not None else self.inputs()

    def optimized_callable(self) -> Callable:
        """The optimized op (a record written with a :class:`Ref` resolved)."""
        return resolve(self.optimized)

    # -- normalized calls -------------------------------------------------------------------
    def call(self, fn: Callable, inputs: dict, kwargs: dict) -> dict:
        """Call ``fn`` with the record's convention; return ``{output: value}``."""
        args = [inputs[n] for n in self.args]
        kw = {n: inputs[n] for n in self.kwarg_arrays if n in inputs and inputs[n] is not None}
        out = fn(*args, **kw, **kwargs)
        if len(self.outputs) == 1:
            out = (out,)
        if not isinstance(out, (tuple, list)) or len(out) != len(self.outputs):
            got = f"{len(out)} outputs" if isinstance(out, (tuple, list)) else type(out).__name__
            raise OutputsError(f"{self.name}: expected outputs {self.outputs}, got {got}")
        return dict(zip(self.outputs, out))

    def candidate(self, fn: Callable) -> Callable:
        """``fn`` (op signature) as a normalized candidate ``cand(inputs, kwargs) -> dict``."""
        return lambda inputs, kwargs: self.call(fn, inputs, kwargs)
