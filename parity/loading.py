"""Importing what a user names on the command line: ``pkg.mod`` or ``path/to/file.py``, and
``module:attr`` specs (``--engine module:factory``, ``--impl OP=module:function``)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def import_module_or_file(module: str):
    """``pkg.mod`` or ``path/to/file.py``, with the current folder importable (``parity`` is a
    console script: its ``sys.path`` lacks the folder it runs in). FileNotFoundError for a file
    that does not exist; whatever importing raises otherwise."""
    here = str(Path.cwd())
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        if not (module.endswith(".py") or "/" in module):
            return importlib.import_module(module)
        path = Path(module)
        if not path.is_file():
            raise FileNotFoundError(f"{module}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        if added:
            sys.path.remove(here)


def split_spec(spec: str) -> tuple[str, str] | None:
    """``module:attr`` -> ``(module, attr)`` (the last colon splits), None when either is missing."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        return None
    return module, attr


def attribute(mod, attr: str):
    """``mod.attr`` with a dotted ``attr`` (``Class.method``); AttributeError when absent."""
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
