"""Putting the recorder in front of the watched functions.

A watched function is replaced, where it is defined, by a wrapper that records the call around the
original (``recorder``); everything else about the call is the original's. Two ways in:

- :func:`install_now` (``parity.watch`` in Python): imports the target's module, replaces the
  function there and in every loaded module that holds it under some name (a ``from m import f``
  made before the watch began). The wrappers stay when the block ends, passing calls straight
  through while no watch runs (a global read, well under a microsecond a call): the next block finds
  them in place and enters without another pass over the modules, which costs more than the
  prefill it would watch. :func:`uninstall` puts the originals back;
- :func:`install_on_import` (``parity watch`` on the command line, in every Python process of the
  program): an import hook replaces the function when its module finishes loading, before anyone can
  take it, so a later ``from m import f`` gets the wrapper; nothing is imported early.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import itertools
import operator
import sys

from parity.errors import InputError

from . import adapters
from .recorder import Recorder, Target

_ACTIVE: Recorder | None = None


class WatchError(InputError):
    """A target that cannot be watched (one line)."""


def active() -> Recorder | None:
    return _ACTIVE


def activate(rec: Recorder | None) -> None:
    global _ACTIVE
    _ACTIVE = rec


def split(spec: str) -> tuple[str, str]:
    module, colon, attr = spec.partition(":")
    if not colon or not module or not attr:
        raise WatchError(f"{spec!r}: expected module:function")
    return module, attr


def target(name: str, spec: str, fn) -> Target:
    """The :class:`Target` for the function ``fn`` named ``spec``; WatchError when it is not
    callable, has no signature, or no adapter maps its calls."""
    if getattr(fn, "parity_watched", None) is not None:
        fn = fn.__wrapped__
    if not callable(fn):
        raise WatchError(f"{spec}: not callable ({type(fn).__name__})")
    try:
        sig = adapters.call_signature(fn)
    except (TypeError, ValueError):
        raise WatchError(f"{spec}: has no Python signature to bind its calls to") from None
    try:
        reverse, known = adapters.for_target(spec, fn)
    except LookupError as exc:
        raise WatchError(str(exc)) from None
    return Target(name, spec, fn, sig, reverse, known)


def wrapper(t: Target):
    fn = t.fn

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        rec = _ACTIVE
        if rec is None or rec.closed:
            return fn(*args, **kwargs)
        t = watched.parity_watched      # a later watch may name the target as another op
        try:
            pend = rec.before(t, args, kwargs)
        except Exception as exc:  # the recorder failing (out of host memory) never stops the engine
            _failed(t, exc)
            return fn(*args, **kwargs)
        result = fn(*args, **kwargs)
        try:
            rec.after(pend, result)
        except Exception as exc:
            _failed(t, exc)
        return result

    watched.parity_watched = t
    return watched


_FAILED: set = set()


def _failed(t: Target, exc: Exception) -> None:
    key = (t.spec, type(exc).__name__)
    if key not in _FAILED:
        _FAILED.add(key)
        print(f"parity watch: {t.spec}: a call was not recorded: {type(exc).__name__}: {exc}", file=sys.stderr)


def _owner(module, attr: str):
    obj = module
    parts = attr.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1]


class Installed:
    """What :func:`install_now` replaced: (holder, name, original, wrapper) to put back."""

    def __init__(self):
        self.replaced: list = []

    def restore(self) -> None:
        for holder, name, original, wrapped in reversed(self.replaced):
            if getattr(holder, name, None) is wrapped:
                setattr(holder, name, original)
        self.replaced = []


_KEPT = Installed()     # every place install_now replaced, kept until uninstall()


def install_now(targets: dict) -> None:
    """Wrap each ``name -> "module:function"`` target now (module docstring); WatchError, one line,
    for a target that does not import, resolve or map; nothing this call replaced is left then. A
    target whose module holds its wrapper already (an earlier block, the import hook) keeps it."""
    done = Installed()
    swaps: dict = {}
    try:
        for name, spec in targets.items():
            module, attr = split(spec)
            try:
                mod = importlib.import_module(module)
            except Exception as exc:
                raise WatchError(f"{spec}: cannot import {module}: {type(exc).__name__}: {exc}") from None
            try:
                holder, last = _owner(mod, attr)
                fn = getattr(holder, last)
            except AttributeError:
                raise WatchError(f"{spec}: {module} has no attribute {attr!r}") from None
            kept = getattr(fn, "parity_watched", None)
            if kept is not None and (kept.name, kept.spec) == (name, spec):
                continue
            t = target(name, spec, fn)
            if kept is not None and kept.fn is t.fn:
                fn.parity_watched = t
                continue
            w = wrapper(t)
            setattr(holder, last, w)
            done.replaced.append((holder, last, fn, w))
            for obj in (fn, t.fn):
                swaps.setdefault(id(obj), (obj, w))
        _rebind(swaps, done)
    except BaseException:
        done.restore()
        raise
    _KEPT.replaced += done.replaced


def uninstall() -> None:
    """Put back every function :func:`install_now` replaced (the wrappers pass calls through
    meanwhile, so this is for a program that compares the functions by identity)."""
    if _ACTIVE is not None:
        raise WatchError("a watch is running: uninstall after its block")
    _KEPT.restore()


def _rebind(swaps: dict, done: Installed) -> None:
    """Names bound before the watch began: in every loaded module, each name that holds a watched
    function (``swaps``: id -> (function, its wrapper)) is given the wrapper. One pass over the
    modules for all targets, each module's values tested by identity in C (``map(operator.is_)``):
    a process with transformers and fla loaded holds some 10^5 module-level names, and this runs
    once per target and process, before the engine's first call."""
    if not swaps:
        return
    objs = [obj for obj, _ in swaps.values()]
    for m in list(sys.modules.values()):
        d = getattr(m, "__dict__", None)
        if not isinstance(d, dict):
            continue
        values = d.values()
        for obj in objs:
            if any(map(operator.is_, values, itertools.repeat(obj))):
                break
        else:
            continue
        for k, v in list(d.items()):
            hit = swaps.get(id(v))
            if hit is not None and hit[0] is v:
                setattr(m, k, hit[1])
                done.replaced.append((m, k, v, hit[1]))


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, on_loaded):
        self._inner, self._on_loaded = inner, on_loaded

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds watched modules with the other finders, and wraps their targets once loaded."""

    def __init__(self, by_module: dict, on_error):
        self.by_module = by_module      # module -> [(name, attr, spec)]
        self.on_error = on_error

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.by_module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self._loaded)
                return spec
        return None

    def _loaded(self, module):
        for name, attr, spec in self.by_module.get(module.__name__, ()):
            try:
                holder, last = _owner(module, attr)
                setattr(holder, last, wrapper(target(name, spec, getattr(holder, last))))
            except (WatchError, AttributeError) as exc:
                self.on_error(f"{spec}: {exc}" if isinstance(exc, AttributeError) else str(exc))


def install_on_import(targets: dict, on_error) -> None:
    """Wrap each target when its module loads (module docstring); a target whose module is loaded
    already is wrapped now. ``on_error(line)`` hears of a target that cannot be wrapped."""
    by_module: dict = {}
    for name, spec in targets.items():
        module, attr = split(spec)
        by_module.setdefault(module, []).append((name, attr, spec))
    finder = _Finder(by_module, on_error)
    for module in list(by_module):
        if module in sys.modules:
            finder._loaded(sys.modules[module])
    sys.meta_path.insert(0, finder)
