"""CUDA-graph capture and replay of the optimized model's decode step (``load(..., cuda_graphs=True)``).

A decode step is ~15 launches per layer; at small batches their host time, not the GPU, sets the
step time. ``DecodeGraphs`` captures the model's eager step (``Model._decode_step``: embedding, the
stack, the logits, over exactly ``decode_tile`` rows) once and replays it.

- Static inputs, one set per graph: token ids ``[tile]``, KDA/conv slot ids ``[tile]`` and a
  ``DecodeBatch`` (block tables ``[tile, W]``, seq_lens ``[tile]``, slot mapping ``[tile]``). Before
  each replay they are filled with ``copy_`` from the step's freshly built tensors (outside the
  graph); the tables' columns past the step's own width are zeroed (never read: a row reads only the
  blocks of its ``seq_lens``). The output, logits ``[B, vocab]``, is allocated by the capture; a
  replay returns a copy of it.
- Key: the pool (a weak key: its graphs go with it), then B, the number of real rows (the routed
  experts run on ``x[:B]``). Each graph remembers the signature it was captured under: the table
  width ``W = pool.num_blocks`` (no sequence owns more; fixed until the pool grows) and the
  addresses of the pool's state tensors. A pool whose signature changed (``_grow`` reallocated the
  paged cache) drops all its graphs and recaptures on demand; at most ``MAX_GRAPHS_PER_POOL`` per
  pool (least recently used dropped). All graphs of a model share one memory pool.
- Capture: the static inputs hold an all-padding step (token 0, slot -1, and the pool's padding
  rows ``pool.decode_batch([], tile)``: slot mapping -1, block 0), so the warm-up (one eager step on a side stream: Triton compiles, cuBLAS workspace) and
  the capture write no state. The kernel counters (``optimized._counters``) of both are rolled back;
  each replay records one step's launches, as the eager step would.

Bitwise: the replay runs the eager step's kernels with the same launch configurations on the same
shapes; only the block-table width differs from the eager step (``W`` against the longest table),
and the paged MLA decode never reads it (lengths come from ``seq_lens``, the key slices from the
length and the fixed split count), so the logits are bitwise the eager ones.
"""
from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from . import _counters
from .cache import CachePool, DecodeBatch

MAX_GRAPHS_PER_POOL = 8


def _signature(pool: CachePool) -> tuple:
    """What a captured step baked in: the table width and the state tensors' addresses."""
    ptrs = [t.data_ptr() for st in pool.kda.values() for t in (st.conv, st.state)]
    ptrs += [c.kv.data_ptr() for c in pool.mla.values()]
    return pool.num_blocks, tuple(ptrs)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    signature: tuple
    ids: torch.Tensor  # [tile] int64
    slots: torch.Tensor  # [tile] int64
    batch: DecodeBatch  # [tile, W], [tile], [tile]
    logits: torch.Tensor  # [B, vocab], written by each replay
    launches: Counter  # the kernel counters of one step


class DecodeGraphs:
    """Captured decode steps of one model, per pool and B (see the module docstring)."""

    def __init__(self, device: torch.device, tile: int):
        self.device, self.tile = device, tile
        self.mempool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.pools: weakref.WeakKeyDictionary[CachePool, OrderedDict[int, _Graph]] = weakref.WeakKeyDictionary()

    def run(self, step, pool: CachePool, B: int, ids: torch.Tensor, slots: torch.Tensor,
            batch: DecodeBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the step ``step(ids, slots, batch, pool, B)`` (``Model._decode_step``)
        over ``ids``/``slots [tile]`` and ``batch``, by graph replay (captured on first use)."""
        sig = _signature(pool)
        graphs = self.pools.setdefault(pool, OrderedDict())
        if any(g.signature != sig for g in graphs.values()):
            graphs.clear()  # the paged cache was reallocated: every graph points at freed storage
        g = graphs.get(B)
        if g is None:
            while len(graphs) >= MAX_GRAPHS_PER_POOL:
                graphs.popitem(last=False)
            g = graphs[B] = self._capture(step, pool, B, sig)
        graphs.move_to_end(B)
        w = batch.block_tables.shape[1]
        g.ids.copy_(ids)
        g.slots.copy_(slots)
        g.batch.block_tables[:, :w].copy_(batch.block_tables)
        g.batch.block_tables[:, w:].zero_()
        g.batch.seq_lens.copy_(batch.seq_lens)
        g.batch.slot_mapping.copy_(batch.slot_mapping)
        with torch.cuda.device(self.device):
            g.graph.replay()
        _counters.launches.update(g.launches)
        return g.logits[:B].clone()

    def _capture(self, step, pool: CachePool, B: int, sig: tuple) -> _Graph:
        tile, dev = self.tile, self.device
        ids = torch.zeros(tile, dtype=torch.int64, device=dev)
        slots = torch.full((tile,), -1, dtype=torch.int64, device=dev)
        pad = pool.decode_batch([], tile)  # a step of padding rows only, as the pool describes them
        tables = torch.zeros((tile, sig[0]), dtype=pad.block_tables.dtype, device=dev)
        tables[:, :pad.block_tables.shape[1]] = pad.block_tables
        batch = DecodeBatch(tables, pad.seq_lens.clone(), pad.slot_mapping.clone())
        saved = _counters.snapshot()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(dev):
                # warm-up, then capture, on one side stream; every row is padding: nothing is written
                self.stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(self.stream):
                    step(ids, slots, batch, pool, B)
                torch.cuda.current_stream(dev).wait_stream(self.stream)
                before = _counters.snapshot()
                # one memory pool for all graphs of the model (as vLLM's per-batch-size graphs): a
                # graph's inputs live outside it and its output stays allocated: only temporaries are
                # shared, and replays are issued one at a time
                with torch.cuda.graph(graph, pool=self.mempool, stream=self.stream):
                    logits = step(ids, slots, batch, pool, B)
                launches = _counters.snapshot() - before
        finally:
            _counters.launches.clear()
            _counters.launches.update(saved)
        return _Graph(graph, sig, ids, slots, batch, logits, launches)
