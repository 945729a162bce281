"""Helpers for users' own tests (and the kernel tests): ``assert_parity`` judges one op on given
inputs through its record; the pytest plugin exposes it as a fixture."""
from __future__ import annotations

import numpy as np

from . import ops
from .candidate import named
from .check import check, prepare
from .registry import Case


def _to_case(record, inputs, kwargs) -> Case:
    if isinstance(inputs, Case):
        return Case(inputs.arrays, {**inputs.kwargs, **dict(kwargs or {})}, inputs.aux, inputs.label)
    arrays = {}
    for k, v in dict(inputs).items():
        if v is None:
            arrays[k] = None
        elif hasattr(v, "detach"):
            t = v.detach().cpu()
            arrays[k] = t.numpy() if not t.is_floating_point() else t.double().numpy()
        else:
            arrays[k] = np.asarray(v)
    missing = [n for n in record.args if n not in arrays]
    if missing:
        raise KeyError(f"assert_parity({record.name!r}): missing inputs {missing}; expected {record.args}")
    return Case(arrays, dict(kwargs or {}), label="user inputs")


def assert_parity(op: str, inputs, *, kwargs=None, dtype: str = "float32", device: str | None = None,
                  candidate=None, rounding: str | None = None):
    """Check one registered op on the given inputs and raise AssertionError (naming the worst
    elements, their values and bounds) if any output is past its bound.

    ``inputs``: a :class:`parity.registry.Case` (from the record's case builders) or ``{name: array
    or tensor}`` with the op's parameter names (values are rounded to ``dtype`` by the record's
    policy; the reference sees the rounded values); ``kwargs``: scalar keyword arguments (added to a
    Case's own); ``candidate``: a callable with the op's signature or a
    :class:`parity.candidate.Candidate` (default: the registered optimized op, whose launch counter
    must move); ``rounding``: the candidate's store rounding (default: measured for Triton
    candidates, else nearest). Returns the Judgement.
    """
    record = ops.get(op)
    case = _to_case(record, inputs, kwargs)
    cand = named(record, "optimized" if candidate is None else candidate)
    device = cand.device(device)
    prep = prepare(record, case, dtype, device, rounding or cand.rounding(dtype, device))
    j = check(prep, cand.normalized(record), counter=cand.counter)
    if not j.passed:
        raise AssertionError(f"{op} at {dtype} ({case.label}): not within its bound\n{j.report()}")
    if cand.counter is not None and j.kernel_ran is False:
        raise AssertionError(f"{op}: the optimized kernel did not record a launch ({cand.counter})")
    return j


def op_names() -> list[str]:
    """Every registered op, for ``pytest.mark.parametrize("op", op_names())``."""
    return ops.names()
