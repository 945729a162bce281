"""Certifies the optimized Kimi-Linear path against the float64 reference.

Public API:

- ``parity.classify_step`` / ``StepVerdict``: the near-tie primitive (parity/diff/neartie.py);
- ``parity.ops``: the op records (``records()``, ``get``, ``select``), one package per op family
  (``parity.ops.kda``: its records, inputs, bounds, emulation, mutants, capture sites),
  ``parity.registry`` their types; ``parity.certify.candidate``: what is certified; ``parity.certify``:
  certification; ``parity.strategies``: shared hypothesis strategies and profiles;
  ``parity.bounds``: the error-bound arithmetic;
  ``parity.metrics``: comparisons (``compare``, ``nearer_truth``);
- ``parity.assert_parity(op, inputs, ...)``: one op on given inputs, AssertionError with the worst
  elements when past its bound;
- ``parity.watch({op: "module:function"}, out=...)``: record a running engine's kernel calls, for
  ``parity judge`` (parity/record/watch/: the package is itself the context manager).
"""
from __future__ import annotations

from . import bounds, certify, docs, emulate, metrics, mutants, ops, platform, registry, schema, strategies, testing
from .certify import candidate, check, report
from .diff import neartie
from .diff.neartie import StepVerdict, classify_step
from .metrics import nearer_truth
from .record import watch
from .testing import assert_parity

__all__ = ["classify_step", "StepVerdict", "assert_parity", "nearer_truth", "registry", "ops", "candidate",
           "certify", "strategies", "bounds", "metrics", "mutants", "neartie", "check", "emulate", "testing",
           "platform", "schema", "report", "docs", "watch"]
