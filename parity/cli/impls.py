"""What ``parity certify`` and ``parity search`` both take from their arguments: the dtypes, the
device (the kernels' backend chosen for it) and the ``--impl`` implementations, each
loaded and its contract checked before any work starts, as one ``parity.certify.job.Impl`` each."""
from __future__ import annotations

import torch

import optimized
from parity import ops
from parity.certify import candidate
from parity.certify.job import Impl
from parity.errors import CandidateError, InputError
from parity.peers import SHORTHANDS, implementations, missing

DTYPES = ("bfloat16", "float32", "float64")


def select_runs(op_names, dtype_names) -> tuple[list, tuple]:
    """``(records, dtypes)`` of ``--ops`` and ``--dtype`` (default float32 then bfloat16, repeats
    dropped); an unknown op is an ``InputError`` naming it."""
    try:
        records = ops.select(op_names)
    except KeyError as exc:
        raise InputError(str(exc.args[0])) from None
    return records, tuple(dict.fromkeys(dtype_names or ("float32", "bfloat16")))


def setup_device(device):
    """Choose the kernels' backend for ``device`` (``optimized.use``: on CPU the Triton interpreter,
    made faithful for bf16 dots)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)")
    return optimized.use(device)


def parse_impls(values) -> tuple[dict, list]:
    """``--impl`` values: (op -> spec, shorthands), checked before any work."""
    named, shorthands = {}, []
    for value in values:
        op, eq, spec = value.partition("=")
        if not eq:
            if value not in SHORTHANDS:
                raise InputError(f"--impl {value}: expected OP=module:function, OP=path/to/file.py:function "
                                 f"or one of {', '.join(SHORTHANDS)}")
            shorthands.append(value)
            continue
        try:
            ops.get(op)
        except KeyError:
            raise InputError(f"--impl {value}: unknown op {op!r}") from None
        if op in named:
            raise InputError(f"--impl {value}: {op} has an implementation already ({named[op]})")
        named[op] = spec
    return named, shorthands


def select_impls(values, records, *, ops_given: bool, device: str, contract: str | None,
                 gate_given: bool = False) -> tuple[list, tuple[Impl, ...]]:
    """(records to run, their ``Impl``s in the records' order) for the ``--impl`` ``values``: each
    loaded and its contract checked (CandidateError -> one line, exit 2; certify probes them before
    any work). Without ``--ops`` (``ops_given``) the ops given an implementation run; with it, a
    named op outside it is an error and a shorthand covers the selected ops it has adapters for. An
    adapter that declares the one KDA gate it computes covers, unless the ops or the gate were
    chosen (``--ops``, ``--variant kda_gate``; ``gate_given``), only the ops of that gate: asked, it
    is certified as the other's too, and fails naming its gate."""
    named, shorthands = parse_impls(values)
    selected = {r.name for r in records}
    if ops_given:
        for op in named:
            if op not in selected:
                raise InputError(f"--impl {op}={named[op]}: {op} is not among --ops")
    found = {}   # op -> (what was written, the callable)
    chosen = ops_given or gate_given
    for name in shorthands:
        why = missing(name)
        if why is not None:
            raise InputError(why)
        for op, fn in implementations(name, device).items():
            if op not in selected or op in named:
                continue
            if not chosen and candidate.gate_mismatch(ops.get(op), fn):
                continue   # not the gate it computes, and nobody asked
            found[op] = (name, fn)
    try:
        for op, spec in named.items():
            found[op] = (spec, candidate.load(spec))
        if named or shorthands:
            if not ops_given:
                records = [r for r in records if r.name in found]
            if not found:
                raise InputError(f"--impl {', '.join(shorthands)}: no implementation of the selected ops on {device}")
        impls = tuple(Impl(r.name, found[r.name][0],   # probed by certify, where the candidates run
                           candidate.of(found[r.name][1], contract=contract, spec=named.get(r.name)))
                      for r in records if r.name in found)
    except CandidateError as exc:
        raise InputError(f"--impl: {exc}") from None
    return records, impls
