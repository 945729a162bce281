"""Engines: whatever decodes Kimi-Linear, held to the float64 reference by ``parity diff``.

An engine is any object with the two methods of the optimized model (docs/api.md#engines):

    prefill(token_ids, *, trace=None) -> (logits, cache)    logits [T, vocab] (or [vocab]: the last)
    decode(token_id, cache, *, trace=None) -> (logits, cache)   logits [vocab]

``cache`` is the engine's own state, handed back unchanged. ``trace`` is a dict the engine may fill
(``parity/engines/trace.py``: names and shapes); one that does gets layer localization and router
analysis, one that does not gets verdicts from its logits alone.

Built in: ``optimized`` (this repository's model), ``transformers`` (transformers' own
``KimiLinearForCausalLM``, ``hf.py``) and ``dump:PATH`` (a file any engine writes, ``dump.py``).
Anything else is ``module:factory`` (or ``path/to/file.py:factory``), built by
``factory(checkpoint, *, dtype, device)``. Every engine reaches the diff through ``CheckedEngine``,
which refuses what breaks the protocol with one line (``EngineError``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .checked import CheckedEngine, EngineError
from .dump import DumpEngine, DumpError

BUILTIN = ("optimized", "transformers")
DUMP_PREFIX = "dump:"

__all__ = ["BUILTIN", "CheckedEngine", "DumpEngine", "DumpError", "EngineError", "from_factory",
           "load_engine"]


def _config_of(checkpoint):
    from reference.checkpoint import WeightSource, open_source

    return (checkpoint if isinstance(checkpoint, WeightSource) else open_source(checkpoint)).config


def load_engine(name: str, checkpoint, *, dtype: str | None, device: str | None,
                variants: dict | None = None, backends: dict | None = None):
    """A built-in engine over ``checkpoint`` (a checkpoint directory, or a reference
    ``WeightSource``): ``"optimized"``, ``"transformers"`` or ``"dump:PATH"`` (``dtype`` and
    ``device`` are the dump's own; a ``dtype`` that differs is refused). ``variants`` and
    ``backends`` as ``optimized.load``; the other engines run fixed semantics and refuse others."""
    variants, backends = dict(variants or {}), dict(backends or {})
    if name == "optimized":
        import optimized

        return optimized.load(checkpoint, device=device, dtype=dtype or "bfloat16",
                              backends=backends or None, **variants)
    if backends:
        raise EngineError(f"--backend applies to the optimized engine only, not {name!r}")
    if name == "transformers":
        from . import hf

        _fixed_variants(name, variants, hf.VARIANTS)
        return hf.load(checkpoint, dtype=dtype or "bfloat16", device=device or "cpu",
                       config=_config_of(checkpoint))
    if name.startswith(DUMP_PREFIX):
        engine = DumpEngine(name[len(DUMP_PREFIX):], _config_of(checkpoint))
        if dtype is not None and dtype != engine.dtype:
            raise DumpError(f"{engine.path}: the dump ran {engine.dtype}, not {dtype}")
        return engine
    raise EngineError(f"unknown engine {name!r}; built in: {', '.join(BUILTIN)}, dump:PATH; "
                      "or your own as module:factory")


def _fixed_variants(name: str, asked: dict, runs: dict) -> None:
    for key, value in asked.items():
        if runs.get(key) != value:
            raise EngineError(f"--variant {key}={value}: the {name} engine runs {key}={runs.get(key)}")


def _import(module: str):
    """``pkg.mod`` or ``path/to/file.py``, with the current folder importable (``parity`` is a
    console script: its ``sys.path`` lacks the folder it runs in)."""
    here = str(Path.cwd())
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        if not (module.endswith(".py") or "/" in module):
            return importlib.import_module(module)
        path = Path(module)
        if not path.is_file():
            raise EngineError(f"--engine {module}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        if added:
            sys.path.remove(here)


def from_factory(spec: str, checkpoint, *, dtype: str, device: str):
    """``module:factory`` -> ``factory(checkpoint, dtype=dtype, device=device)``; every failure
    (no module, no attribute, the factory raising) is one ``EngineError`` line naming ``spec``."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise EngineError(f"unknown engine {spec!r}; built in: {', '.join(BUILTIN)}, dump:PATH; "
                          "or your own as module:factory")
    try:
        mod = _import(module)
    except EngineError:
        raise
    except Exception as exc:  # the user's module failed to import, whatever the reason
        raise EngineError(f"--engine {spec}: cannot import {module}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise EngineError(f"--engine {spec}: {module} has no callable {attr!r}")
    try:
        return factory(checkpoint, dtype=dtype, device=device)
    except Exception as exc:
        raise EngineError(f"--engine {spec}: the factory raised {type(exc).__name__}: "
                          f"{' '.join(str(exc).split()) or '(no message)'}") from None


def router_bias(source):
    """``bias(layer) -> [E]`` float64: the checkpoint's router correction bias (completes traces)."""
    return lambda i: source.get(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")
