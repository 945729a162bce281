"""Engines: whatever decodes Kimi-Linear, held to the float64 reference by ``parity diff``.

An engine is any object with the two methods of the optimized model (docs/api.md#engines):

    prefill(token_ids, *, trace=None) -> (logits, cache)    logits [T, vocab] (or [vocab]: the last)
    decode(token_id, cache, *, trace=None) -> (logits, cache)   logits [vocab]

``cache`` is the engine's own state, handed back unchanged. ``trace`` is a dict the engine may fill
(``parity/diff/engines/trace.py``: names and shapes); one that does gets layer localization and router
analysis, one that does not gets verdicts from its logits alone.

Built in: ``optimized`` (this repository's model), ``transformers`` (transformers' own
``KimiLinearForCausalLM``, ``hf.py``) and ``dump:PATH`` (a file any engine writes, ``dump.py``).
Anything else is ``module:factory`` (or ``path/to/file.py:factory``), built by
``factory(checkpoint, *, dtype, device)``. Every engine reaches the diff through ``CheckedEngine``,
which refuses what breaks the protocol with one line (``EngineError``). Loading is the engine's too:
whatever a factory (ours or yours) raises is one ``EngineError`` line naming the engine and ``load``
(``checked.failure``), except a broken checkpoint or a bad option of ours, which name themselves.
"""
from __future__ import annotations

import optimized
from kimi.checkpoint import WeightSource, open_source
from parity.loading import import_module_or_file, split_spec

from . import hf
from .checked import CheckedEngine, EngineError, failure
from .dump import DumpEngine, DumpError

BUILTIN = ("optimized", "transformers")
DUMP_PREFIX = "dump:"

__all__ = ["BUILTIN", "CheckedEngine", "DumpEngine", "DumpError", "EngineError", "from_factory",
           "load_engine"]


def _config_of(checkpoint):
    return (checkpoint if isinstance(checkpoint, WeightSource) else open_source(checkpoint)).config


def load_engine(name: str, checkpoint, *, dtype: str | None, device: str | None,
                variants: dict | None = None, backends: dict | None = None):
    """A built-in engine over ``checkpoint`` (a checkpoint directory, or a reference
    ``WeightSource``): ``"optimized"``, ``"transformers"`` or ``"dump:PATH"`` (``dtype`` and
    ``device`` are the dump's own; a ``dtype`` that differs is refused). ``variants`` and
    ``backends`` as ``optimized.load``; the other engines run fixed semantics and refuse others."""
    variants, backends = dict(variants or {}), dict(backends or {})
    if name == "optimized":
        return _loading(name, lambda: optimized.load(checkpoint, device=device, dtype=dtype or "bfloat16",
                                                     backends=backends or None, **variants), ours=True)
    if backends:
        raise EngineError(f"--backend applies to the optimized engine only, not {name!r}")
    if name == "transformers":
        _fixed_variants(name, variants, hf.VARIANTS)
        config = _config_of(checkpoint)
        return _loading(name, lambda: hf.load(checkpoint, dtype=dtype or "bfloat16", device=device or "cpu",
                                              config=config))
    if name.startswith(DUMP_PREFIX):
        config = _config_of(checkpoint)
        engine = _loading(name, lambda: DumpEngine(name[len(DUMP_PREFIX):], config))
        if dtype is not None and dtype != engine.dtype:
            raise DumpError(f"{engine.path}: the dump ran {engine.dtype}, not {dtype}")
        return engine
    raise EngineError(f"unknown engine {name!r}; built in: {', '.join(BUILTIN)}, dump:PATH; "
                      "or your own as module:factory")


def _loading(name: str, load, *, ours: bool = False):
    """``load()``; what it raises is the engine's failure (``checked.failure``). ``ours``: this
    repository's model, whose unusable-input errors (a broken checkpoint, a bad variant, dtype or
    device: ``ValueError``s of one line that name the thing) stay as they are."""
    try:
        return load()
    except EngineError:
        raise
    except Exception as exc:
        if ours and isinstance(exc, ValueError):
            raise
        raise failure(name, "load", exc) from None


def _fixed_variants(name: str, asked: dict, runs: dict) -> None:
    for key, value in asked.items():
        if runs.get(key) != value:
            raise EngineError(f"--variant {key}={value}: the {name} engine runs {key}={runs.get(key)}")


def _import(module: str):
    """``pkg.mod`` or ``path/to/file.py`` (parity.loading); a missing file is an EngineError."""
    try:
        return import_module_or_file(module)
    except FileNotFoundError:
        raise EngineError(f"--engine {module}: no such file") from None


def from_factory(spec: str, checkpoint, *, dtype: str, device: str):
    """``module:factory`` -> ``factory(checkpoint, dtype=dtype, device=device)``; every failure
    (no module, no attribute, the factory raising) is one ``EngineError`` line naming ``spec``."""
    parts = split_spec(spec)
    if parts is None:
        raise EngineError(f"unknown engine {spec!r}; built in: {', '.join(BUILTIN)}, dump:PATH; "
                          "or your own as module:factory")
    module, attr = parts
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
        raise failure(spec, "the factory", exc) from None


def router_bias(source):
    """``bias(layer) -> [E]`` float64: the checkpoint's router correction bias (completes traces)."""
    return lambda i: source.get(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")
