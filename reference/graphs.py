"""CUDA graphs of a decode step's fixed-shape parts: the torch executor on a GPU, one token.

A 48B decode step of one token launches about 6k small kernels. Issued one at a time from Python,
the host is the bottleneck, not the GPU. A CUDA graph records a part's kernels once and replays
them with one launch. The kernels and their shapes stay the same, so a replay has the same bits
as the eager part (tested on the GPU).

The model graphs:
- each KDA layer whole: its input norm, the conv and recurrence steps, the FFN and residuals;
- each MLA layer's token-wise halves. Its attention over a cache that grows every step runs eagerly
  between them;
- the head.

What a graphed part may do: the same shapes for its key; no host wait (no ``.item()``, no host
lists of device values); no host-to-device copy. Its weights must outlive the graph: the shared
tensors, or LRU arrays, which the graph keeps alive.

A part runs eagerly the first time. Its weights are fetched and checked finite then. It is captured
the second time and replayed after that.

Checks still due when a part is captured are held by the graph: they are recomputed at every
replay and queued for the call's ``Weights.verify``.

If a capture fails, graphs are turned off for the model (``disabled`` says why), and its steps run
eagerly as before. torch is imported only here, and only when a graph is captured.
"""
from __future__ import annotations

from collections.abc import Callable


class StepGraphs:
    """The captured parts of one model's decode step, by key: ``run(key, fn, *inputs)`` is
    ``fn(*inputs)`` (a tuple of arrays), eager the first time, captured the second, replayed
    after. ``weights``: the model's ``Weights`` (its LRU and its pending finiteness checks)."""

    def __init__(self, weights):
        self._w = weights
        self._graphs: dict = {}
        self._seen: set = set()
        self._pool = None  # one memory pool for every part: they replay one after another, in order
        self.disabled: str | None = None

    def run(self, key, fn: Callable, *inputs) -> tuple:
        if self.disabled is not None:
            return fn(*inputs)
        key = (key, *(tuple(a.shape) for a in inputs))
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                return fn(*inputs)
            try:
                graph = _Graph(fn, inputs, self._w, self._pool)
            except Exception as exc:  # noqa: BLE001 - any failure: this part, and the rest, eagerly
                self.disabled = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                self._graphs.clear()
                return fn(*inputs)
            self._graphs[key] = graph
            self._pool = graph.pool
        return graph.replay(inputs, self._w)

    def __len__(self) -> int:
        return len(self._graphs)


class _Graph:
    """One captured part: static input copies, the graph, its outputs and the checks it holds."""

    def __init__(self, fn: Callable, inputs, weights, pool):
        import torch  # why: optional: the array-API reference runs without torch

        self.inputs = [a.clone() for a in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a run on the capturing stream first (its library handles)
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.kept: list = []  # LRU arrays the graph reads
        mark = len(weights.pending)
        weights.capture = self.kept
        try:
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs = tuple(fn(*self.inputs))
        finally:
            weights.capture = None
            # sums queued during the capture are computed by each replay, not by the capture
            self.checks = weights.pending[mark:]
            del weights.pending[mark:]
        self.pool = self.graph.pool()

    def replay(self, inputs, weights) -> tuple:
        for mine, a in zip(self.inputs, inputs):
            mine.copy_(a)
        self.graph.replay()
        weights.pending.extend(self.checks)
        return tuple(o.clone() for o in self.outputs)  # the next replay overwrites the graph's own
