"""Every engine behind one guard: what it returns is checked before the diff reads it.

An outside engine can raise, return logits of another vocabulary or of every position where one
was asked for, fill half a trace, or trace the prefill and not the decode. ``CheckedEngine`` turns
each of these into an ``EngineError`` whose one line names the engine, the call and the problem, so
the CLI reports it as unusable input (exit 2) instead of diffing wrong numbers.

This is the engine boundary: whatever an engine raises while it loads (``parity.diff.engines``) or runs
(``CheckedEngine``) is the engine's failure, not a finding and not a bug of the diff: one line
naming the engine, the phase, the exception and the innermost frame it came from (``failure``).
Running out of memory passes through as itself, marked with where it happened, for the CLI's one
memory line (``parity.errors.memory_line``). Code outside the boundary (the diff, the replay, the
report) is parity's own: its exceptions keep their tracebacks.
"""
from __future__ import annotations

import inspect
import os
import sys
import traceback

import numpy as np

from parity.errors import is_out_of_memory

from .trace import TraceError, check_trace


class EngineError(ValueError):
    """An engine that cannot be used: it raised, or returned something outside the protocol."""


def failure(name: str, phase: str, exc: BaseException) -> BaseException:
    """What to raise for ``exc``, raised by engine ``name`` in ``phase`` (``load``, ``prefill``,
    ``decode``, ...): an ``EngineError`` of one line (``engine NAME: PHASE raised Type: message
    (at file:line)``), or an out-of-memory error itself with ``parity_where`` set."""
    if is_out_of_memory(exc):
        try:
            exc.parity_where = f"engine {name}: {phase}"
        except AttributeError:  # an exception type that takes no attributes: the line says less
            pass
        return exc
    if isinstance(exc, EngineError):  # an engine made of another (a factory loading a built-in one)
        return EngineError(f"engine {name}: {phase}: {exc}")
    text = " ".join(str(exc).split()) or "(no message)"
    where = _innermost(exc)
    return EngineError(f"engine {name}: {phase} raised {type(exc).__name__}: {text}"
                       + (f" (at {where})" if where else ""))


def _innermost(exc: BaseException) -> str | None:
    """Where ``exc`` came from: the innermost Python frame (``path:line``, the path relative to the
    ``sys.path`` entry or working directory that holds it), preceded by the last frame outside
    that frame's package when there is one below the guard (``parity/diff/engines/hf.py:143 ->
    torch/nn/modules/module.py:1967``: a library's frame alone rarely says whose call it was)."""
    frames = [(_relative(f.filename), f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    if not frames:
        return None
    package = lambda path: path.split(os.sep)[0]  # noqa: E731
    inner = frames[-1]
    caller = next((f for f in reversed(frames[1:-1]) if package(f[0]) != package(inner[0])), None)
    return " -> ".join(f"{p}:{n}" for p, n in ([caller] if caller else []) + [inner])


def _relative(filename: str) -> str:
    path = os.path.abspath(filename)
    roots = sorted({os.path.abspath(p) for p in sys.path if p} | {os.getcwd()}, key=len, reverse=True)
    root = next((r for r in roots if path.startswith(r + os.sep)), None)
    return path[len(root) + 1:] if root else path


def _takes_trace(method) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or C extension: assume the documented signature
        return True
    return "trace" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", np.shape(x)))


class CheckedEngine:
    """``engine`` with its outputs validated against ``config``. ``name``: how errors name it;
    ``bias(layer) -> [E]``: the checkpoint's router correction bias (completes a trace without
    ``router.selection``). ``traced`` is None until the first call, then whether the engine traces."""

    def __init__(self, engine, config, *, name: str, bias=None):
        for method in ("prefill", "decode"):
            if not callable(getattr(engine, method, None)):
                raise EngineError(f"engine {name}: {type(engine).__name__} has no {method}() method "
                                  "(an engine has prefill(token_ids, *, trace=None) and "
                                  "decode(token_id, cache, *, trace=None))")
        self.engine, self.config, self.name, self.bias = engine, config, name, bias
        self.traced: bool | None = None
        self.logits_dtype: str | None = None
        self.variants = dict(getattr(engine, "variants", {}) or {})

    def __getattr__(self, attr):  # .hf_model, .source, ...: the engine's own attributes
        if attr == "engine":
            raise AttributeError(attr)
        return getattr(self.engine, attr)

    @property
    def batches(self) -> bool:
        """Whether the engine decodes several sequences in one call: it has ``decode_batch(token_ids,
        caches, *, trace=None) -> (logits [B, vocab], caches)`` (docs/api.md#engines)."""
        return callable(getattr(self.engine, "decode_batch", None))

    def batch_caches(self, n: int):
        """``fresh() -> cache``: what each of ``n`` prompts to be decoded together is prefilled into
        (``prefill(ids, cache=fresh())``). An engine whose batched caches share state has
        ``new_pool(n)`` (the optimized model's state pool; ``fresh`` is its ``new_sequence``);
        for any other ``fresh()`` is None, a plain prefill."""
        new_pool = getattr(self.engine, "new_pool", None)
        if not callable(new_pool):
            return lambda: None
        pool = self._guard("new_pool", lambda: new_pool(n))
        return lambda: self._guard("new_pool", pool.new_sequence)

    def prefill(self, token_ids, *, trace: dict | None = None, cache=None):
        """``cache``: the empty cache of a pool to prefill into (``batch_caches``); None: the
        engine's own fresh one."""
        ids = [int(t) for t in token_ids]
        return self._call("prefill", (ids,), len(ids), trace, {} if cache is None else {"cache": cache})

    def decode(self, token_id, cache, *, trace: dict | None = None):
        return self._call("decode", (int(token_id), cache), 1, trace)

    def decode_batch(self, token_ids, caches, *, trace: dict | None = None):
        """One token for each of B sequences: ``(logits [B, vocab], caches)``; ``trace`` the B
        sequences' rows (``reference.batch.split_trace``)."""
        ids = [int(t) for t in token_ids]
        return self._call("decode_batch", (ids, list(caches)), len(ids), trace)

    def _guard(self, method: str, fn):
        try:
            return fn()
        except EngineError:
            raise
        except Exception as exc:  # the engine's failure, whatever its type: one line (``failure``)
            raise failure(self.name, method, exc) from None

    def _call(self, method: str, args: tuple, rows: int, trace: dict | None, kwargs: dict | None = None):
        fn = getattr(self.engine, method)
        own = {} if trace is not None else None
        kw = dict(kwargs or {})
        if own is not None and _takes_trace(fn):
            kw["trace"] = own
        out = self._guard(method, lambda: fn(*args, **kw))
        if not (isinstance(out, tuple) and len(out) == 2):
            raise EngineError(f"engine {self.name}: {method} returned {type(out).__name__}; expected a "
                              "(logits, cache) pair")
        logits, cache = out
        self._check_logits(method, logits, rows)
        if own is not None:
            self._check_trace(method, own, rows)
            trace.update(own)
        return logits, cache

    def _check_logits(self, method: str, logits, rows: int) -> None:
        V = self.config.vocab_size
        shape = _shape(logits)
        n = int(np.prod(shape)) if shape else 0
        allowed = {"prefill": (1, rows), "decode": (1,), "decode_batch": (rows,)}[method]
        ok = bool(shape) and shape[-1] == V and n // V in allowed and (method != "decode_batch" or len(shape) == 2)
        if not ok:
            want = {"prefill": f"({rows}, {V}) or ({V},)", "decode": f"({V},)",
                    "decode_batch": f"({rows}, {V})"}[method]
            raise EngineError(f"engine {self.name}: {method} returned logits of shape {shape}; "
                              f"expected {want} (vocab_size {V})")
        kind = str(getattr(logits, "dtype", "")).replace("torch.", "")
        if kind not in ("bfloat16", "float16", "float32", "float64"):
            raise EngineError(f"engine {self.name}: {method} returned logits of dtype {kind or type(logits).__name__}; "
                              "expected floating point")
        self.logits_dtype = kind

    def _check_trace(self, method: str, trace: dict, rows: int) -> None:
        where = f"engine {self.name}: {method}"
        try:
            check_trace(trace, self.config, rows, where=where, bias=self.bias)
        except TraceError as exc:
            raise EngineError(str(exc)) from None
        traced = bool(trace)
        if self.traced is None:
            self.traced = traced
        elif traced != self.traced:
            raise EngineError(f"{where}: " + ("filled a trace although the prefill did not" if traced
                                              else "filled no trace although the prefill did"))
