"""Why a watched target was never called: said when a process's watch ends, for each target it
made no call of, so that an empty calls file names its cause instead of only "no call judged".

What one process can tell, in order (:func:`reasons`):

- the target's module was never imported (the program never used it here: transformers without
  fla-core, a process that serves but does not compute);
- the name no longer holds the watch's wrapper (something replaced it after the watch began);
- the original function is still held somewhere the watch did not replace (a closure, a class
  attribute, a table, another module's name: a reference taken before the watch began), named;
- else nothing called it from Python: the program dispatches elsewhere (transformers runs its own
  torch KDA functions where fla-core's kernels do not support the device, the CPU), or calls it
  from a captured CUDA graph or ``torch.compile``'d code, which makes no Python call.

Naming the holders walks the garbage collector's referrers: about 0.1 s per walk in a process with
torch and transformers loaded, a few walks per target. It is done when the process made no watched
call at all (the watch saw nothing: the case to explain); a process that called some targets and
not others (a prefill, which makes no decode call) gets both likely reasons without the walk, so
that ending a watch stays cheap. Never during the calls.
"""
from __future__ import annotations

import gc
import sys
import types

DISPATCH = ("the program dispatches elsewhere (e.g. transformers runs its own torch KDA functions where "
            "fla-core's kernels do not support the device, such as the CPU), or calls it from a CUDA graph or "
            "torch.compile'd code, which makes no Python call")
BEFORE = ("start the watch before that import, or run the program under `parity watch`, whose import hook wraps "
          "it as its module loads")
HOLDERS_SHOWN = 3


def reasons(targets: dict, called: dict) -> dict:
    """``{spec: why}`` for each target (``{name: "module:function"}``) with no call in ``called``
    (spec -> calls), as this process sees it now (module docstring); the holders are named when no
    target was called."""
    deep = not any(called.values())
    return {spec: why(spec, deep=deep) for spec in targets.values() if not called.get(spec)}


def why(spec: str, *, deep: bool = True) -> str:
    """The likely reason the target ``spec`` was never called; ``deep``: name what holds it."""
    module, _, attr = spec.partition(":")
    mod = sys.modules.get(module)
    if mod is None:
        return (f"its module {module} was never imported in this process (the program does not use it here: "
                "a framework that picked another implementation, or a process that does not compute)")
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    target = getattr(obj, "parity_watched", None)
    if target is None:
        held = "nothing" if obj is None else _name(obj)
        return (f"{spec} holds {held}, not the watch's wrapper: the function was not wrapped (see the line said "
                "when its module loaded) or was replaced after the watch began")
    if not deep:
        return (f"likely the program does not call it here (a prefill makes no decode call), or {DISPATCH}; or it "
                "calls a reference taken before the watch began (a closure, a class attribute, a table), which the "
                f"watch cannot replace ({BEFORE})")
    named, hidden = [], []
    for is_name, phrase in holders(target.fn, ours=_ours(obj, target), wrapper=obj):
        (named if is_name else hidden).append(phrase)
    if hidden:
        said = [f"likely it was taken before the watch began and is held by {_few(hidden)}, where the watch cannot "
                f"replace it ({BEFORE}); or {DISPATCH}"]
    else:
        said = [f"likely {DISPATCH}"]
    if named:
        said.append(f"it is also reachable unwatched as {_few(named)} (a caller of that name is not seen: watch it "
                    "there)")
    return "; ".join(said)


def _few(phrases: list) -> str:
    more = len(phrases) - HOLDERS_SHOWN
    return ", ".join(phrases[:HOLDERS_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _ours(wrapper, target) -> set:
    """ids of the watch's own references to the original: the wrapper's closure and attributes."""
    ids = {id(vars(wrapper)), id(vars(target))}
    ids.update(id(c) for c in getattr(wrapper, "__closure__", None) or ())
    return ids


def holders(obj, *, ours: set, wrapper=None) -> list:
    """Where ``obj`` is held: ``[(is a module's name, phrase)]`` (``module.name``; the closure of a
    function, a class attribute, a container, ...), leaving out ``ours`` (ids), frames, this walk's
    own lists and any container that holds ``wrapper`` too (the watch's record of what it replaced)."""
    out = []
    modules = {id(getattr(m, "__dict__", None)): m for m in list(sys.modules.values())}
    refs = gc.get_referrers(obj)
    mine = {id(refs)}
    for r in refs:
        if id(r) in ours or id(r) in mine or isinstance(r, types.FrameType):
            continue
        if wrapper is not None and isinstance(r, (list, tuple)) and any(x is wrapper for x in r):
            continue
        m = modules.get(id(r))
        if m is not None:
            keys = [k for k, v in list(r.items()) if v is obj and isinstance(k, str)]
            phrase, is_name = ", ".join(f"{m.__name__}.{k}" for k in keys) or f"module {m.__name__}", True
        else:
            phrase, is_name = _holder(r, obj, depth=1, mine=mine), False
        if phrase is not None and (is_name, phrase) not in out:
            out.append((is_name, phrase))
    return out


def _holder(r, obj, *, depth: int, mine: set) -> str | None:
    """One phrase for the referrer ``r`` of ``obj`` (None: nothing alive holds ``obj`` through it,
    such as a dead closure's cell awaiting collection); ``mine``: ids of this walk's own lists."""
    if type(r).__name__ == "cell":
        tuples = gc.get_referrers(r)
        mine.add(id(tuples))
        for t in tuples:
            if isinstance(t, tuple) and id(t) not in mine:
                refs = gc.get_referrers(t)
                mine.add(id(refs))
                for f in refs:
                    if isinstance(f, types.FunctionType) and f.__closure__ is t and f.__module__ != __name__:
                        return f"the closure of {_name(f)}"
        return None
    if isinstance(r, dict):
        keys = [k for k, v in list(r.items()) if v is obj and isinstance(k, str)]
        owners = gc.get_referrers(r)
        mine.add(id(owners))
        for owner in owners:
            if getattr(owner, "__dict__", None) is r:
                if keys == ["__wrapped__"]:
                    return f"{_name(owner)} (a wrapper that calls the original, not the watch's)"
                what = "class attribute" if isinstance(owner, type) else "attribute"
                return f"{what} {_name(owner)}.{'/'.join(keys)}"
        return f"a dict (under {', '.join(keys)})" if keys else "a dict"
    if isinstance(r, (list, tuple, set)):
        kind = f"a {type(r).__name__}"
        if depth > 0:
            refs = gc.get_referrers(r)
            mine.add(id(refs))
            for r2 in refs:
                if id(r2) in mine or isinstance(r2, (types.FrameType, list, tuple, set)):
                    continue
                inner = _holder(r2, r, depth=depth - 1, mine=mine)
                if inner is not None:
                    return f"{kind} in {inner}"
        return kind
    return f"a {type(r).__name__} object"


def _name(obj) -> str:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qual is None:
        return f"a {type(obj).__name__}"
    return f"{mod}.{qual}" if mod else qual
