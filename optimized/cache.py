"""Carried decode state of the optimized model, kept as a serving engine keeps it.

A ``CachePool`` holds the state of up to ``max_seqs`` sequences of one model:

- per KDA layer, two slot-indexed pools: the conv state ``conv [slots, 3C, W-1]`` (the last W-1
  pre-conv q/k/v projections, oldest first, stacked like the model's q/k/v conv taps; model dtype,
  exact since it only holds copies of projections) and the recurrent state
  ``state [slots, HV, K, V]`` (K-first; float32, float64 in float64 runs). Decode kernels update
  the rows named by the batch's slot ids in place and never touch the others.
- per MLA layer, a ``PagedLatentCache`` (``optimized.mla``): blocks of ``block_size`` positions, each
  position one ``[c ; k_pe]`` row (576 wide in the real model). A sequence owns a list of blocks (its
  block table; one table serves every MLA layer, as in vLLM); blocks are handed out by the pool on
  demand and returned on release. With ``num_blocks=None`` the block store grows (doubling) when it
  runs out; with a fixed ``num_blocks`` running out is an error.

A ``SequenceCache`` is one sequence's handle: its pool, its slot, its length. ``model.prefill``
returns one (in a private one-slot pool unless given ``pool.new_sequence()``), ``model.decode`` and
``model.decode_batch`` update them in place. ``to_reference()`` converts a sequence's state into the
reference ``ModelCache`` (float64), e.g. to compare carried states with the reference model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi.config import KimiConfig
from reference.cache import KDACache, MLACache, ModelCache

from .mla import PagedLatentCache

_INITIAL_BLOCKS_PER_SEQ = 4


@dataclass
class KDAState:
    conv: torch.Tensor  # [slots, 3C, W-1], model dtype
    state: torch.Tensor  # [slots, HV, K, V], float32 (float64 for float64 models)


@dataclass
class DecodeBatch:
    """The paged-cache view of one decode step over ``rows`` rows (B sequences, then padding)."""
    block_tables: torch.Tensor  # [rows, max_blocks] int32 (padding rows: block 0, never written)
    seq_lens: torch.Tensor  # [rows] int32: length after this step's token (padding rows: 0, idle)
    slot_mapping: torch.Tensor  # [rows] int64: where this step's latent goes (padding rows: -1)


class SequenceCache:
    """One sequence's handle into a ``CachePool``: ``pool``, ``slot``, ``length`` (tokens seen)."""

    def __init__(self, pool: "CachePool", slot: int):
        self.pool, self.slot, self.length = pool, slot, 0
        self.blocks: list[int] = []
        self.released = False

    def __repr__(self) -> str:
        return f"SequenceCache(slot={self.slot}, length={self.length}, blocks={len(self.blocks)})"

    def release(self) -> None:
        """Give the slot and the blocks back to the pool (the handle is unusable afterwards)."""
        if not self.released:
            self.pool._release(self)

    def to_reference(self):
        """This sequence's state as a reference ``ModelCache`` (float64 NumPy): conv states
        ``[C, W-1]`` per q/k/v, KDA state ``[H, K, V]``, MLA ``latent [S, L]`` and ``k_pe [S, R]``."""
        pool, c = self.pool, self.pool.config
        np64 = lambda t: t.detach().to("cpu", torch.float64).numpy()  # noqa: E731
        layers = []
        for i in range(c.num_hidden_layers):
            if c.is_kda_layer(i):
                st = pool.kda[i]
                conv = st.conv[self.slot]
                HK = c.kda_dim
                q, k, v = conv[:HK], conv[HK:2 * HK], conv[2 * HK:]
                layers.append(KDACache(np64(q), np64(k), np64(v), np64(st.state[self.slot])))
            else:
                latent, k_pe = pool.mla_gather(i, self, self.length)
                layers.append(MLACache(np64(latent), np64(k_pe)))
        return ModelCache(layers, self.length)


def sequence_bytes(config: KimiConfig, tokens: int, *, dtype: torch.dtype, block_size: int = 64) -> int:
    """Bytes one sequence of ``tokens`` positions holds in a ``CachePool`` of a model at ``dtype``:
    per KDA layer its conv state ``3C (W-1)`` at ``dtype`` and its recurrent state ``HV K V`` at
    float32 (float64 in a float64 model), per MLA layer its blocks of ``block_size`` rows of
    ``L+R``. A lower bound of the pool's own growth (doubling the block store when it runs out)."""
    c = config
    size = torch.empty((), dtype=dtype).element_size()
    state = 8 if dtype == torch.float64 else 4
    H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    kda = 3 * H * K * (W - 1) * size + H * K * K * state
    mla = -(-tokens // block_size) * block_size * (c.kv_lora_rank + c.qk_rope_head_dim) * size
    return sum(kda if c.is_kda_layer(i) else mla for i in range(c.num_hidden_layers))


class CachePool:
    """Slot-indexed KDA/conv state pools and paged MLA latent caches (see the module docstring)."""

    def __init__(self, config: KimiConfig, *, device: torch.device, dtype: torch.dtype,
                 state_dtype: torch.dtype, max_seqs: int = 1, block_size: int = 64,
                 num_blocks: int | None = None):
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs: expected a positive integer, got {max_seqs!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        self.config, self.device, self.dtype, self.state_dtype = config, device, dtype, state_dtype
        self.max_seqs, self.block_size = max_seqs, block_size
        self.growable = num_blocks is None
        n_blocks = max_seqs * _INITIAL_BLOCKS_PER_SEQ if num_blocks is None else int(num_blocks)
        c = config
        H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        self.kda: dict[int, KDAState] = {}
        self.mla: dict[int, PagedLatentCache] = {}
        for i in range(c.num_hidden_layers):
            if c.is_kda_layer(i):
                self.kda[i] = KDAState(
                    conv=torch.zeros((max_seqs, 3 * H * K, W - 1), dtype=dtype, device=device),
                    state=torch.zeros((max_seqs, H, K, K), dtype=state_dtype, device=device))
            else:
                self.mla[i] = PagedLatentCache(n_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim,
                                               dtype, device)
        self.num_blocks = n_blocks
        self._free_slots = list(range(max_seqs))
        self._free_blocks = list(range(n_blocks))

    def __repr__(self) -> str:
        return (f"CachePool(max_seqs={self.max_seqs}, free slots={len(self._free_slots)}, "
                f"blocks={self.num_blocks} of {self.block_size}, free={len(self._free_blocks)})")

    # -- sequences -------------------------------------------------------------------------------
    def new_sequence(self) -> SequenceCache:
        """An empty sequence in a free slot (its KDA and conv state zeroed)."""
        if not self._free_slots:
            raise RuntimeError(f"CachePool: all {self.max_seqs} slots are in use; release a sequence "
                               "or make a larger pool (model.new_pool(max_seqs))")
        slot = self._free_slots.pop(0)
        for st in self.kda.values():
            st.conv[slot].zero_()
            st.state[slot].zero_()
        return SequenceCache(self, slot)

    def _release(self, seq: SequenceCache) -> None:
        self._free_blocks.extend(seq.blocks)
        seq.blocks = []
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        seq.released = True

    # -- paged MLA blocks ------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        if not self.growable:
            raise RuntimeError(f"CachePool: the paged MLA cache is full ({self.num_blocks} blocks of "
                               f"{self.block_size}); make the pool with more num_blocks (or None)")
        new_n = max(2 * self.num_blocks, self.num_blocks + need)
        for cache in self.mla.values():
            cache.grow(new_n)  # in place: callers holding a layer's cache see the new store
        self._free_blocks.extend(range(self.num_blocks, new_n))
        self.num_blocks = new_n

    def reserve(self, seq: SequenceCache, positions: int) -> None:
        """Make ``seq`` own enough blocks for ``positions`` positions."""
        need = -(-positions // self.block_size) - len(seq.blocks)
        if need <= 0 or not self.mla:
            return
        if need > len(self._free_blocks):
            self._grow(need - len(self._free_blocks))
        seq.blocks.extend(self._free_blocks[:need])
        del self._free_blocks[:need]

    def _slots(self, seq: SequenceCache, start: int, count: int) -> torch.Tensor:
        pos = torch.arange(start, start + count)
        blocks = torch.tensor(seq.blocks, dtype=torch.int64)
        return (blocks[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def mla_slots(self, seq: SequenceCache, T: int) -> torch.Tensor:
        """The paged-cache slots [T] of positions ``seq.length .. seq.length+T-1`` (reserved)."""
        self.reserve(seq, seq.length + T)
        return self._slots(seq, seq.length, T)

    def mla_gather(self, layer: int, seq: SequenceCache, length: int):
        """(latent [length, L], k_pe [length, R]) of ``seq`` in position order (copies)."""
        if length == 0:
            cache = self.mla[layer]
            return (torch.zeros((0, cache.L), dtype=self.dtype, device=self.device),
                    torch.zeros((0, cache.R), dtype=self.dtype, device=self.device))
        table = torch.tensor(seq.blocks, dtype=torch.int64, device=self.device)
        return self.mla[layer].gather(table, length)

    def decode_batch(self, seqs: list[SequenceCache], rows: int) -> DecodeBatch:
        """Reserve one more position for each sequence and describe the step over ``rows`` rows
        (the B sequences first, then padding rows that read block 0 and write nothing)."""
        tables, seq_lens, slots = self.decode_steps(seqs, rows, 1)
        return DecodeBatch(tables, seq_lens[0], slots[0])

    def decode_steps(self, seqs: list[SequenceCache], rows: int, steps: int):
        """Reserve ``steps`` more positions for each sequence and describe the next ``steps``
        decode steps over ``rows`` rows, built on the host and sent in one copy each:
        ``(block_tables [rows, W] int32, seq_lens [steps, rows] int32, slot_mapping [steps, rows]
        int64)``; step t of sequence b writes position ``length + t`` (lengths are not advanced)."""
        for s in seqs:
            self.reserve(s, s.length + steps)
        width = max([len(s.blocks) for s in seqs] + [1])
        tables = torch.zeros((rows, width), dtype=torch.int32)
        seq_lens = torch.zeros((steps, rows), dtype=torch.int32)  # 0: an idle row, MLA decode skips it
        slots = torch.full((steps, rows), -1, dtype=torch.int64)
        t = torch.arange(steps, dtype=torch.int64)
        for b, s in enumerate(seqs):
            blocks = torch.tensor(s.blocks, dtype=torch.int64)
            tables[b, : len(s.blocks)] = blocks.to(torch.int32)
            pos = s.length + t
            seq_lens[:, b] = (pos + 1).to(torch.int32)
            if s.blocks:  # no MLA layer: no blocks, nothing to write
                slots[:, b] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
        return tables.to(self.device), seq_lens.to(self.device), slots.to(self.device)
