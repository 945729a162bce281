"""The old names of the modules that moved to ``kimi`` (the model's files), kept for code written
before the move: ``import reference.config`` gives ``kimi.config`` itself, the same module object,
so what is patched or compared through either name is the same. Each old name is a three-line module
that calls :func:`alias`; nothing in the project imports them."""
from __future__ import annotations

import importlib
import sys

MOVED = {f"reference.{name}": f"kimi.{name}" for name in (
    "checkpoint", "config", "fixtures", "safetensors_format", "storage", "synthetic", "tensors", "tokenizer",
    "validate")}


def alias(old: str) -> None:
    """Make ``old`` name the module it moved to."""
    sys.modules[old] = importlib.import_module(MOVED[old])
