"""The old names of modules that moved into parity's rooms (``certify/``, ``diff/``, ``record/``),
kept for code written before the move: ``import parity.check`` gives ``parity.certify.check``
itself, the same module object, so what is patched or compared through either name is the same.
Each old name is a three-line module that calls :func:`alias`; nothing in the project imports them.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

MOVED = {
    "parity.candidate": "parity.certify.candidate",
    "parity.check": "parity.certify.check",
    "parity.fingerprint": "parity.certify.fingerprint",
    "parity.pool": "parity.certify.pool",
    "parity.report": "parity.certify.report",
    "parity.repro": "parity.certify.repro",
    "parity.results": "parity.certify.results",
    "parity.search": "parity.certify.search",
    "parity.engines": "parity.diff.engines",
    "parity.golden": "parity.diff.golden",
    "parity.golden_schema": "parity.diff.golden_schema",
    "parity.neartie": "parity.diff.neartie",
    "parity.reference_device": "parity.diff.reference_device",
    "parity.capture": "parity.record.capture",
    "parity.watch": "parity.record.watch",
}


def alias(old: str) -> None:
    """Make ``old`` (and, for a package, each of its submodules) name the module it moved to."""
    new = MOVED[old]
    module = importlib.import_module(new)
    sys.modules[old] = module
    for sub in pkgutil.iter_modules(getattr(module, "__path__", [])):
        sys.modules[f"{old}.{sub.name}"] = importlib.import_module(f"{new}.{sub.name}")
