"""Helpers shared by the record modules."""
from __future__ import annotations

import importlib


def lazy(path: str):
    """A callable that imports ``module:attr`` on first call (the reference and optimized modules
    load only when an op runs)."""
    mod, _, attr = path.partition(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(mod), attr)(*args, **kwargs)

    call.__name__ = attr
    call.__qualname__ = path
    return call


ROWS = {"inputs": {"x": 0}, "outputs": {"y": 0}}
