"""Helpers for users' own tests: ``assert_parity`` and registry parametrization (the pytest plugin
exposes them as fixtures)."""
from __future__ import annotations

import numpy as np

from .check import check, prepare
from .registry import Case, get, names


def _to_case(record, inputs, kwargs) -> Case:
    if isinstance(inputs, Case):
        return inputs
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

    ``inputs``: a :class:`parity.registry.Case` or ``{name: array or tensor}`` with the op's
    parameter names (values are rounded to ``dtype``; the reference sees the rounded values);
    ``kwargs``: scalar keyword arguments; ``candidate``: a callable with the op's signature
    (default: the registered optimized op, whose launch counter must move). Returns the Judgement.
    """
    record = get(op)
    case = _to_case(record, inputs, kwargs)
    if candidate is None:
        import optimized

        if optimized.interpreting():
            optimized.install_faithful_bf16_dot()
        fn, counter = record.optimized_callable(), record.counter_name
    else:
        fn, counter = candidate, None
    if rounding is None:
        from .platform import store_rounding

        rounding = store_rounding(dtype, device) if candidate is None else "nearest"
    prep = prepare(record, case, dtype, device, rounding)
    j = check(prep, record.candidate(fn), counter=counter)
    if not j.passed:
        raise AssertionError(f"{op} at {dtype}: not within its bound\n{j.report()}")
    if counter is not None and j.kernel_ran is False:
        raise AssertionError(f"{op}: the optimized kernel did not record a launch ({counter})")
    return j


def op_names() -> list[str]:
    """Every registered op, for ``pytest.mark.parametrize("op", op_names())``."""
    return names()
