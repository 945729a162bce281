"""Outside implementations fitted to the registered op signatures (docs/ARCHITECTURE.md), for
``parity certify --impl NAME``: a shorthand names a whole family of adapters at once. Each adapter
is a function with a record's signature that calls the outside API, declaring its arithmetic
contract and what it wraps (``parity.candidate.adapter``). Nothing outside is imported until an
adapter runs; ``reference/`` and ``optimized/`` never import these packages.

- ``fla``: fla-core 0.6.0 (``pip install 'kimi-parity[peers]'``), :mod:`parity.peers.fla`.
"""
from __future__ import annotations

SHORTHANDS = ("fla",)
PACKAGES = {"fla": ("fla", "fla-core")}  # shorthand -> (module it imports, distribution to install)


def missing(name: str) -> str | None:
    """Why the shorthand ``name`` cannot run here (its package is not installed), or None."""
    import importlib.util

    module, dist = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        return f"--impl {name} needs {dist}, which is not installed (pip install 'kimi-parity[peers]')"
    return None


def implementations(name: str, device: str) -> dict:
    """op name -> adapter of the shorthand ``name`` for ``device`` (``cpu`` or ``cuda``);
    KeyError for an unknown shorthand."""
    if name == "fla":
        from . import fla

        return fla.implementations(device)
    raise KeyError(f"unknown implementation {name!r}; known: {', '.join(SHORTHANDS)}")
