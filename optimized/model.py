"""The optimized Kimi-Linear model (spec b.10-b.17): weights resident on the device, Triton kernels for
every op family (torch for the plain projection GEMMs), carried state for serving-style decode.

``load(path_or_source, *, device=None, dtype="bfloat16", moe_combine="unbiased", kv_norm_eps=1e-6,
backends=None, cuda_graphs=None)`` returns a ``Model`` with the reference's API (``forward``,
``prefill``, ``decode``) plus ``decode_batch`` and ``new_pool`` for batched decode (``optimized.cache``)
and ``greedy`` (greedy decoding with no host sync per step: the steps' inputs built up front, each
argmax fed back on the device).

Which kernel runs where:

- ``forward`` / ``prefill`` (T tokens of one sequence): conv ``short_conv`` (carried state in and
  out), KDA ``fused_chunked`` (chunk 64; gate, beta sigmoid and q/k l2norm fused), MLA ``naive``
  over the whole sequence, the latents written to the paged cache; MoE ``router`` + ``experts``.
- ``decode`` / ``decode_batch`` (one token for each of B sequences): conv ``short_conv_step_`` and
  KDA ``fused_recurrent_decode`` updating their state pools in place by slot id, MLA ``paged_decode``
  (absorbed form) over the paged latent cache after appending the new latent.

Precision policy (spec b.0; ``dtype`` = the model dtype, bf16 in production):

- Weights resident in ``dtype``; ``A_log``, ``dt_bias``, the router weight and the correction bias
  in float32 (float64 for a float64 model). The residual stream and every activation between ops
  are in ``dtype`` (rounded once per op, as HF/vLLM do).
- Projections: torch GEMMs on ``dtype`` operands with fp32 accumulation (bf16 in, fp32 accumulate,
  bf16 out); float32 GEMMs refuse TF32.
- RMSNorm, gated RMSNorm, l2norm, the KDA gate and beta sigmoid, short conv: fp32 inside (fp64 for
  float64), output rounded to ``dtype`` (the gate never leaves the KDA kernel).
- KDA recurrent state: float32 (float64 for float64 runs), in the pools and in the kernels' registers;
  the chunked kernels store their per-chunk intermediates in ``dtype`` (as fla).
- Router: logits ``x.float() @ W_r.float().T`` in fp32 (HF; decode: ``moe.router_logits`` on the real
  rows, batch-invariant), sigmoid/top-k/combine weights in fp32;
  routed expert outputs combined with fp32 weights, then the shared expert added in ``dtype``.
- MLA: ``dtype`` operands, fp32 softmax and accumulation; the latent cache holds ``dtype`` values.
- Logits: the lm_head GEMM in ``dtype`` (bf16 logits, as HF/vLLM), returned as float32 (float64 for
  a float64 model).

Batch invariance (a sequence's decode logits and trace rows are bitwise the same alone or batched):
a decode step always runs on exactly ``model.decode_tile`` rows (64 on CUDA, 4 under the CPU
interpreter, where every padding program costs as much as a real one): the B sequences, then padding
rows (token 0, state slot -1: the state kernels skip them, the paged cache is not written). Library
GEMMs and kernels whose launch configuration depends on the row count therefore always see one
shape; more than ``decode_tile`` sequences run as several steps. The conv step, the KDA recurrence,
the MLA cache write and attention (per-row kernels; the padding rows get zero rows, as those kernels
gave them), the router logits (``moe.router_logits``, a batch-invariant kernel), the top-k and the
routed experts run on the real rows only, the experts in the grouped form with its fixed decode
tiles whatever their number (``moe.GROUPED_DECODE``: a row's bits depend on no other row), with the
shared expert as one more group in the same launches (added in their combine kernel; the padding
rows' FFN output is zero), and the MLA decode splits each sequence's key
range into slices by its own length (``mla.paged_decode``'s default, never chosen from the batch).
Each residual add runs fused with the norm after it (``norm.add_rms_norm``, bitwise the add then the
norm).

CUDA graphs (``model.cuda_graphs``, on by default on CUDA with every family on Triton): ``decode`` /
``decode_batch`` without a ``trace`` replay a captured graph of the decode step (``optimized.graphs``:
per pool and number of sequences, recaptured when the pool's paged cache grows) instead of launching
its ~15 kernels per layer from Python; the logits are bitwise those of the eager step, which still
runs with a ``trace``, on CPU and with ``cuda_graphs=False``.

``trace`` (a dict) receives detached tensors under the keys of docs/ARCHITECTURE.md, ``[T, ...]``
(in ``decode`` T = 1; in ``decode_batch`` the rows are the B sequences).

``backends`` swaps op families to the float64 reference math (``optimized.backends``);
``model.variants`` reports the semantic variants, the dtype, the device and the backend per family.
"""
from __future__ import annotations

import numbers
import os

import torch

from kimi.checkpoint import WeightSource, open_source
from kimi.config import KimiConfig
from reference.checks import (check_token_id, check_token_ids, check_variants, kda_gate_bound,
                              resolve_kda_gate)

from . import backends as _backends
from ._interpreter import interpreting, settle
from .cache import CachePool, DecodeBatch, SequenceCache
from .graphs import DecodeGraphs
from ._checks import require_ieee_fp32_matmul
from .weights import KDAWeights, ModelWeights, load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DECODE_TILE = 64  # a decode step always runs on this many rows (padded): batch invariance
CPU_DECODE_TILE = 4  # under the Triton interpreter every padding program costs as much as a real one


def _dtype_name(dtype) -> str:
    for name, d in DTYPES.items():
        if dtype == name or dtype == d:
            return name
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_device(device) -> torch.device:
    """``None`` -> cuda when available, else cpu. A CUDA device without CUDA, or a CPU device while
    the Triton interpreter is off (kernels compiled for the GPU cannot take CPU tensors), is an
    error that says so."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA device is available on this machine "
                         "(torch.cuda.is_available() is False); use device='cpu'")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {str(device)!r}: only 'cuda' and 'cpu' are supported")
    return dev


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (x [M, in], w [out, in]): torch GEMM, fp32 accumulation for bf16 operands."""
    return x @ w.T


class Model:
    """Kimi-Linear on the device (see the module docstring)."""

    def __init__(self, source, weights: ModelWeights, *, device: torch.device, dtype: str,
                 moe_combine: str, kv_norm_eps: float, backends: dict[str, str], cuda_graphs: bool = False,
                 kda_gate: str | None = None):
        self.source = source
        self.config: KimiConfig = source.config
        self.weights = weights
        self.device = device
        self.dtype = DTYPES[dtype]
        self.state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.ops = _backends.Ops(backends)
        # rows of one decode step (B sequences + padding; more sequences run as several steps);
        # any fixed value keeps decode batch-invariant, a larger one batches more per launch
        self.decode_tile = DECODE_TILE if device.type == "cuda" else CPU_DECODE_TILE
        gate = resolve_kda_gate(kda_gate, self.config)
        self.variants = {"moe_combine": moe_combine, "kv_norm_eps": float(kv_norm_eps), "kda_gate": gate,
                         "dtype": dtype, "device": str(device), "backends": dict(backends)}
        # the KDA gate's keyword for the kda ops: none for the softplus gate, lower_bound for the bounded
        self._gate = {} if kda_gate_bound(gate) is None else {"lower_bound": kda_gate_bound(gate)}
        # decode steps without a trace replay captured CUDA graphs (optimized.graphs)
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = None
        self._tile_bufs: dict[tuple, torch.Tensor] = {}
        if self.cuda_graphs:
            self._graphs = DecodeGraphs(device, self.decode_tile)

    def __repr__(self) -> str:
        return f"optimized.Model({self.source.describe()}, variants={self.variants})"

    # -- public API ------------------------------------------------------------------------------
    def new_pool(self, max_seqs: int = 1, *, block_size: int = 64, num_blocks: int | None = None) -> CachePool:
        """A state pool for up to ``max_seqs`` sequences decoded together (``decode_batch``): slot-
        indexed KDA/conv states and a paged MLA latent cache (blocks of ``block_size`` tokens; the
        block count grows on demand when ``num_blocks`` is None). 64 tokens per block is the MLA
        page of FlashMLA and vLLM's MLA backends, and a multiple of the MLA decode kernel's step
        (``mla.paged_decode`` then reads one block-table entry per step)."""
        return CachePool(self.config, device=self.device, dtype=self.dtype, state_dtype=self.state_dtype,
                         max_seqs=max_seqs, block_size=block_size, num_blocks=num_blocks)

    def forward(self, token_ids, *, trace: dict | None = None) -> torch.Tensor:
        """Logits ``[T, vocab]`` of the whole sequence, recomputed from scratch (the prefill path
        with a throwaway cache)."""
        ids = self._check_ids(token_ids)
        seq = self.new_pool(1).new_sequence()
        logits = self._prefill(ids, seq, trace)
        seq.release()
        return logits

    def prefill(self, token_ids, *, trace: dict | None = None,
                cache: SequenceCache | None = None) -> tuple[torch.Tensor, SequenceCache]:
        """``(logits [T, vocab], cache)``. ``cache`` None: a fresh sequence in a private one-slot pool;
        an empty ``pool.new_sequence()``: a fresh sequence in that pool (to be decoded in a batch with
        the pool's other sequences); a non-empty cache: continue it (chunked prefill, updated in
        place)."""
        ids = self._check_ids(token_ids)
        if cache is None:
            cache = self.new_pool(1).new_sequence()
        else:
            self._check_caches([cache])
        return self._prefill(ids, cache, trace), cache

    def decode(self, token_id, cache: SequenceCache, *, trace: dict | None = None) -> tuple[torch.Tensor, SequenceCache]:
        """``(logits [vocab], cache)`` for one more token; ``cache`` is updated in place."""
        tid = self._check_token(token_id)
        logits, caches = self.decode_batch([tid], [cache], trace=trace)
        return logits[0], caches[0]

    def decode_batch(self, token_ids, caches, *, trace: dict | None = None) -> tuple[torch.Tensor, list]:
        """One token for each of B sequences: ``token_ids [B]``, ``caches`` B distinct non-empty
        ``SequenceCache`` of one pool. Returns ``(logits [B, vocab], caches)`` (updated in place).
        Each sequence's logits are bitwise those of decoding it alone."""
        caches = list(caches)
        ids = self._check_ids(token_ids)
        if len(caches) != ids.shape[0]:
            raise ValueError(f"decode_batch: {ids.shape[0]} token ids for {len(caches)} caches")
        self._check_caches(caches, decode=True)
        return self._decode(ids, caches, trace), caches

    def greedy(self, token_ids, caches, steps: int) -> torch.Tensor:
        """Greedy decoding of ``steps`` tokens for each of B sequences, without a host sync per step.

        ``token_ids [B]``: the next token of each sequence (``caches`` as ``decode_batch``). Step 0
        feeds them, step t feeds step t-1's argmax. Returns the argmax of every step, ``[B, steps]``
        int64 on the model's device (the last column not fed; each cache advances by ``steps``).
        The tokens are those of calling ``decode_batch`` ``steps`` times and feeding back
        ``logits.argmax(-1)``: the same steps on the same rows (bitwise the same logits), but every
        position is reserved and every step's inputs are built and sent up front, and each argmax
        stays on the device as the next step's token, so the host queues steps while the GPU runs.
        """
        caches = list(caches)
        ids = self._check_ids(token_ids)
        if len(caches) != ids.shape[0]:
            raise ValueError(f"greedy: {ids.shape[0]} token ids for {len(caches)} caches")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"greedy: steps must be a positive integer, got {steps!r}")
        self._check_caches(caches, decode=True)
        tile = self.decode_tile
        out = torch.empty((len(caches), steps), dtype=torch.int64, device=self.device)
        for lo in range(0, len(caches), tile):  # groups of decode_tile sequences, as _decode
            out[lo:lo + tile] = self._greedy_group(ids[lo:lo + tile], caches[lo:lo + tile], int(steps))
        return out

    def _greedy_group(self, ids: torch.Tensor, seqs: list[SequenceCache], steps: int) -> torch.Tensor:
        tile, B, pool = self.decode_tile, len(seqs), seqs[0].pool
        # every position reserved first: a pool that grows does so (and the graphs recapture) here
        tables, seq_lens, slot_mapping = pool.decode_steps(seqs, tile, steps)
        tokens = torch.cat([ids, ids.new_zeros(tile - B)])  # the step's input rows, updated in place
        slots = torch.tensor([s.slot for s in seqs] + [-1] * (tile - B), dtype=torch.int64,
                             device=self.device)
        out = torch.empty((B, steps), dtype=torch.int64, device=self.device)
        for t in range(steps):
            batch = DecodeBatch(tables, seq_lens[t], slot_mapping[t])
            if self._graphs is not None:
                logits = self._graphs.run(self._decode_step, pool, B, tokens, slots, batch)
            else:
                logits = self._decode_step(tokens, slots, batch, pool, B)
            out[:, t] = logits.argmax(-1)
            tokens[:B] = out[:, t]
        for s in seqs:
            s.length += steps
        return out

    # -- validation ------------------------------------------------------------------------------
    def _check_ids(self, token_ids, what: str = "token_ids") -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return torch.as_tensor(check_token_ids(token_ids, self.config.vocab_size, what), device=self.device)

    def _check_token(self, token_id) -> int:
        if isinstance(token_id, torch.Tensor):
            if token_id.numel() != 1 or token_id.dim() > 1:
                raise ValueError(f"token_id: expected one integer token id, got shape {tuple(token_id.shape)}")
            token_id = token_id.reshape(()).item()
        return check_token_id(token_id, self.config.vocab_size)

    def _check_caches(self, caches, *, decode: bool = False) -> None:
        for i, c in enumerate(caches):
            if not isinstance(c, SequenceCache):
                raise ValueError(f"caches[{i}]: expected an optimized SequenceCache (from prefill or "
                                 f"pool.new_sequence()), got {type(c).__name__}")
            if c.released:
                raise ValueError(f"caches[{i}]: this sequence's cache was released")
            if c.pool.config != self.config or c.pool.dtype != self.dtype or c.pool.device != self.device:
                raise ValueError(f"caches[{i}]: the cache belongs to a different model "
                                 "(config, dtype or device differ)")
        if len({id(c.pool) for c in caches}) > 1:
            raise ValueError("decode_batch: the caches live in different pools; prefill the sequences "
                             "into one pool (pool = model.new_pool(B); prefill(ids, cache=pool.new_sequence()))")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("decode_batch: the same sequence's cache appears twice")
        if decode:
            for i, c in enumerate(caches):
                if c.length == 0:
                    raise ValueError(f"caches[{i}]: decode needs a prefilled sequence (this one is empty)")

    # -- the stack -------------------------------------------------------------------------------
    def _stack(self, h: torch.Tensor, mixer, *, rows: int | None = None, trace: dict | None) -> torch.Tensor:
        """Embedded ``h [M, D]`` through every layer and the final norm; ``mixer(i, x)`` runs layer
        i's KDA/MLA block on the normed input. ``rows``: decode, only the first ``rows`` rows are
        sequences (the rest is padding). Returns the normed final hidden ``[M, D]``."""
        c, W, ops = self.config, self.weights, self.ops
        eps = c.rms_norm_eps
        x = ops.rms_norm(h, W.layers[0].input_norm, eps=eps)
        for i, lw in enumerate(W.layers):
            a = mixer(i, x)
            x, h = ops.add_rms_norm(h, a, lw.post_norm, eps=eps)  # h + a, and the norm of it
            if c.is_moe_layer(i):
                f = self._moe(i, x, rows=rows, trace=trace)
            else:
                f = ops.swiglu(x, lw.ffn.gate, lw.ffn.up, lw.ffn.down)
            last = i + 1 == len(W.layers)
            x, h = ops.add_rms_norm(h, f, W.norm if last else W.layers[i + 1].input_norm, eps=eps)
            if trace is not None:
                trace[f"layers.{i}.mixer"] = a.detach().clone()
                trace[f"layers.{i}.ffn"] = f.detach().clone()
                trace[f"layers.{i}.hidden"] = h.detach().clone()
        if trace is not None:
            trace["final_norm"] = x.detach().clone()
        return x

    def _logits(self, h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Logits of ``h`` (the lm_head over every row: a fixed GEMM shape), widened to float32
        (float64) for the first ``rows`` rows only (decode: the padding rows are never read)."""
        logits = self.ops.lm_head(h, self.weights.lm_head)
        if rows is not None:
            logits = logits[:rows]
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)

    def _prefill(self, ids: torch.Tensor, seq: SequenceCache, trace: dict | None) -> torch.Tensor:
        T = ids.shape[0]
        h = self.ops.embedding(ids, self.weights.embed)

        def mixer(i, x):
            lw = self.weights.layers[i]
            if isinstance(lw.mixer, KDAWeights):
                return self._kda_prefill(i, lw.mixer, x, seq)
            return self._mla_prefill(i, lw.mixer, x, seq)

        h = self._stack(h, mixer, trace=trace)
        seq.length += T
        return self._logits(h)

    def _decode(self, ids: torch.Tensor, seqs: list[SequenceCache], trace: dict | None) -> torch.Tensor:
        """Sequences in groups of ``decode_tile``, each group one step of exactly ``decode_tile``
        rows (padding rows: token 0, slot -1, write nothing): every kernel and GEMM of a decode step
        sees one shape, so a sequence's logits do not depend on its batch."""
        tile = self.decode_tile
        if len(seqs) > tile:
            parts = []
            for lo in range(0, len(seqs), tile):
                part_trace = None if trace is None else {}
                parts.append(self._decode(ids[lo:lo + tile], seqs[lo:lo + tile], part_trace))
                if trace is not None:
                    for key, val in part_trace.items():
                        trace[key] = val if key not in trace else torch.cat([trace[key], val])
            return torch.cat(parts)
        B, pool = len(seqs), seqs[0].pool
        pad = tile - B
        ids = torch.cat([ids, ids.new_zeros(pad)])
        slots = torch.tensor([s.slot for s in seqs] + [-1] * pad, dtype=torch.int64, device=self.device)
        batch = pool.decode_batch(seqs, tile)
        if trace is None and self._graphs is not None:
            logits = self._graphs.run(self._decode_step, pool, B, ids, slots, batch)
        else:
            sub = None if trace is None else {}
            logits = self._decode_step(ids, slots, batch, pool, B, sub)
            if trace is not None:
                trace.update({k: v[:B] for k, v in sub.items()})
        for s in seqs:
            s.length += 1
        return logits[:B]

    def _decode_step(self, ids: torch.Tensor, slots: torch.Tensor, batch, pool: CachePool, rows: int,
                     trace: dict | None = None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step over ``decode_tile`` rows, the first ``rows``
        of them sequences (``ids``, ``slots [tile]``, ``batch`` a ``DecodeBatch`` of ``tile`` rows).
        Device work only (no host sync, no host allocation): ``optimized.graphs`` captures it."""
        h = self.ops.embedding(ids, self.weights.embed)

        def mixer(i, x):
            lw = self.weights.layers[i]
            if isinstance(lw.mixer, KDAWeights):
                return self._kda_decode(i, lw.mixer, x, pool, slots, rows)
            return self._mla_decode(i, lw.mixer, x, pool, batch, rows)

        h = self._stack(h, mixer, rows=rows, trace=trace)
        return self._logits(h, rows)

    def _tile_out(self, rows: int, B: int, shape: tuple) -> torch.Tensor:
        """The ``[rows, *shape]`` tile a decode step's mixer (or MoE) writes its B sequences' output
        into (its first B rows, in place), so the tile's GEMM (norm) reads it without a padding
        copy. Rows B.. are zeros for good: one buffer per (rows, B, shape), made by the first,
        eager step (a captured step only writes its first B rows); layers reuse it, each one's
        output read by its own norm/GEMM before the next layer writes."""
        key = (rows, B, *shape)
        buf = self._tile_bufs.get(key)
        if buf is None:
            buf = self._tile_bufs[key] = torch.zeros((rows, *shape), dtype=self.dtype,
                                                     device=self.device)
        return buf

    # -- KDA (spec b.10) --------------------------------------------------------------------------
    def _kda_split(self, kw: KDAWeights, x: torch.Tensor):
        c = self.config
        H, K = c.kda_num_heads, c.kda_head_dim
        y = _linear(x, kw.w_in)
        qkv, fa, ga, b = torch.split(y, [sum(kw.splits[:3]), *kw.splits[3:]], dim=-1)
        if kw.fg_b is None:
            return qkv, _linear(fa, kw.f_b), _linear(ga, kw.g_b), b
        # f_a and g_a are adjacent columns of y: one batched GEMM over the [2, M, rank] view
        off, r = sum(kw.splits[:3]), fa.shape[1]
        fg_a = y[:, off:off + 2 * r].unflatten(1, (2, r)).transpose(0, 1)
        g_raw, gate = torch.bmm(fg_a, kw.fg_b.transpose(1, 2))
        return qkv, g_raw, gate, b

    def _kda_out(self, kw: KDAWeights, o: torch.Tensor, gate: torch.Tensor):
        M = o.shape[0]
        HV, V = o.shape[-2], o.shape[-1]
        o = self.ops.gated_rms_norm(o, gate.reshape(M, HV, V), kw.o_norm, eps=self.config.rms_norm_eps)
        return _linear(o.reshape(M, HV * V), kw.o_proj)

    def _kda_prefill(self, i: int, kw: KDAWeights, x: torch.Tensor, seq: SequenceCache):
        c, ops = self.config, self.ops
        T = x.shape[0]
        H, K = c.kda_num_heads, c.kda_head_dim
        HV, V = H, K
        qkv, g_raw, gate, b = self._kda_split(kw, x)
        st = seq.pool.kda[i]
        fresh = seq.length == 0
        conv0 = None if fresh else st.conv[seq.slot:seq.slot + 1]
        y, conv_final = ops.short_conv(qkv[None], kw.conv, initial_state=conv0, state_dtype=st.conv.dtype)
        q, k, v = torch.split(y[0], kw.splits[:3], dim=-1)
        s0 = None if fresh else st.state[seq.slot:seq.slot + 1]
        o, s1 = ops.kda_prefill(q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V),
                                g_raw.reshape(1, T, HV, K), b.reshape(1, T, HV), kw.A_log, kw.dt_bias,
                                initial_state=s0, **self._gate)
        st.conv[seq.slot] = conv_final[0]
        st.state[seq.slot] = s1[0]
        return self._kda_out(kw, o[0], gate)

    def _kda_decode(self, i: int, kw: KDAWeights, x: torch.Tensor, pool: CachePool, slots: torch.Tensor,
                    rows: int):
        """The conv step and the recurrence on the first ``rows`` rows (the sequences: per-row
        kernels, batch invariant); the padding rows' output is the zero rows those kernels gave them."""
        c, ops = self.config, self.ops
        B = rows
        H, K = c.kda_num_heads, c.kda_head_dim
        HV, V = H, K
        qkv, g_raw, gate, b = self._kda_split(kw, x)
        st = pool.kda[i]
        y = ops.short_conv_step_(qkv[:B], kw.conv, st.conv, slots[:B])  # strided rows, read in place
        q, k, v = torch.split(y, kw.splits[:3], dim=-1)
        tile = self._tile_out(x.shape[0], B, (HV, V))
        ops.kda_decode_(q.reshape(B, H, K), k.reshape(B, H, K), v.reshape(B, HV, V),
                        g_raw[:B].reshape(B, HV, K), b[:B].reshape(B, HV), kw.A_log, kw.dt_bias,
                        st.state, slots[:B], out=tile[:B], **self._gate)
        return self._kda_out(kw, tile, gate)

    # -- MLA (spec b.11 / b.12) --------------------------------------------------------------------
    def _mla_split(self, mw, x: torch.Tensor):
        c = self.config
        L = c.kv_lora_rank
        y = _linear(x, mw.w_in)
        q, kv = torch.split(y, mw.splits, dim=-1)
        latent = self.ops.rms_norm(kv[:, :L], mw.kv_norm, eps=self.variants["kv_norm_eps"])
        return q, latent, kv[:, L:]  # k_pe: a view (the paged cache write reads strided rows)

    def _mla_prefill(self, i: int, mw, x: torch.Tensor, seq: SequenceCache):
        c = self.config
        T = x.shape[0]
        N, P, R, Vh = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q, latent, k_pe = self._mla_split(mw, x)
        k_pe = k_pe.contiguous()
        # positions seq.length .. seq.length+T-1 of the paged cache
        slots = seq.pool.mla_slots(seq, T)  # may grow the pool's block store: before its cache is read
        self.ops.mla_write(seq.pool.mla[i], latent, k_pe, slots)
        if seq.length > 0:  # continuing: attend over the cached prefix too
            latent, k_pe = seq.pool.mla_gather(i, seq, seq.length + T)
        o = self.ops.mla_prefill(q.reshape(1, T, N, P + R), latent[None], k_pe[None], mw.w_kvb)
        return _linear(o.reshape(T, N * Vh), mw.o_proj)

    def _mla_decode(self, i: int, mw, x: torch.Tensor, pool: CachePool, batch, rows: int):
        """The cache write and the attention on the first ``rows`` rows (the sequences; the
        padding rows' output is the zero rows the attention gave them)."""
        c = self.config
        B = rows
        N, P, R, Vh = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q, latent, k_pe = self._mla_split(mw, x)
        real = DecodeBatch(batch.block_tables[:B], batch.seq_lens[:B], batch.slot_mapping[:B])
        self.ops.mla_write(pool.mla[i], latent[:B], k_pe[:B], real.slot_mapping)
        tile = self._tile_out(x.shape[0], B, (N * Vh,))
        self.ops.mla_decode(q[:B].reshape(B, N, P + R), mw.w_kvb, pool.mla[i], real,
                            out=tile[:B].view(B, N, Vh))
        return _linear(tile, mw.o_proj)

    # -- MoE (spec b.13 / b.14) --------------------------------------------------------------------
    def _moe(self, i: int, x: torch.Tensor, *, rows: int | None, trace: dict | None) -> torch.Tensor:
        """Router in fp32, routed experts, shared expert. In decode (``rows`` set) only the real rows
        go through the experts, in the grouped form with the decode's fixed tiles whatever their
        number."""
        c, ops = self.config, self.ops
        mw = self.weights.layers[i].ffn
        if rows is None:  # prefill: torch's GEMM on x widened to fp32 (fast at thousands of rows)
            xr = x.to(mw.router.dtype)
            require_ieee_fp32_matmul("model.router", xr, mw.router)
            logits = _linear(xr, mw.router)  # [M, E] fp32
        else:  # decode: the real rows only, one batch-invariant kernel (no cast, no split-K)
            logits = ops.router_logits(x[:rows], mw.router)  # [rows, E] fp32
        top_k = c.num_experts_per_token
        weights, ids = ops.router(logits, mw.bias, top_k=top_k, num_groups=c.num_expert_group,
                                  topk_groups=c.topk_group,
                                  renormalize=c.moe_renormalize and top_k > 1,  # HF: only for top_k > 1
                                  scaling=c.routed_scaling_factor, combine=self.variants["moe_combine"])
        if trace is not None:
            # decode: row by row, batch invariant like the logits (torch's CPU sigmoid rounds an
            # element by its position in the tensor: vector lanes and a scalar tail differ)
            scores = torch.sigmoid(logits) if rows is None else torch.cat([torch.sigmoid(r) for r in logits.split(1)])
            trace[f"layers.{i}.router.scores"] = scores.detach().clone()
            trace[f"layers.{i}.router.selection"] = (scores + mw.bias).detach()
            trace[f"layers.{i}.router.ids"] = ids.detach().clone()
        if rows is None:
            y = ops.experts(x, weights, ids, mw.w1, mw.w2, mw.w3)
            if mw.shared is not None:
                y = y + ops.swiglu(x, mw.shared.gate, mw.shared.up, mw.shared.down)
            return y
        if mw.shared is None:
            y = x.new_zeros(x.shape)
            y[:rows] = ops.experts(x[:rows], weights, ids, mw.w1, mw.w2, mw.w3, decode=True)
            return y
        shared = (mw.shared.gate, mw.shared.up, mw.shared.down)
        if mw.shared.gate.shape[0] == mw.w1.shape[1]:
            # the shared expert as one more group in the routed experts' launches, added in their
            # combine kernel, straight into the tile's first rows (four launches for the whole FFN:
            # the sort, gate/up, down, the combine; the padding rows stay zeros)
            y = self._tile_out(x.shape[0], rows, (x.shape[1],))
            ops.experts(x[:rows], weights, ids, mw.w1, mw.w2, mw.w3, decode=True, shared=shared,
                        out=y[:rows])
            return y
        # a shared expert wider than a routed one (several shared experts): its own swiglu, the
        # routed sum added to its real rows inside the combine kernel (the bits of routed + shared)
        y = ops.swiglu(x, *shared)
        ops.experts(x[:rows], weights, ids, mw.w1, mw.w2, mw.w3, decode=True, add_to=y[:rows])
        return y


def load(path_or_source, *, device=None, dtype="bfloat16", moe_combine: str = "unbiased",
         kv_norm_eps: float = 1e-6, kda_gate: str | None = None, backends: dict | None = None,
         cuda_graphs: bool | None = None) -> Model:
    """The optimized model of a checkpoint directory or a ``WeightSource`` (reference
    ``open_source`` / ``SyntheticSource``), weights resident on ``device`` (None: cuda if available,
    else cpu) in ``dtype`` ("bfloat16", "float32" or "float64").

    ``moe_combine`` ("unbiased" | "biased"), ``kv_norm_eps`` and ``kda_gate`` ("softplus" |
    "lower_bound:<b>"; None: the checkpoint config's gate) as ``reference.load``; ``backends``
    ``{family: "triton" | "reference"}`` (``optimized.backends``). ``cuda_graphs``: replay the
    decode step as a captured CUDA graph (``optimized.graphs``; bitwise the eager logits); None: on
    when the device is CUDA and every family runs on Triton (the reference backends sync with the
    host), off otherwise; True where that does not hold is a ``ValueError``. Raises ``ValueError``
    for an unknown variant, dtype, backend, an unusable device or ``cuda_graphs`` setting,
    ``CheckpointError`` for a broken checkpoint (including non-finite weights, named)."""
    check_variants(moe_combine=moe_combine, kv_norm_eps=kv_norm_eps, kda_gate=kda_gate)
    dtype_name = _dtype_name(dtype)
    choice = _backends.resolve(backends)
    dev = resolve_device(device)
    if isinstance(path_or_source, WeightSource):
        source = path_or_source
    elif isinstance(path_or_source, (str, os.PathLike)):
        source = open_source(path_or_source)
    else:
        raise TypeError(f"load: expected a checkpoint path or a WeightSource, got {type(path_or_source).__name__}")
    settle()
    if dev.type == "cpu" and any(v == "triton" for v in choice.values()) and not interpreting():
        raise ValueError("device 'cpu': the Triton kernels run on CPU only under the Triton interpreter; "
                         "call optimized.use('cpu') first")
    graphs = _resolve_cuda_graphs(cuda_graphs, dev, choice)
    weights = load_weights(source, device=dev, dtype=DTYPES[dtype_name])
    return Model(source, weights, device=dev, dtype=dtype_name, moe_combine=moe_combine,
                 kv_norm_eps=kv_norm_eps, backends=choice, cuda_graphs=graphs, kda_gate=kda_gate)


def _resolve_cuda_graphs(cuda_graphs, dev: torch.device, choice: dict[str, str]) -> bool:
    """``load``'s ``cuda_graphs``: None -> whether graphs can run here; True where they cannot -> a
    ``ValueError`` that says why."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs: expected True, False or None, got {cuda_graphs!r}")
    why = None
    if dev.type != "cuda":
        why = f"needs a CUDA device (device is {str(dev)!r})"
    elif interpreting():
        why = "cannot capture kernels run by the Triton interpreter (TRITON_INTERPRET=1)"
    else:
        swapped = sorted(f for f, v in choice.items() if v != "triton")
        if swapped:
            why = (f"needs every op family on Triton (the reference backend of {', '.join(swapped)} "
                   "syncs with the host)")
    if cuda_graphs and why:
        raise ValueError(f"cuda_graphs=True {why}; use cuda_graphs=False or None")
    return why is None if cuda_graphs is None else cuda_graphs
