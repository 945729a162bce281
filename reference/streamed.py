"""Weights applied straight from their storage bits: ``x @ W.T`` without the float64 ``W``.

At decode (a few tokens) a linear layer reads each weight once and does two flops with it, so on a
CPU its cost is memory traffic. Upcasting a whole bf16 weight first writes 8 bytes per weight to
fresh pages and reads them back (24.7 GB per 48B decode step for 6.2 GB of bf16). Here the weight
is taken in row blocks that stay in a core's cache: each block's bits are checked finite, widened
to float64 (exactly: an integer shift for bf16) into a reused buffer, and multiplied, the blocks
spread over every core (NumPy's loops and BLAS release the GIL), BLAS at one thread inside them.
Every output element is still the dot product of the same float64 values, so the result is
``x @ W.T`` of the upcast weight up to the rounding of the sums.

``linear(x, w)`` is the one place the ops compute ``x @ w.T`` with a weight that may be streamed:
``w`` is a float64 array, or a ``StreamedWeight`` (``moe.swiglu``, ``embed.lm_head`` and the model's
projections take either). NumPy only: a GPU converts a whole tensor at memory speed, so the torch
executor keeps whole float64 weights.

Row by row (``linear_rows``, ``linear_from_storage(..., row_by_row=True)``): each row of ``x`` is
its own ``[1, D] @ W.T`` call, so a row's product has the same bits whatever rows are beside it (a
batched decode step equals each sequence's own step). A ``[B, D] @ W.T`` GEMM does not promise
that: a BLAS runs one row as a GEMV and several as a GEMM, which sum in other orders (most
elements of ``[5, D] @ W.T`` differ in their last bits from the rows' own products, with OpenBLAS
0.3.31 under NumPy and MKL 2024.2 under torch: ``tests/reference/test_decode_batch.py``). Streamed,
the rows share each block while it sits in a core's cache: the weight is still read from memory
once for all B rows.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import wait

import numpy as np

from kimi.storage import cpu_count, pool

from .executor import namespace

BLOCK = 1 << 17  # weights per block: 1 MB of float64 + 0.5 MB of uint32 scratch per core (L2-sized)
# tasks per product at most (None: one per core). Four: on the H200 machine's 16 cores one streamed
# product ran fastest on 4 (lm_head 163840 x 2304: 262 ms on 4, 406 on 8, 643 on 16; an expert's
# w1 1024 x 2304: 2.5, 3.7, 5.3 ms; `python benchmarks/reference_model.py cpu-checkpoint`,
# stream_sweep): past four threads the blocks contend for memory bandwidth.
THREADS: int | None = 4
# and at most one task per BLOCK / 2 weights: handing out a task costs ~10-20 us of the calling
# thread, ~BLOCK / 10 weights of work (so a 128 x 2304 weight runs as 5 tasks, not 16)

# storage -> (unsigned view of its bits, mask of all but the sign, bits of +inf): a value is not
# finite exactly when its exponent is all ones, i.e. (bits & mask) >= inf
_BITS = {"bfloat16": (np.uint16, 0x7FFF, 0x7F80), "float16": (np.uint16, 0x7FFF, 0x7C00),
         "float32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
         "float64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
_RAW = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


class NonFiniteBlock(ValueError):
    """A block of a streamed weight holds a non-finite value (the caller names the tensor)."""

    def __init__(self, row: int):
        super().__init__(f"non-finite weight in the block starting at row {row}")
        self.row = row


class StreamedWeight:
    """A weight ``[N, D]`` that is applied by a function, not handed out as an array:
    ``apply(x) = x @ W.T`` (``x [T, D]`` float64, result ``[T, N]``). Streamed from its storage bits
    (never held whole in float64), or applied row by row (``Weights.row_by_row``). ``shape`` and
    ``ndim`` as an array's."""

    __slots__ = ("shape", "ndim", "name", "_apply")

    def __init__(self, shape: tuple[int, int], apply: Callable, name: str = ""):
        self.shape, self.ndim, self.name, self._apply = tuple(shape), len(shape), name, apply

    def apply(self, x):
        return self._apply(x)

    def __repr__(self) -> str:
        return f"StreamedWeight({self.name!r}, shape={self.shape})"


def linear(x, w):
    """``x @ w.T``: ``x [T, D]``, ``w [N, D]`` a float64 array of ``x``'s library or a
    ``StreamedWeight``; returns ``[T, N]``."""
    if isinstance(w, StreamedWeight):
        return w.apply(x)
    return x @ w.T


def linear_rows(x, w):
    """``x @ w.T`` one row at a time: row ``t`` is the product ``x[t:t+1] @ w.T`` whatever the other
    rows (module docstring). ``x [T, D]``, ``w [N, D]`` float64 arrays of one library; ``[T, N]``."""
    if x.shape[0] == 1:
        return x @ w.T
    xp = namespace(x, w)
    return xp.concat([x[t:t + 1, ...] @ w.T for t in range(x.shape[0])], axis=0)


def arrays(*values):
    """``values`` without the streamed weights (for ``executor.namespace``)."""
    return [v for v in values if not isinstance(v, StreamedWeight)]


def linear_from_storage(x: np.ndarray, raw: np.ndarray, storage: str, *, row_by_row: bool = False) -> np.ndarray:
    """``x @ W.T`` for ``W`` = the float64 values of the storage bits ``raw [N, D]`` (``uint16`` for
    bf16, ``float16``, ``float32``, ``float64``, as ``WeightSource.get_raw``; a read-only memmap view
    is fine), computed in row blocks of about ``BLOCK`` weights on every core; ``W`` never exists
    whole in float64. ``x``: ``[T, D]`` or ``[D]`` float64. ``row_by_row``: each row of ``x`` its
    own product with each block (the blocks do not depend on ``T``), so row ``t`` has the bits of
    ``linear_from_storage(x[t:t+1], ...)``. Raises ``NonFiniteBlock`` before returning anything
    when a value of ``W`` is not finite."""
    if storage not in _BITS:
        raise ValueError(f"unsupported storage dtype {storage!r}; expected one of {sorted(_BITS)}")
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.dtype != _RAW[storage]:
        raise TypeError(f"raw: expected [N, D] {np.dtype(_RAW[storage])} bits of {storage}, got "
                        f"{raw.dtype} {raw.shape}")
    x = np.asarray(x, dtype=np.float64)
    vector = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if vector else x)
    N, D = raw.shape
    if x2.ndim != 2 or x2.shape[1] != D:
        raise ValueError(f"linear: expected x [T, {D}] for a weight {raw.shape}, got {x.shape}")
    out = np.empty((x2.shape[0], N), dtype=np.float64)
    tasks = max(1, min(THREADS or cpu_count(), -(-raw.size // (BLOCK // 2))))
    # the same number of blocks for every task (a contiguous range of rows each), at most BLOCK
    # weights a block (at least one row)
    per_task = max(1, -(-raw.size // (BLOCK * tasks)))
    rows = max(1, -(-N // (per_task * tasks)))
    product = _by_row if row_by_row else np.matmul
    if tasks == 1:
        bad = _rows(x2, raw, storage, out, 0, N, rows, product)
    else:
        step = per_task * rows
        with _BLAS_ONE_THREAD:
            jobs = [pool().submit(_rows, x2, raw, storage, out, lo, min(N, lo + step), rows, product)
                    for lo in range(0, N, step)]
            wait(jobs)  # every task has finished before anything is raised or BLAS is reset
        bad = min((r for r in (j.result() for j in jobs) if r is not None), default=None)
    if bad is not None:
        raise NonFiniteBlock(bad)
    return out[0] if vector else out


_LOCAL = threading.local()


def source_linear(source, name: str, x: np.ndarray, *, row_by_row: bool = False) -> np.ndarray:
    """``x @ W.T`` (float64 NumPy, ``x [T, D]`` or ``[D]``) for the weight ``W = source.get(name)``
    ``[N, D]`` of a ``kimi.checkpoint.WeightSource``, computed from its storage bits in
    cache-sized row blocks on every core (``linear_from_storage``; ``row_by_row``: each row of ``x``
    on its own, its bits independent of the other rows): the float64 ``W`` never exists whole. A
    non-finite weight raises ``CheckpointError`` naming the tensor, as ``get`` does, and no result."""
    dtype = source.storage_dtype(name)
    parts = []
    try:
        for raw in source.raw_parts(name):
            parts.append(linear_from_storage(x, raw, dtype, row_by_row=row_by_row))
    except NonFiniteBlock:
        raise source.nonfinite_error(name) from None
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)


def source_streamed(source, name: str, *, row_by_row: bool = False) -> StreamedWeight:
    """``name`` of ``source`` as a ``StreamedWeight`` (applied by ``source_linear``, never upcast
    whole)."""
    return StreamedWeight(source.shape(name), lambda x: source_linear(source, name, x, row_by_row=row_by_row), name)


def scratch_bytes() -> int:
    """Bytes of block scratch the streamed products may hold: uint32 and float64 for fewer than
    ``2 * BLOCK`` weights (a block rounded up to whole rows of fewer than BLOCK weights) per
    worker and the calling thread."""
    return (cpu_count() + 1) * 2 * BLOCK * 12


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's reused scratch for ``n`` weights: uint32 (the shifted bf16 bits, and before
    them the finiteness check of 16/32-bit storage) and float64 (the widened block, or the check
    of float64 storage)."""
    b = getattr(_LOCAL, "buffers", None)
    if b is None or b[1].size < n:
        b = _LOCAL.buffers = (np.empty(n, np.uint32), np.empty(n, np.float64))
    return b


def _block_views(storage: str, k: int, D: int):
    """(check, shifted, wide) views of this thread's buffers for a block of ``k`` rows."""
    wide32, f64 = _buffers(k * D)
    bits = _BITS[storage][0]
    check = (f64.view(bits) if bits == np.uint64 else wide32.view(bits))[:k * D].reshape(k, D)
    return check, wide32[:k * D].reshape(k, D), f64[:k * D].reshape(k, D)


def _by_row(x: np.ndarray, w_t: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ w_t``, one row of ``x`` at a time (``np.matmul``'s signature, ``out`` given)."""
    for t in range(x.shape[0]):
        np.matmul(x[t:t + 1], w_t, out=out[t:t + 1])


def _rows(x: np.ndarray, raw: np.ndarray, storage: str, out: np.ndarray, lo: int, hi: int,
          rows: int, product=np.matmul) -> int | None:
    """``out[:, lo:hi] = x @ W[lo:hi].T`` in blocks of ``rows`` rows, each block's product by
    ``product(x, block.T, out=...)``; the first row of a block that holds a non-finite value (its
    product is not computed), else None. Few NumPy calls per block: each one takes the GIL that the
    other cores' blocks wait for."""
    bits, mask, inf = _BITS[storage]
    mask, inf = bits(mask), bits(inf)
    k = None
    for s in range(lo, hi, rows):
        e = min(hi, s + rows)
        if e - s != k:
            k = e - s
            check, shifted, wide = _block_views(storage, k, raw.shape[1])
            wide_t, as_f32 = wide.T, shifted.view(np.float32)
        block = raw[s:e]
        np.bitwise_and(block.view(bits), mask, out=check)
        if np.maximum.reduce(check, axis=None) >= inf:
            return s
        if storage == "bfloat16":  # bf16 is the top half of a float32: shift, reinterpret, widen
            np.left_shift(block, _SIXTEEN, out=shifted)
            np.copyto(wide, as_f32)
            product(x, wide_t, out=out[:, s:e])
        elif storage == "float64":
            product(x, block.T, out=out[:, s:e])
        else:
            np.copyto(wide, block)
            product(x, wide_t, out=out[:, s:e])
    return None


_SIXTEEN = np.uint32(16)


class _BlasOneThread:
    """BLAS at one thread while blocks run on every core (a BLAS that threads each of sixteen
    concurrent small products oversubscribes the cores: 1.4x slower on 2 cores). Re-entrant and
    shared: the first to enter saves the thread counts, the last to leave restores them. Without
    threadpoolctl the counts stay as they are (same results, slower)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list = []
        self._libs: list | None = None

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._saved = [(c, c.get_num_threads()) for c in self._controllers()]
                for c, _ in self._saved:
                    c.set_num_threads(1)
            self._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for c, n in self._saved:
                    c.set_num_threads(n)
        return False

    def _controllers(self) -> list:
        if self._libs is None:
            try:
                from threadpoolctl import ThreadpoolController  # why: optional: caps BLAS threads where installed
            except ImportError:
                self._libs = []
            else:
                self._libs = ThreadpoolController().select(user_api="blas").lib_controllers
        return self._libs


_BLAS_ONE_THREAD = _BlasOneThread()
