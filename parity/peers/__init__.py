"""Outside implementations fitted to the registered op signatures (docs/ARCHITECTURE.md), for
``parity certify --impl NAME``: a shorthand names a whole family of adapters at once. Each adapter
is a function with a record's signature that calls the outside API, declaring its arithmetic
contract and what it wraps (``parity.certify.candidate.adapter``). Nothing outside is imported until an
adapter runs; ``reference/`` and ``optimized/`` never import these packages.

- ``fla``: fla-core 0.6.0 (``pip install 'kimi-parity[peers]'``), :mod:`parity.peers.fla`: both KDA
  gates (its safe-gate path for the bounded one).
- ``flashkda``: Moonshot's FlashKDA (built from its source; CUDA, bf16, K = V = 128, the bounded gate
  only), :mod:`parity.peers.flashkda`.
"""
from __future__ import annotations

import importlib.util

from . import fla, flashkda

SHORTHANDS = ("fla", "flashkda")
# shorthand -> (module it imports, how to get it)
PACKAGES = {"fla": ("fla", "fla-core (pip install 'kimi-parity[peers]')"),
            "flashkda": ("flash_kda", "FlashKDA (built from its source: docs/certificates.md)")}


def missing(name: str) -> str | None:
    """Why the shorthand ``name`` cannot run here (its package is not installed), or None."""
    module, dist = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        return f"--impl {name} needs {dist.split(' (')[0]}, which is not installed ({dist.split(' (', 1)[1]}"
    return None


def implementations(name: str, device: str) -> dict:
    """op name -> adapter of the shorthand ``name`` for ``device`` (``cpu`` or ``cuda``);
    KeyError for an unknown shorthand."""
    if name == "fla":
        return fla.implementations(device)
    if name == "flashkda":
        return flashkda.implementations(device)
    raise KeyError(f"unknown implementation {name!r}; known: {', '.join(SHORTHANDS)}")
