"""Outside implementations fitted to the registered op signatures (docs/ARCHITECTURE.md), for
``parity certify --impl NAME``: a shorthand names a whole family of adapters at once. Each adapter
is a function with a record's signature that calls the outside API, declaring its arithmetic
contract and what it wraps (``parity.candidate.adapter``). Nothing outside is imported until an
adapter runs; ``reference/`` and ``optimized/`` never import these packages.

- ``fla``: fla-core 0.6.0 (``pip install 'kimi-parity[peers]'``), :mod:`parity.peers.fla`: both KDA
  gates (its safe-gate path for the bounded one).
- ``flashkda``: Moonshot's FlashKDA (built from its source; CUDA, bf16, K = V = 128, the bounded gate
  only), :mod:`parity.peers.flashkda`.
"""
from __future__ import annotations

SHORTHANDS = ("fla", "flashkda")


def implementations(name: str, device: str) -> dict:
    """op name -> adapter of the shorthand ``name`` for ``device`` (``cpu`` or ``cuda``);
    KeyError for an unknown shorthand."""
    if name == "fla":
        from . import fla

        return fla.implementations(device)
    if name == "flashkda":
        from . import flashkda

        return flashkda.implementations(device)
    raise KeyError(f"unknown implementation {name!r}; known: {', '.join(SHORTHANDS)}")
