"""Recording the inputs of the model's op calls: :func:`recording` puts a :class:`RecordingOps` in
front of ``model.ops`` (the one object the model makes its op calls through) for the duration of a
``with`` block, and restores it after.

Each call of a captured method (``parity.record.capture.sites``) is fitted to its record's inputs and kept
once per (op, shape signature, call site): the first call of a signature is frozen (its inputs
copied or summarized, before the op runs: the decode ops update their state pools in place), later
identical calls (the same call in every layer) only count. The op then runs with the arguments the
model passed, untouched: recording copies, it never writes, so the model computes the same bits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

from parity import ops
from parity.registry import Site

from . import sites, tensors


@dataclass
class Captured:
    """One deduplicated op call: its record ``op``, where the model called it (``call_site``,
    ``Model._stack:281``), the phase of its first call (``prefill``, ``decode 1``, ...), how many
    identical calls it stands for, its scalar kwargs and its frozen inputs (name ->
    :class:`parity.record.capture.tensors.Frozen`, None for an absent optional input)."""

    op: str
    call_site: str
    first: str
    kwargs: dict
    inputs: dict
    calls: int = 1
    note: str = ""
    extra: dict = field(default_factory=dict)   # input -> {key: value} (the KDA log-decay range)


class Recorder:
    """Where the captured calls go. ``store_limit``: a float input of more bytes is kept as statistics
    and a seed (regenerated on replay) instead of its values; ``seed``: the base of those seeds."""

    def __init__(self, *, store_limit: int, seed: int = 0):
        self.records = {r.name: r for r in ops.records()}
        self.store_limit = int(store_limit)
        self.seed = int(seed)
        self.phase = "prefill"
        self.cases: dict[tuple, Captured] = {}
        self.uncaptured: Counter = Counter()
        self.logits: list = []          # parity.capture.run: the model's logits, one row per step
        self._defaults: dict[str, dict] = {}

    def add(self, site: Site, call_site: str, args: dict) -> None:
        rec = self.records[site.op]
        arrays, kwargs = site.convert(args)
        if kwargs.get("lower_bound") is not None:   # the bounded KDA gate: the op's record of that gate
            site = dataclasses.replace(site, op=site.op + "+lower_bound")
            rec = self.records[site.op]
        kwargs = {**self._scalar_defaults(rec), **kwargs}
        key = (site.op, call_site, json.dumps(kwargs, sort_keys=True, default=str),
               tuple((n, None if t is None else (tuple(t.shape), str(t.dtype))) for n, t in arrays.items()))
        if key in self.cases:
            self.cases[key].calls += 1
            return
        where = f"{site.op} at {call_site} ({self.phase})"
        index = len(self.cases)
        frozen = {n: None if t is None else tensors.freeze(t, limit=self.store_limit,
                                                           seed=tensors.derive_seed(self.seed, index, n),
                                                           what=f"{where}: input {n}")
                  for n, t in arrays.items()}
        self.cases[key] = Captured(site.op, call_site, self.phase, kwargs, frozen, note=site.note,
                                   extra=tensors.extras(site.op, arrays))

    def _scalar_defaults(self, rec) -> dict:
        if rec.name not in self._defaults:
            self._defaults[rec.name] = sites.scalar_defaults(rec)
        return self._defaults[rec.name]


class RecordingOps:
    """``model.ops`` with every captured method recording its call first (then delegating to the
    wrapped ``Ops`` with the same arguments); other attributes are the wrapped object's."""

    def __init__(self, inner, recorder: Recorder):
        self._inner = inner
        self._recorder = recorder
        for name, site in sites.SITES.items():
            setattr(self, name, self._wrap(name, site))

    def _wrap(self, name: str, site: Site):
        method = getattr(self._inner, name)
        signature = inspect.signature(method)
        recorder = self._recorder

        def call(*args, **kwargs):
            if site.op is None:
                recorder.uncaptured[name] += 1
            else:
                caller = sys._getframe(1)
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                code = caller.f_code
                recorder.add(site, f"{getattr(code, 'co_qualname', code.co_name)}:{caller.f_lineno}",
                             dict(bound.arguments))
            return method(*args, **kwargs)

        call.__name__ = name
        return call

    def __getattr__(self, name):  # a method the model calls that sites.SITES does not list
        value = getattr(self._inner, name)
        if callable(value) and not name.startswith("_"):
            self._recorder.uncaptured[name] += 1
        return value


@contextlib.contextmanager
def recording(model, recorder: Recorder):
    """Record ``model``'s op calls into ``recorder`` inside the block. Decode steps replayed from a
    captured CUDA graph make no op calls from Python: load the model with ``cuda_graphs=False`` (its
    eager decode computes the same bits)."""
    if getattr(model, "cuda_graphs", False):
        raise ValueError("recording: the model replays decode steps from CUDA graphs, which make no op "
                         "calls from Python; load it with cuda_graphs=False")
    inner = model.ops
    model.ops = RecordingOps(inner, recorder)
    try:
        yield recorder
    finally:
        model.ops = inner
