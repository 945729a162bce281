"""Certifies the optimized Kimi-Linear path against the float64 reference.

Public API (lazily imported, so ``import parity`` stays light):

- ``parity.classify_step`` / ``StepVerdict``: the near-tie primitive (parity/neartie.py);
- ``parity.ops``: the op records (``records()``, ``get``, ``select``), one package per op family
  (``parity.ops.kda``: its records, inputs, bounds, emulation, mutants, capture sites),
  ``parity.registry`` their types; ``parity.candidate``: what is certified; ``parity.certify``:
  certification; ``parity.strategies``: shared hypothesis strategies and profiles;
  ``parity.bounds``: the error-bound arithmetic;
  ``parity.metrics``: comparisons (``compare``, ``nearer_truth``);
- ``parity.assert_parity(op, inputs, ...)``: one op on given inputs, AssertionError with the worst
  elements when past its bound;
- ``parity.watch({op: "module:function"}, out=...)``: record a running engine's kernel calls, for
  ``parity certify --calls`` (parity/watch/: the package is itself the context manager).
"""
from __future__ import annotations

_LAZY = {
    "classify_step": ("parity.neartie", "classify_step"),
    "StepVerdict": ("parity.neartie", "StepVerdict"),
    "assert_parity": ("parity.testing", "assert_parity"),
    "nearer_truth": ("parity.metrics", "nearer_truth"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in ("registry", "ops", "candidate", "certify", "strategies", "bounds", "metrics", "mutants",
                "neartie", "check", "emulate", "testing", "platform", "schema", "report", "docs", "watch"):
        import importlib

        return importlib.import_module(f"parity.{name}")
    raise AttributeError(f"module 'parity' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
