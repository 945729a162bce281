"""What is judged against an op's record: a :class:`Candidate`, any callable with the record's
signature. The registered optimized op is one candidate (``optimized``), the float32 stand-in
another (``reference-f32``); :func:`of` makes one of any other callable (an adapter fitting an
outside kernel to the record's signature), :func:`load` finds one named ``module:function`` or
``path/to/file.py:function`` (``parity certify --impl``).

A candidate says how it is called (normalized: ``cand(inputs, kwargs) -> {output: tensor}``),
which launch counter must move on every call (the repository's kernels only), the arithmetic
contract it claims (parity.bounds.core.CONTRACTS), and where it runs by default. Every platform
rounds to nearest (the Triton interpreter once it is made faithful: optimized/_interpreter.py). An outside candidate has no launch counter: its calls and outputs are witnessed instead
(:class:`Witnessed`: called on every input, its outputs fresh tensors, finite or non-finite exactly
where the reference is). An adapter declares its contract and what it wraps with :func:`adapter`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch
from hypothesis import HealthCheck, Phase, given, settings

from ..bounds.core import UNIT_ROUNDOFF, contract_named, dtype_name
from ..environment import git_revision
from ..errors import CandidateError, Unsupported  # noqa: F401  (part of this module's interface)
from ..loading import attribute, import_module_or_file, split_spec
from ..platform import default_device
from ..registry import OpRecord, describe
from .check import CANDIDATE, Call, InProcess, Job, prepare

NAMES = ("optimized", "reference-f32")
# the KDA gates an op's record computes (OpRecord.gate) and an adapter may declare (adapter(gate=))
GATES = {"softplus": "the softplus gate -exp(A_log) softplus(g_raw + dt_bias) (Kimi-Linear-48B)",
         "lower_bound": "the bounded gate b sigmoid(exp(A_log) (g_raw + dt_bias)) (Kimi-K3, GLM-5.3)"}


def gate_mismatch(record: OpRecord, fn) -> str | None:
    """Why ``fn`` cannot be certified as ``record``: it declares (``adapter(gate=)``) a KDA gate other
    than the one the record computes; None when it does not."""
    have, want = getattr(fn, "parity_gate", None), record.gate
    if have is None or want is None or have == want:
        return None
    return f"{describe(fn)} computes only {GATES[have]}; {record.name} is {GATES[want]}"


@dataclass(frozen=True)
class Candidate:
    name: str                      # "optimized", "reference-f32", or the callable's module:qualname
    fn: Callable                   # the op's signature
    counter: str | None = None     # optimized._counters name that must move on every call
    rowwise: bool = False          # evaluated one batch row at a time (see :func:`rowwise`)
    triton: bool = False           # runs this repository's Triton kernels (the interpreter on CPU)
    home: str | None = None        # default device (None: cuda if available, else cpu)
    contract: str = "ieee"         # the arithmetic it claims (parity.bounds.core.CONTRACTS)
    outside: bool = False          # from outside the repository: calls and outputs witnessed
    spec: str | None = None        # the module:function it was loaded from (a worker reloads it)

    def normalized(self, record: OpRecord) -> Callable:
        if self.outside:
            return Witnessed(record, self.fn)
        cand = record.candidate(self.fn)
        return rowwise(record, cand) if self.rowwise else cand

    def device(self, device: str | None = None) -> str:
        return device or self.home or default_device(None)

    @property
    def label(self) -> str:
        """What tables print: ``optimized``, ``reference-f32``, or the implementation, named as
        ``package:function`` for an adapter's wrapped callable (``fla:chunk_kda``) or the
        callable's ``module:function``."""
        if not self.outside:
            return self.name
        wraps = getattr(self.fn, "parity_wraps", None)
        if wraps:
            module, _, attr = wraps.rpartition(":")
            return f"{module.split('.')[0]}:{attr}"
        return self.name

    def implementation(self) -> dict | None:
        """Who an outside candidate is (:func:`identify`); None for the repository's own."""
        return identify(self.fn) if self.outside else None


class Witnessed:
    """A normalized outside candidate that counts the calls of the user's callable (``calls``):
    ``parity.certify.check.run_call`` records whether it was called and whether its outputs alias memory it
    was handed, ``parity.certify.check.witness`` holds it to both and to honest outputs."""

    def __init__(self, record: OpRecord, fn: Callable):
        self.calls = 0
        self._fn = fn
        self._cand = record.candidate(self._spy)

    def _spy(self, *args, **kwargs):
        self.calls += 1
        return self._fn(*args, **kwargs)

    def __call__(self, inputs: dict, kwargs: dict) -> dict:
        return self._cand(inputs, kwargs)


def optimized(record: OpRecord) -> Candidate:
    """The record's optimized op (its kernels run where ``optimized.use`` chose)."""
    return Candidate("optimized", record.optimized_callable(), counter=record.counter_name, triton=True)


def standin(record: OpRecord) -> Candidate:
    """The float32 stand-in (parity.emulate), on the CPU, row by row."""
    return Candidate("reference-f32", record.emulated, rowwise=True, home="cpu")


def of(fn: Callable, *, name: str | None = None, triton: bool = False, contract: str | None = None,
       spec: str | None = None) -> Candidate:
    """Any callable with the record's signature: no launch counter. ``triton=True``: one of this
    repository's Triton kernels called another way (a kernel test); without it an outside candidate
    (witnessed). ``contract``: the arithmetic it claims (default: what it declares with
    :func:`adapter`, else ``ieee``). ``spec``: the ``module:function`` it was loaded from."""
    contract = contract or getattr(fn, "parity_contract", None) or "ieee"
    try:
        contract_named(contract)
    except ValueError as exc:
        raise CandidateError(f"{describe(fn)}: {exc}") from None
    return Candidate(name or describe(fn), fn, triton=triton, contract=contract, outside=not triton, spec=spec)


def named(record: OpRecord, candidate, contract: str | None = None) -> Candidate:
    """``candidate`` as a :class:`Candidate`: itself, ``"optimized"``, ``"reference-f32"``, or a
    callable (:func:`of`); ``contract`` (given) replaces the one it claims."""
    if isinstance(candidate, Candidate):
        cand = candidate
    elif candidate == "optimized":
        cand = optimized(record)
    elif candidate == "reference-f32":
        cand = standin(record)
    elif callable(candidate):
        return of(candidate, contract=contract)
    else:
        raise ValueError(f"candidate: expected one of {NAMES}, a Candidate or a callable, got {candidate!r}")
    if contract is not None and contract != cand.contract:
        cand = replace(cand, contract=contract_named(contract).name)
    return cand


# -- outside implementations: declaring, loading, identifying, probing -------------------------------
def adapter(*, contract: str = "ieee", wraps: str | None = None, reverse: Callable | None = None,
            gate: str | None = None):
    """Decorate an adapter (a function with a record's signature that calls an outside API) with
    the arithmetic contract its implementation claims (``parity_contract``) and the outside
    callable it wraps, as ``"module:attr"`` (``parity_wraps``; the certificate names that one, with
    its package and version, and the adapter beside it). Nothing is imported until asked.

    ``gate`` (``parity_gate``): the only KDA gate the wrapped kernel computes, ``"softplus"`` or
    ``"lower_bound"`` (the bounded gate; FlashKDA's), None when it computes the one it is asked for.
    Certifying it as an op of the other gate fails, the certificate naming the gate it computes.

    ``reverse`` (``parity_reverse``) is the other direction, for ``parity.watch``: a call of the
    wrapped callable, its arguments bound by name, fitted to a record's inputs
    (``reverse(arguments) -> parity.record.watch.adapters.Mapping``, raising
    ``parity.record.watch.adapters.Mismatch`` naming the argument that fits no record)."""
    if gate not in (None, *GATES):
        raise ValueError(f"gate: expected one of {', '.join(GATES)} or None, got {gate!r}")

    def mark(fn):
        fn.parity_contract = contract
        fn.parity_wraps = wraps
        fn.parity_reverse = reverse
        fn.parity_gate = gate
        return fn

    return mark


def load(spec: str) -> Callable:
    """The callable named ``module:function`` or ``path/to/file.py:function`` (a dotted function
    for a class attribute); CandidateError, one line, for anything that does not resolve."""
    parts = split_spec(spec)
    if parts is None:
        raise CandidateError(f"{spec!r}: expected module:function or path/to/file.py:function")
    module, attr = parts
    try:
        mod = import_module_or_file(module)
    except FileNotFoundError:
        raise CandidateError(f"{spec}: no such file {module}") from None
    except Exception as exc:  # the user's module failed to import, whatever the reason
        raise CandidateError(f"{spec}: cannot import {module}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())}") from None
    try:
        fn = attribute(mod, attr)
    except AttributeError:
        raise CandidateError(f"{spec}: {module} has no attribute {attr!r}") from None
    if not callable(fn):
        raise CandidateError(f"{spec}: {attr} is not callable")
    return fn


@functools.lru_cache(maxsize=None)
def _distributions() -> dict:
    return importlib.metadata.packages_distributions()


def _identity(obj) -> dict:
    module = getattr(obj, "__module__", None) or "?"
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj))
    except (TypeError, ValueError):
        path = None
    dists = _distributions().get(module.split(".")[0], [])
    package = dists[0] if dists else None
    try:
        version = importlib.metadata.version(package) if package else None
    except importlib.metadata.PackageNotFoundError:
        version = None
    git = git_revision(os.path.dirname(path), path) if path else {"revision": None, "dirty": None}
    return {"module": module, "function": getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj))),
            "file": path, "package": package, "version": version, "git": git}


def identify(fn: Callable) -> dict:
    """Who ``fn`` is: ``module``, ``function``, ``file``, ``package`` and ``version`` (the installed
    distribution of its top-level module, importlib.metadata), ``git`` (``revision``, ``dirty``:
    the work tree holding its file, both None outside one). For an :func:`adapter` the wrapped
    callable is named and the adapter goes under ``adapter``."""
    me = _identity(fn)
    wraps = getattr(fn, "parity_wraps", None)
    gate = getattr(fn, "parity_gate", None)
    if not wraps:
        return dict(me, adapter=None, **({"gate": gate} if gate else {}))
    module, attr = split_spec(wraps)
    try:
        # named as it is found: a callable object (transformers 5.25's kernel function modules) has no name
        inner = dict(_identity(attribute(importlib.import_module(module), attr)), function=attr)
    except Exception as exc:  # named, not imported: the certificate says what it could not find
        inner = {"module": module, "function": attr, "file": None, "package": None, "version": None,
                 "git": {"revision": None, "dirty": None}, "error": f"{type(exc).__name__}: {exc}"}
    return dict(inner, adapter=me, **({"gate": gate} if gate else {}))


PROJECT_MODULES = ("optimized", "kimi", "reference", "parity")  # code of this project: trusted in-process


def in_project(cand: Candidate) -> bool:
    """Whether ``cand`` is this project's code, which ``parity certify`` runs in its own process
    on the CPU by default: the repository's own candidates, a callable of ``optimized``,
    ``reference`` or ``parity`` (the registered peer adapters, ``parity.peers``, included: on the
    CPU they call fla-core's own torch recurrences, no native code of their own, and CI certifies
    them). Anything else (a ``module:function`` of yours, any ``file.py:function``, the tests'
    planted candidates) may end its process (``os._exit``, a segfault in a C extension): a worker
    process runs it, so the crash fails only its inputs (docs/certificates.md)."""
    if not cand.outside:
        return True
    if cand.spec is not None:
        module = cand.spec.rpartition(":")[0]
        if module.endswith(".py") or "/" in module:
            return False
    else:
        module = getattr(cand.fn, "__module__", None) or ""
    return module.split(".")[0] in PROJECT_MODULES


def first_case(record: OpRecord):
    """The first input hypothesis draws from the record's builder (derandomized: the same every
    time), for probing a candidate before a run."""
    found = []

    @settings(max_examples=1, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(record.inputs())
    def draw(case):
        found.append(case)

    draw()
    return found[0]


def check_signature(record: OpRecord, fn: Callable, kwargs=()) -> None:
    """``fn`` takes the record's call: its positional arrays, its array keyword arguments and the
    scalar keyword arguments ``kwargs``; CandidateError naming the signature otherwise."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will tell
    want = ", ".join(record.args) + "".join(f", {k}=" for k in (*record.kwarg_arrays, *kwargs))
    try:
        sig.bind(*record.args, **{k: None for k in (*record.kwarg_arrays, *kwargs)})
    except TypeError as exc:
        raise CandidateError(f"{describe(fn)}{sig}: not the signature of {record.name} ({want}): {exc}") from None


def _dtype_ok(got: torch.dtype, ref_kind: str, run_dtype: str) -> bool:
    """An integer output is an integer tensor; a float output has the run dtype, or is float32 or
    float64 and at least as precise (the states of a bf16 run come back in float32)."""
    if ref_kind in "iub":
        return not (got.is_floating_point or got.is_complex)
    if got == getattr(torch, run_dtype):
        return True
    return got in (torch.float32, torch.float64) and UNIT_ROUNDOFF[dtype_name(got)] <= UNIT_ROUNDOFF[run_dtype]


def probe(record: OpRecord, cand: Candidate, dtype: str, device: str, runner=None) -> None:
    """Call an outside candidate once, on the record's first input at ``dtype`` on ``device`` (through
    ``runner``: parity.certify.check.InProcess (the default) or a parity.certify.pool.Worker), and check what a certification
    cannot judge: its signature, and that it returns the record's outputs as tensors of the
    reference's shapes, each float output of the run dtype or a wider float (float32/float64), each
    integer output an integer tensor. CandidateError, one line. An input the implementation
    refuses, an exception or a fault inside it is left to the run."""
    case = first_case(record)
    check_signature(record, cand.fn, tuple(case.kwargs))
    runner = runner or InProcess(device)
    prep = prepare(record, case, dtype, runner.prep_device, contract=cand.contract)
    res = runner.run(record, cand, Job(record.name, prep.tensors, dict(case.kwargs), prep.aux, [Call(CANDIDATE)]))[0]
    if res.outputs_error:
        raise CandidateError(f"{cand.name}: {res.error.partition(': ')[2]}")
    if res.outputs is None:
        return
    out = res.outputs
    for name in record.outputs:
        t, ref = out[name], prep.ref[name]
        if not isinstance(t, torch.Tensor):
            raise CandidateError(f"{cand.name}: output {name} is a {type(t).__name__}, not a torch tensor")
        if tuple(t.shape) != tuple(ref.shape):
            raise CandidateError(f"{cand.name}: output {name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(ref.shape)} ({record.name}, {case.label})")
        if not _dtype_ok(t.dtype, ref.dtype.kind, prep.dtype):
            want = "an integer dtype" if ref.dtype.kind in "iub" else f"{prep.dtype} or a wider float"
            raise CandidateError(f"{cand.name}: output {name} is {str(t.dtype).replace('torch.', '')}, "
                                 f"expected {want} ({record.name} at {prep.dtype})")


def rowwise(record: OpRecord, cand):
    """``cand`` evaluated one batch row at a time (rows concatenated), so that its outputs do not
    depend on the batch composition: torch's CPU matmuls and reductions pick their blocking from the
    shapes, which no kernel contract forbids, but the bytes strength asks the stand-in for it."""
    spec = record.batch
    if not spec:
        return cand

    def run(inp, kw):
        if inp.get("cu_seqlens") is not None:
            return cand(inp, kw)
        axes = {k: a for k, a in spec["inputs"].items() if inp.get(k) is not None}
        n = inp[next(iter(axes))].shape[next(iter(axes.values()))]
        parts = []
        for i in range(n):
            sub = dict(inp)
            for k, a in axes.items():
                sub[k] = inp[k].narrow(a, i, 1)
            parts.append(cand(sub, kw))
        # outputs without a batch axis (an in-place pool shared by the rows) come from the last call
        return {o: torch.cat([p[o] for p in parts], dim=spec["outputs"][o]) if o in spec["outputs"]
                else parts[-1][o] for o in record.outputs}

    return run
