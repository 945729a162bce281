"""The float64 model's weights: fetched as they are used, through a byte-bounded LRU.

Each weight is read from its storage bits (bf16) and converted to float64 on the executor's device
(or taken from ``shared`` tensors already on the device, e.g. the optimized model's bf16 weights);
routed experts one at a time for the ids the router picked, embedding rows by id and the lm_head
in row blocks, so the float64 model (393 GB at kimi-linear-48b) is never materialized. On NumPy,
when the LRU cannot hold every weight, the linear layers of a call of at most ``STREAM_TOKENS``
tokens are applied straight from the storage bits (``reference.streamed``): no float64 copy of
such a weight exists at all. Inside ``Weights.row_by_row`` (``Model.decode_batch``) every product
is taken one row at a time (``reference.streamed``): a sequence's numbers do not depend on its
batch.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from kimi.checkpoint import CheckpointError, WeightSource
from kimi.tensors import expert_name

from .executor import Executor, to_numpy
from .streamed import StreamedWeight, linear, linear_rows, source_linear, source_streamed

def get_on(source: WeightSource, name: str, executor: Executor, *, pending: list | None = None):
    """``source.get(name)`` as float64 on ``executor``, validated like ``get``. The bits are read on
    the host and converted on the device (a GPU copies 2 bytes per bf16 weight, not 8), or made
    there by a source that generates its values (``WeightSource.values_on``). With ``pending`` (a
    list) the finiteness check is queued there (``Weights.verify``) instead of synchronizing with the
    device now."""
    if executor.name == "numpy":
        return source.get(name)
    return _on(source, name, None, executor, pending)


def get_rows_on(source: WeightSource, name: str, rows, executor: Executor, *, pending: list | None = None):
    """``source.get_rows(name, rows)`` on ``executor`` (as ``get_on``)."""
    if executor.name == "numpy":
        return source.get_rows(name, rows)
    return _on(source, name, rows, executor, pending)


def _on(source: WeightSource, name: str, rows, executor: Executor, pending: list | None):
    made = source.values_on(name, rows, executor.xp, executor.device)
    if made is not None:
        values = executor.round_to_storage(made, source.storage_dtype(name))
    else:
        raw = source.get_raw(name) if rows is None else source.get_raw_rows(name, rows)
        values = executor.from_storage(raw, source.storage_dtype(name))
    return check_finite_on(source, name, values, executor, pending=pending)


def check_finite_on(source: WeightSource, name: str, values, executor: Executor, *, pending: list | None = None):
    """``values`` (of ``name``, on ``executor``) if all finite (one reduction on the device), else
    ``CheckpointError``; with ``pending``, the reduction is queued as ``((name,), sum, False)`` and
    checked by ``Weights.verify``."""
    total = executor.xp.sum(values)
    if pending is not None:
        pending.append(((name,), total, False))
        return values
    if math.isfinite(float(total)):
        return values
    return source.check_finite(name, to_numpy(values))


WEIGHT_CACHE_BYTES = 64 << 20  # default LRU of float64 weights: all of tiny/small, a few tensors of 48b
EXPERT_CHECK_BYTES = 1 << 29  # a stack of shared experts is checked finite in blocks of this much float64
STREAM_TOKENS = 64  # NumPy streams a linear layer's weight (``streamed``) for calls of at most this many
# tokens: there the bf16 -> float64 upcast is the cost; a longer call reuses each float64 weight
# for enough tokens that converting it whole and multiplying with threaded BLAS is as fast


class Weights:
    """float64 weights on the executor, from ``shared`` tensors or the source, through a byte-bounded
    LRU of ``budget`` bytes (NumPy arrays handed out read-only). ``weights(name)`` is the array."""

    def __init__(self, source: WeightSource, executor: Executor, budget: int,
                 shared: Mapping | None = None):
        self.source, self.ex, self.budget = source, executor, budget
        self.shared = shared or {}
        self._lru: OrderedDict[str, object] = OrderedDict()
        self._bytes = 0
        # finiteness of weights fetched during a call, checked at its end in one device sync
        # (a sync per tensor costs ~1200 round trips per 48B decode step); NumPy checks at once.
        # Entries: (names, sum of their values, whether a pass is remembered)
        self.pending: list | None = None if executor.name == "numpy" else []
        # shared tensors found finite: resident and never written, so checked once, not at
        # every fetch (a sum per fetched tensor was ~1200 reductions per 48B decode step)
        self.checked: set[str] = set()
        # NumPy applies the linear layers' weights from their storage bits (``streamed``) when the
        # LRU cannot hold every weight (48B: each step would upcast 3.1 G weights into fresh
        # float64 arrays and evict them); a model whose weights all fit is upcast once.
        self.streams = executor.name == "numpy" and not self.shared and not _fits(source, budget)
        self.by_row = False  # inside ``row_by_row``
        # while a CUDA graph is captured (``reference.graphs``): a list that keeps every array the
        # LRU hands out alive (the graph reads its memory at every replay), and nothing fetched
        # inside the capture enters the LRU (its values exist only once the graph replays)
        self.capture: list | None = None
        self._stacks: dict = {}  # (layer, which) -> (expert names, their stacked view or None)

    def __call__(self, name: str):
        a = self._lru.get(name)
        if a is not None:
            self._lru.move_to_end(name)
            if self.capture is not None:
                self.capture.append(a)
            return a
        a = self.ex.freeze(self._fetch(name))
        if self.capture is not None:
            return a
        nbytes = math.prod(a.shape) * 8
        if nbytes <= self.budget // 4:
            self._lru[name] = a
            self._bytes += nbytes
            while self._bytes > self.budget:
                _, old = self._lru.popitem(last=False)
                self._bytes -= math.prod(old.shape) * 8
        return a

    def _fetch(self, name: str):
        if name not in self.shared:
            return get_on(self.source, name, self.ex, pending=self.pending)
        return self._check((name,), self._shared(name), remember=True)

    def _shared(self, name: str):
        """The shared tensor ``name`` as float64 in its checkpoint shape (unchecked)."""
        t, shape = self.shared[name], self.source.shape(name)
        if math.prod(t.shape) != math.prod(shape):
            raise ValueError(f"shared_weights[{name!r}]: expected shape {shape}, got {tuple(t.shape)}")
        try:
            a = self.ex.from_storage(t, self.source.storage_dtype(name))
        except TypeError as exc:
            raise ValueError(f"shared_weights[{name!r}]: {exc}") from None
        return self.ex.xp.reshape(a, shape)

    def _check(self, names: tuple, values, *, remember: bool):
        """``values`` (of the shared tensors ``names``; shared tensors need the torch executor, so
        checks are queued) with their finiteness check queued, unless every one of them was found
        finite before (``remember``: whole tensors or fixed blocks of rows, not rows by id)."""
        if remember:  # a sum over values checked before too: only the others can make it non-finite
            names = tuple(n for n in names if n not in self.checked)
            if not names:
                return values
        self.pending.append((names, self.ex.xp.sum(values), remember))
        return values

    def rows(self, name: str, rows: np.ndarray):
        """float64 rows (host int64 indices) of ``name`` along its first axis."""
        t = self.shared.get(name)
        if t is None:
            return get_rows_on(self.source, name, rows, self.ex, pending=self.pending)
        if _contiguous(rows):  # a block of rows (the lm_head's): remembered under its range
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            values = self.ex.from_storage(t[lo:hi], self.source.storage_dtype(name))
            return self._check((f"{name}[{lo}:{hi}]",), values, remember=True)
        values = self.ex.from_storage(t[self.ex.ints(rows)], self.source.storage_dtype(name))
        return self._check((name,), values, remember=False)

    def gather(self, names: list[str]):
        """The float64 tensors ``names`` (of one shape) stacked ``[n, ...]``: shared ones stacked
        in their storage dtype and converted at once (two device ops for any ``n``), others
        through the LRU."""
        if not all(n in self.shared for n in names):
            return self.ex.xp.stack([self(n) for n in names], axis=0)
        shape = self.source.shape(names[0])
        raw = self.ex.xp.stack([self.shared[n] for n in names], axis=0)
        if math.prod(raw.shape) != len(names) * math.prod(shape):
            raise ValueError(f"shared_weights[{names[0]!r}]...: expected shape {shape}, got {tuple(raw.shape[1:])}")
        values = self.ex.xp.reshape(self.ex.from_storage(raw, self.source.storage_dtype(names[0])),
                                    (len(names), *shape))
        return self._check(tuple(names), values, remember=True)

    def gather_ids(self, layer: int, which: str, count: int, ids):
        """Experts ``which`` (w1, w2, w3) of MoE layer ``layer`` at the device ids ``ids [n]``,
        stacked ``[n, ., .]`` float64: the values of ``gather`` of their names. Where the ``count``
        experts are shared as views of one stacked tensor (``Executor.stacked_view``) the rows are
        taken by the device ids, so nothing waits for the device (a CUDA graph can hold it), and
        the whole stack is checked finite once; else the ids are read on the host."""
        entry = self._stacks.get((layer, which))
        if entry is None:
            names = tuple(expert_name(layer, e, which) for e in range(count))
            shared = all(n in self.shared for n in names)
            stacked = self.ex.stacked_view([self.shared[n] for n in names]) if shared else None
            entry = self._stacks[(layer, which)] = (names, stacked)
        names, stacked = entry
        if stacked is None:
            return self.gather([names[e] for e in to_numpy(ids).tolist()])
        storage = self.source.storage_dtype(names[0])
        if not self.checked.issuperset(names):  # resident and never written: checked once, whole
            block = max(1, EXPERT_CHECK_BYTES // (math.prod(stacked.shape[1:]) * 8))
            for lo in range(0, count, block):
                self._check(names[lo:lo + block], self.ex.from_storage(stacked[lo:lo + block], storage),
                            remember=True)
        xp = self.ex.xp
        values = self.ex.from_storage(xp.take(stacked, ids, axis=0), storage)
        return xp.reshape(values, (ids.shape[0], *self.source.shape(names[0])))

    def verify(self) -> None:
        """Raise for a non-finite weight fetched and not yet checked (``CheckpointError`` naming
        it); the LRU is emptied then, so no unchecked weight is ever used again."""
        if not self.pending:
            return
        entries = list(self.pending)
        self.pending.clear()
        xp = self.ex.xp
        finite = to_numpy(xp.isfinite(xp.stack([total for _, total, _ in entries]))).tolist()
        for (names, _, remember), ok in zip(entries, finite):
            if ok and remember:
                self.checked.update(names)
        bad = [names for (names, _, _), ok in zip(entries, finite) if not ok]
        if bad:
            self._lru.clear()
            self._bytes = 0
            for names in bad:
                for n in names:  # element by element: raises naming the first bad tensor
                    check_finite_on(self.source, n.split("[")[0], self._recheck(n), self.ex)
            raise CheckpointError(f"{', '.join(bad[0])}: a non-finite sum of finite weights")

    def _recheck(self, name: str):
        """What was fetched as ``name`` (``tensor[lo:hi]`` for a block of rows), fetched again."""
        base, _, span = name.partition("[")
        if base not in self.shared:
            return get_on(self.source, base, self.ex)
        if span:
            lo, hi = (int(v) for v in span.rstrip("]").split(":"))
            return self.ex.from_storage(self.shared[base][lo:hi], self.source.storage_dtype(base))
        return self._shared(base)

    def all_shared(self) -> bool:
        """Whether every weight of the source is read from a shared device tensor."""
        return bool(self.shared) and all(n in self.shared for n in self.source.names())

    def small(self, name: str) -> bool:
        """Whether the LRU keeps ``name`` (so it is fetched whole, not by rows)."""
        return math.prod(self.source.shape(name)) * 8 <= self.budget // 4

    @contextmanager
    def row_by_row(self):
        """Within it, every product ``x @ W.T`` these weights apply (``linear``, ``operand``,
        ``applied``, ``streamed``) is taken one row of ``x`` at a time (``streamed.linear_rows``):
        a row's bits do not depend on the rows beside it. ``Model.decode_batch`` runs in it."""
        before, self.by_row = self.by_row, True
        try:
            yield
        finally:
            self.by_row = before

    def linear(self, name: str, x):
        """``x @ W.T`` for ``x [T, D]`` and the weight ``name`` ``[N, D]``: from the storage bits
        where the model streams (calls of at most ``STREAM_TOKENS`` tokens; any number row by row),
        else with the float64 weight. What the LRU holds now never decides it: a call's numbers do
        not depend on the calls before it (a corpus decoded in batches runs its calls in another
        order than one prompt at a time)."""
        if self.streams and (self.by_row or x.shape[0] <= STREAM_TOKENS):
            return source_linear(self.source, name, x, row_by_row=self.by_row)
        return self.applied(self(name))(x)

    def linears(self, names: list[str], x) -> list:
        """``[x @ W.T for W in names]``, the weights of one input width: shared tensors outside
        ``row_by_row`` concatenated into one product (two launches for any number of them, and one
        fetch), else one ``linear`` each."""
        if self.by_row or self.streams or not all(n in self.shared for n in names):
            return [self.linear(n, x) for n in names]
        y = x @ self.ex.xp.matrix_transpose(self.gather_rows(names))
        out, lo = [], 0
        for n in names:
            rows = self.source.shape(n)[0]
            out.append(y[:, lo:lo + rows])
            lo += rows
        return out

    def gather_rows(self, names: list[str]):
        """The float64 matrices ``names`` (shared, one width) stacked by rows: ``[sum N_i, D]``."""
        xp = self.ex.xp
        mats = [xp.reshape(self.shared[n], self.source.shape(n)) for n in names]
        values = self.ex.from_storage(xp.concat(mats, axis=0), self.source.storage_dtype(names[0]))
        return self._check(tuple(names), values, remember=True)

    def applied(self, w):
        """``x -> x @ w.T`` for a float64 array ``w`` (row by row inside ``row_by_row``)."""
        return (lambda x: linear_rows(x, w)) if self.by_row else (lambda x: linear(x, w))

    def operand(self, name: str):
        """The weight ``name`` as an op's ``x @ W.T`` operand (``moe.swiglu``): applied by
        ``linear`` where the model streams or inside ``row_by_row``, else the float64 array."""
        if self.streams or self.by_row:
            return StreamedWeight(self.source.shape(name), lambda x: self.linear(name, x), name)
        return self(name)

    def operand_of(self, w, name: str = ""):
        """A float64 array ``w`` (a block of rows of a weight) as an op's operand: ``w`` itself, or
        inside ``row_by_row`` a ``StreamedWeight`` applying it row by row."""
        return StreamedWeight(tuple(w.shape), self.applied(w), name) if self.by_row else w

    def streamed(self, name: str) -> StreamedWeight:
        """``name`` applied from its storage bits (``streamed.source_streamed``; row by row inside
        ``row_by_row``)."""
        return source_streamed(self.source, name, row_by_row=self.by_row)

    def experts(self, layer: int, which: str, count: int) -> Experts:
        """Expert matrices ``which`` (w1, w2, w3) of MoE layer ``layer``, loaded on demand."""
        return Experts(self, layer, which, count)


def _fits(source: WeightSource, budget: int) -> bool:
    """Whether an LRU of ``budget`` bytes keeps every float64 weight of ``source``."""
    sizes = [math.prod(source.shape(n)) * 8 for n in source.names()]
    return sum(sizes) <= budget and max(sizes, default=0) <= budget // 4


def _contiguous(rows: np.ndarray) -> bool:
    return rows.size > 0 and int(rows[-1]) - int(rows[0]) + 1 == rows.size and bool(np.all(np.diff(rows) == 1))


class Experts(Sequence):
    """``w[e]`` loads expert ``e``'s matrix on demand (what ``moe.experts`` indexes)."""

    def __init__(self, weights: Weights, layer: int, which: str, count: int):
        self._w, self._layer, self._which, self._count = weights, layer, which, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, e):
        e = int(e)
        if not 0 <= e < self._count:
            raise IndexError(f"expert {e} out of range [0, {self._count})")
        return self._w.operand(expert_name(self._layer, e, self._which))

    def gather_ids(self, ids):
        """Experts at the device ids ``ids [n]`` stacked ``[n, ., .]`` float64 (``Weights.gather_ids``)."""
        return self._w.gather_ids(self._layer, self._which, self._count, ids)

    def gather_experts(self, experts: list[int]):
        """Experts ``experts`` (host ids) stacked ``[n, ., .]`` float64 (``moe.experts(group=)``)."""
        bad = [e for e in experts if not 0 <= int(e) < self._count]
        if bad:
            raise IndexError(f"expert {bad[0]} out of range [0, {self._count})")
        return self._w.gather([expert_name(self._layer, int(e), self._which) for e in experts])
