"""Helpers for users' own tests (and the kernel tests): ``assert_parity`` judges one op on given
inputs through its record, ``assert_certified`` certifies an implementation of an op on drawn inputs
(bounds, mutants, controls, bytes: what ``parity certify --impl`` does); the pytest plugin exposes
both as fixtures."""
from __future__ import annotations

import numpy as np

from . import ops
from .certify import certify_op, cpu_threads
from .certify.candidate import named
from .certify.check import check, prepare
from .platform import default_device
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
                  candidate=None, contract: str | None = None):
    """Check one registered op on the given inputs and raise AssertionError (naming the worst
    elements, their values and bounds) if any output is past its bound.

    ``inputs``: a :class:`parity.registry.Case` (from the record's case builders) or ``{name: array
    or tensor}`` with the op's parameter names (values are rounded to ``dtype`` by the record's
    policy; the reference sees the rounded values); ``kwargs``: scalar keyword arguments (added to a
    Case's own); ``candidate``: a callable with the op's signature or a
    :class:`parity.certify.candidate.Candidate` (default: the registered optimized op, whose launch counter
    must move; any other callable must return its own, honest outputs); ``contract``: the arithmetic the candidate claims (default: its declared one, else ``ieee``).
    Returns the Judgement.
    """
    record = ops.get(op)
    case = _to_case(record, inputs, kwargs)
    cand = named(record, "optimized" if candidate is None else candidate, contract)
    device = cand.device(device)
    prep = prepare(record, case, dtype, device, contract=cand.contract)
    j = check(prep, cand.normalized(record), counter=cand.counter)
    if not j.passed:
        raise AssertionError(f"{op} at {dtype} ({case.label}): not within its bound\n{j.report()}")
    if cand.counter is not None and j.kernel_ran is False:
        raise AssertionError(f"{op}: the optimized kernel did not record a launch ({cand.counter})")
    if cand.outside and j.kernel_ran is False:
        raise AssertionError(f"{op} at {dtype} ({case.label}): {j.witness}")
    return j


def assert_certified(op: str, candidate, *, dtypes=("float32", "bfloat16"), examples: int | None = None,
                     device: str | None = None, contract: str | None = None):
    """Certify ``candidate`` (a callable with the op's signature, or a Candidate) as ``parity
    certify --impl`` does, on ``examples`` drawn inputs per dtype (default: the hypothesis
    profile's), and raise AssertionError with the reasons, the contract verdict and the nearest
    known bug if it is not certified. A wrong signature or wrong output shapes or dtypes raise
    ``parity.errors.CandidateError``. Returns the ``parity.certify.OpCertificate``."""
    device = device or default_device(None)
    with cpu_threads(device):
        cert = certify_op(ops.get(op), dtypes=tuple(dtypes), device=device, candidate=candidate,
                          examples=examples, contract=contract)
    if not cert.certified:
        bug, _ = cert.nearest_bug()
        near = (f"\nnearest known bug: {', '.join([bug['mutant'], *bug['ties']])} (similarity "
                f"{bug['similarity']:.2f})" if bug else "")
        raise AssertionError(f"{op}: {cert.candidate} not certified ({cert.contract_summary()}){near}\n"
                             + "\n".join(cert.reasons()))
    return cert


def op_names() -> list[str]:
    """Every registered op, for ``pytest.mark.parametrize("op", op_names())``."""
    return ops.names()
