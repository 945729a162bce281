"""MLA attention, NoPE variant (spec b.11/b.12): ``naive`` and ``absorbed`` over a contiguous cache,
and ``paged_decode`` over a :class:`PagedLatentCache` as serving engines keep it.

Shapes (ARCHITECTURE.md): ``q [B, T, N, P+R]`` (per head ``[nope ; pe]``), ``latent [B, S, L]``
(normed ``c``), ``k_pe [B, S, R]`` (shared by heads, un-rotated), ``w_kvb [N*(P+Vh), L]`` (rows per
head: P of W_UK then Vh of W_UV), ``o [B, T, N, Vh]``; queries are the last T of the S positions,
causal; ``scale`` defaults to ``(P+R)**-0.5``.

Absorbed form: ``q_lat[h] = W_UK[h]^T q_nope[h]`` (a Triton GEMM over heads with a fixed tile, for
batch invariance; its programs also split L, so that a decode's few rows still spread the W_UK read
over the SMs), then the Triton attention kernel (:mod:`.kernels`) over the 576-wide keys
``[c ; k_pe]`` with value ``c`` (online softmax in fp32, flash-decoding split over S for long
contexts), then ``o[h] = W_UV[h] o_lat[h]`` (fused with the merge of the key slices in one Triton
epilogue kernel; one program per head, row block and Vh chunk, likewise to spread the W_UV read).
In bf16 ``q_lat`` and the attention output ``o_lat`` are rounded to bf16 before their GEMMs, as
vLLM's MLA backends do. float32 runs refuse TF32 (torch) and use ``ieee`` tl.dot; float64 runs
compute in float64.

Decode = 3 launches (q_lat GEMM, attention, merge + W_UV) and no host sync, so it can be captured in
a CUDA graph. A sequence's key slices follow its own length (one per DECODE_SPLIT_KEYS keys, at
most DECODE_MAX_SPLITS), never the batch. A large batch's time is mostly its reads of the cache and
w_kvb; at B=1 a program's serial 64-key steps (one 4-warp program per SM, latency-bound) and the
three launches are most of the time, and an eager call is host-bound (Triton's launcher), which a
CUDA graph removes. The figures against the byte floor and against one launch reading the same
bytes: docs/BENCHMARKS.md, "MLA decode" (``benchmarks/bench_ops.py --only mla``,
``benchmarks/launch_floor.py --chain 8``); the launch settings below name their
``benchmarks/tune.py mla --parts`` sweep and have their figures in the same section.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from .. import _counters, _launch, _pdl
from .._checks import check_float, check_same_device, out_or_new, require_ieee_fp32_matmul
from ..elementwise._precision import compute_dtype, tl_compute_dtype
from .kernels import (_mla_attn_kernel, _mla_combine_kernel, _mla_combine_uv_kernel, _paged_write_kernel,
                      _q_lat_kernel)


__all__ = ["naive", "absorbed", "paged_decode", "PagedLatentCache"]

BLOCK_N = 32  # keys per inner step (16 for fp64); part of the reduction order, same for paged and contiguous
#: the same for the absorbed form's 576-wide latent keys in a 16-bit dtype: 64 (a paged decode's
#: serial chain of key steps halves; docs/BENCHMARKS.md, "MLA decode")
BLOCK_N_LATENT = 64


def _block_n(dtype: torch.dtype, shared_kv: bool) -> int:
    if dtype == torch.float64:
        return 16
    return BLOCK_N_LATENT if shared_kv and dtype.itemsize == 2 else BLOCK_N


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


#: A paged decode's key slices (flash-decoding) on a GPU unless the caller names a count: one per
#: DECODE_SPLIT_KEYS keys of the sequence's own length, at most DECODE_MAX_SPLITS. Chosen from the
#: sequence alone (never from the batch), for batch invariance; a long sequence alone still spreads
#: over the SMs, and a short one is not cut into slices with nothing in them.
DECODE_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 64


def _default_splits(device: torch.device, programs: int, S: int) -> int:
    """Slices of the key range: enough programs to fill the GPU (about 2 waves), at least 4 key
    blocks per slice; 1 on CPU (the interpreter gains nothing from splitting)."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(4 * _launch.sm_count(device), max(programs, 1))
    return max(1, min(want, triton.cdiv(S, 4 * BLOCK_N), 64))


def _dims(op: str, q: torch.Tensor, latent_dim: int, R: int, w_kvb: torch.Tensor):
    """(N, P, Vh) from q [..., N, P+R] and w_kvb [N*(P+Vh), L]."""
    N, PR = q.shape[-2], q.shape[-1]
    P = PR - R
    if P < 1:
        raise ValueError(f"{op}: q: last dim P+R = {PR} must exceed R = {R} (k_pe)")
    if w_kvb.dim() != 2 or w_kvb.shape[1] != latent_dim or w_kvb.shape[0] % N:
        raise ValueError(f"{op}: w_kvb: expected [N*(P+Vh), L] with N = {N}, L = {latent_dim}, "
                         f"got {tuple(w_kvb.shape)}")
    Vh = w_kvb.shape[0] // N - P
    if Vh < 1:
        raise ValueError(f"{op}: w_kvb: {w_kvb.shape[0]} rows leave no value rows for N = {N}, P = {P}")
    return N, P, Vh


def _check_dtypes(op: str, **tensors):
    first = None
    for name, t in tensors.items():
        check_float(op, name, t)
        if first is None:
            first = (name, t.dtype)
        elif t.dtype != first[1]:
            raise TypeError(f"{op}: {name}: dtype {t.dtype} differs from {first[0]}'s {first[1]}")
    check_same_device(op, **tensors)


def _check_contiguous(op, q, latent, k_pe, w_kvb):
    _check_dtypes(op, q=q, latent=latent, k_pe=k_pe, w_kvb=w_kvb)
    if q.dim() != 4:
        raise ValueError(f"{op}: q: expected [B, T, N, P+R], got {tuple(q.shape)}")
    B, T = q.shape[:2]
    if latent.dim() != 3 or latent.shape[0] != B:
        raise ValueError(f"{op}: latent: expected [B, S, L] with B = {B}, got {tuple(latent.shape)}")
    S, L = latent.shape[1:]
    if k_pe.dim() != 3 or k_pe.shape[:2] != (B, S):
        raise ValueError(f"{op}: k_pe: expected [B, S, R] with B, S = {B}, {S}, got {tuple(k_pe.shape)}")
    R = k_pe.shape[2]
    if S < T:
        raise ValueError(f"{op}: latent: S = {S} positions cannot hold the T = {T} queries")
    N, P, Vh = _dims(op, q, L, R, w_kvb)
    return B, T, S, L, R, N, P, Vh


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class Launch:
    """Launch settings of the MLA kernels; each None is chosen per call by the heuristic named
    beside it. None of them changes a bit (``BLOCK_N`` and the key slices do): a row's arithmetic is
    the same whichever program computes it and however its loads are issued (compiled; under the
    interpreter, whose tl.dot is np.matmul, ``q_lat_block_l`` and ``epi_block_v`` can change how
    BLAS rounds a float32 column).

    Attention (``_mla_attn_kernel``): ``attn_block_m`` query rows per program (:func:`_block_m`),
    ``attn_warps``, ``attn_stages`` (:func:`_attn_stages`), ``attn_row_mask`` (:func:`_row_mask`),
    ``attn_prefetch_keys`` key steps prefetched into L2 before the PDL wait (1 on one-wave grids of
    a 16-bit paged decode with page-aligned steps, else 0), ``attn_early`` the slice bounds read
    before the PDL wait (on one-wave grids).
    Merge + W_UV epilogue (``_mla_combine_uv_kernel``): ``epi_block_r`` rows per program
    (min(16, rows)), ``epi_block_v`` Vh columns and ``epi_warps`` (:func:`_epilogue_tile`),
    ``epi_unroll`` slices in flight per merge step (16 // rows), ``epi_early`` the sequence lengths
    read before the PDL wait.
    q_lat GEMM (``_q_lat_kernel``): ``q_lat_block_l`` L columns per program (:data:`Q_LAT_L` on a
    GPU, all of L on CPU), ``q_lat_block_p`` P columns per dot (16 for fp64, else 32),
    ``q_lat_warps``, ``q_lat_stages`` (2 for 16-bit, else 1).
    ``prefetch_w``: q_lat and the epilogue prefetch their weight tiles into L2 before the PDL wait.
    """
    attn_block_m: int | None = None
    attn_warps: int = 4
    attn_stages: int | None = None
    attn_row_mask: bool | None = None
    attn_prefetch_keys: int | None = None
    attn_early: bool | None = None
    epi_block_r: int | None = None
    epi_block_v: int | None = None
    epi_warps: int | None = None
    epi_unroll: int | None = None
    epi_early: bool = True
    q_lat_block_l: int | None = None
    q_lat_block_p: int | None = None
    q_lat_warps: int = 4
    q_lat_stages: int | None = None
    prefetch_w: bool = True


LAUNCH = Launch()  # the defaults (frozen, so one instance serves every call)


def _pick(value, default):
    """A launch setting: the caller's ``value``, or the heuristic's ``default`` when it is None."""
    return default if value is None else value


@dataclass(frozen=True)
class _Call:
    """One attention call: T queries per sequence over S key positions (the paged store's capacity
    when paged), N heads, key widths D1 (latent or k_nope) and R (k_pe), value width DV; a sequence
    of length S_b gets ``cdiv(S_b, split_keys)`` key slices clamped to ``[1, max_splits]``
    (``split_keys = 1``: a fixed count). Paged: ``block_tables`` and ``block_size``;
    ``seq_lens``: each sequence's length (None: S)."""
    T: int
    S: int
    N: int
    D1: int
    R: int
    DV: int
    scale: float
    shared_kv: bool
    split_keys: int
    max_splits: int
    block_tables: torch.Tensor | None = None
    block_size: int = 1
    seq_lens: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.block_tables is not None


def _attend(q1, q2, k1, k2, v, out, call: _Call, launch: Launch, w_uv=None):
    """Launch the attention kernel and its epilogue. q1/q2: [B, T, N, *] views; k1/k2/v:
    [B, S, (N,) *] views (or rows of the paged store, ``call.paged``).
    ``w_uv [N, Vh, L]`` given (absorbed form): ``out [B, T, N, Vh]`` receives ``W_UV o_lat``;
    otherwise ``out [B, T, N, DV]`` receives the attention output."""
    B = q1.shape[0]
    # the most slices any sequence here can have (S_b <= S): the grid's and the partials' depth.
    # Clamping max_splits to it never changes a sequence's own count.
    depth = max(1, min(call.max_splits, triton.cdiv(call.S, call.split_keys)))
    if depth != call.max_splits:
        call = replace(call, max_splits=depth)
    direct = w_uv is None and call.max_splits == 1
    if direct:
        pacc = pml = out  # unused
    else:
        cd = compute_dtype(k1.dtype)
        pacc = torch.empty((B, call.max_splits, call.T, call.N, call.DV), dtype=cd, device=q1.device)
        pml = torch.empty((B, call.max_splits, call.T, call.N, 2), dtype=cd, device=q1.device)
    _launch_attention(q1, q2, k1, k2, v, out if direct else pacc, pacc, pml, call, launch, direct)
    if w_uv is not None:
        _launch_epilogue(pacc, pml, w_uv, out, call, launch, B, k1.dtype)
    elif not direct:
        _launch_combine(pacc, pml, out, call, B, k1.dtype)
    return out


def _key_strides(k1, k2, v, call: _Call):
    """(key, k_pe, value) strides of the kernel's (batch, position, head) axes, the block table and
    its row stride; a paged store has no batch axis (the table holds it) and q1 stands in for an
    absent table."""
    if call.paged:
        return (0, k1.stride(0), 0), (0, k2.stride(0)), (0, k1.stride(0), 0), \
            call.block_tables, call.block_tables.stride(0)
    return ((k1.stride(0), k1.stride(1), k1.stride(2) if k1.dim() == 4 else 0),
            (k2.stride(0), k2.stride(1)),
            (v.stride(0), v.stride(1), v.stride(2) if v.dim() == 4 else 0), None, 0)


def _launch_attention(q1, q2, k1, k2, v, o1, pacc, pml, call: _Call, launch: Launch, direct: bool):
    """``_mla_attn_kernel`` into ``o1`` (the output when ``direct``, else the slice partials)."""
    c = call
    B, dt = q1.shape[0], k1.dtype
    HP = c.N if c.shared_kv else 1
    sms = _launch.sm_count(q1.device)
    BM = _pick(launch.attn_block_m, _block_m(B, c.T * HP, c.D1, c.max_splits, sms))
    kst, k2st, vst, bt, sbt = _key_strides(k1, k2, v, c)
    aligned = c.paged and c.block_size % _block_n(dt, c.shared_kv) == 0  # a step within one page
    per_key_table = c.paged and not aligned
    pdl = _pdl.enabled(q1.device)
    grid = (B, (c.N // HP) * triton.cdiv(c.T * HP, BM), c.max_splits)
    # L2 prefetches before the PDL wait (hints, never a bit): the first key step of each program's
    # slice when the grid is one wave (more programs than SMs: the later ones start after the wait
    # anyway, so the extra requests only add traffic), and the q_lat / W_UV weight tiles, whose
    # read then overlaps the kernel before (``benchmarks/tune.py mla --parts prefetch``)
    one_wave = grid[0] * grid[1] * grid[2] <= sms
    prefetch_keys = _pick(launch.attn_prefetch_keys, 1 if one_wave else 0) \
        if pdl and aligned and c.shared_kv and dt.itemsize == 2 else 0
    stages = _attn_stages(dt, c.D1 > 256, BM, per_key_table)
    _mla_attn_kernel[grid](
        q1, q2, k1, k2, v, o1, pacc, pml, bt if bt is not None else q1,
        c.seq_lens if c.seq_lens is not None else q1,
        c.T, c.S, c.N, c.D1, c.R, c.DV, c.block_size, c.split_keys, c.max_splits, float(c.scale),
        q1.stride(0), q1.stride(1), q1.stride(2), q2.stride(0), q2.stride(1), q2.stride(2),
        *kst, *k2st, *vst, o1.stride(0), o1.stride(1), o1.stride(2), sbt,
        HP=HP, SHARED_KV=c.shared_kv, PAGED=c.paged, PAGE_ALIGNED=aligned, VAR_LEN=c.seq_lens is not None,
        DIRECT=direct, EVEN_D=c.D1 == _pow2(c.D1) and c.R == _pow2(c.R) and c.DV == _pow2(c.DV),
        ROW_MASK=_pick(launch.attn_row_mask, _row_mask(BM)), CD=tl_compute_dtype(dt), BLOCK_M=BM,
        PDL=pdl, launch_pdl=pdl, PREFETCH=prefetch_keys, EARLY=bool(_pick(launch.attn_early, one_wave)),
        BLOCK_N=_block_n(dt, c.shared_kv), BLOCK_D1=_pow2(c.D1), BLOCK_R=_pow2(c.R), BLOCK_DV=_pow2(c.DV),
        num_warps=launch.attn_warps, num_stages=_pick(launch.attn_stages, stages))


def _launch_epilogue(pacc, pml, w_uv, out, call: _Call, launch: Launch, B: int, dt: torch.dtype):
    """``_mla_combine_uv_kernel``: the slices merged, then ``W_UV o_lat`` into ``out``."""
    c = call
    Vh = w_uv.shape[1]
    # rows per program: 16, or the batch's rows when fewer (B=1: the merge reads one row's
    # partials, not 16 masked ones; bit-neutral, the dot runs on 16 rows either way)
    br = _pick(launch.epi_block_r, min(16, _pow2(B * c.T, 1)))
    # Vh chunks per head as programs (each redoes the merge, bitwise the same) so a small batch
    # still spreads the W_UV read; adjacent in launch order, they share the partials through
    # L2. Slices in flight per merge step (MERGE_UNROLL, bit-neutral): 16 rows' worth (16 //
    # rows): a single row's merge is a serial chain of slice loads that more in flight overlap,
    # while 16-row blocks' tiles spill with more than 1 (``benchmarks/tune.py mla --parts epilogue``)
    bv, epi_warps = _epilogue_tile(dt, br, c.DV, Vh, out.device)
    bv, epi_warps = _pick(launch.epi_block_v, bv), _pick(launch.epi_warps, epi_warps)
    pdl = _pdl.enabled(out.device)
    _mla_combine_uv_kernel[(triton.cdiv(Vh, bv), c.N, triton.cdiv(B * c.T, br))](
        pacc, pml, w_uv, out, c.seq_lens if c.seq_lens is not None else pml, B * c.T, c.T, c.S, c.N,
        c.DV, Vh, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1), out.stride(2),
        c.split_keys, c.max_splits, VAR_LEN=c.seq_lens is not None, BLOCK_SP=_pow2(c.max_splits, 2),
        MERGE_UNROLL=_pick(launch.epi_unroll, max(1, 16 // br)),
        CD=tl_compute_dtype(dt), BLOCK_R=br, BLOCK_L=_pow2(c.DV), BLOCK_V=bv, PDL=pdl, launch_pdl=pdl,
        PREFETCH=pdl and _pow2(c.DV) % 64 == 0 and launch.prefetch_w, EARLY=bool(launch.epi_early),
        num_warps=epi_warps, num_stages=2 if dt.itemsize <= 2 else 1)


def _launch_combine(pacc, pml, out, call: _Call, B: int, dt: torch.dtype):
    """``_mla_combine_kernel``: the slices merged into ``out`` (the naive form's split path)."""
    c = call
    bdv = min(512, _pow2(c.DV))
    pdl = _pdl.enabled(out.device)
    _mla_combine_kernel[(B * c.T * c.N, triton.cdiv(c.DV, bdv))](
        pacc, pml, out, c.T, c.S, c.N, c.DV, out.stride(0), out.stride(1), out.stride(2), c.split_keys,
        c.max_splits, CD=tl_compute_dtype(dt), BLOCK_DV=bdv, PDL=pdl, launch_pdl=pdl, num_warps=4)


def _attn_stages(dtype: torch.dtype, big: bool, block_m: int, per_key_table: bool) -> int:
    """Pipeline stages of the attention kernel: fp32/fp64 tiles of 512-wide keys do not fit shared
    memory twice (1); 16-row programs (a small batch: a few per SM, each waiting on its loads) 3,
    which hide more of that latency, else 2, where a deeper pipeline costs 32-row programs more
    than it hides (``benchmarks/tune.py mla --parts stages``); 3 for pages shorter than a step,
    whose per-key table entries spill more registers with 2 (the sm_90 build's stack sizes:
    docs/BENCHMARKS.md, "MLA decode")."""
    if big and dtype.itemsize > 2:
        return 1
    return 3 if big and (block_m == 16 or per_key_table) else 2


def _epilogue_tile(dtype: torch.dtype, rows: int, L: int, Vh: int, device: torch.device) -> tuple[int, int]:
    """(Vh columns, warps) of a merge + W_UV program over ``rows`` query rows. Bit-neutral: a column
    is one dot over the full L whichever program computes it. 16-bit on a GPU: 128 columns on 8
    warps for 16-row blocks, 64 on 4 for fewer rows, the W_UV tile [L, columns] in shared memory
    (at most 128 KB: fewer columns past L = 512; the sm_90 build at L = 512 does not spill). Wider
    tiles mean fewer programs redoing the merge; with fewer rows there are few row blocks, and 64
    columns keep enough programs to spread the W_UV read (``benchmarks/tune.py mla --parts
    epilogue_v``, with the tile prefetched before the wait).
    fp32 / fp64 tiles of L x 32 / 16. The CPU interpreter, where a program costs its Python
    overhead, takes 128-byte rows."""
    if device.type != "cuda":
        return min(128 // dtype.itemsize, _pow2(Vh)), 4
    if dtype.itemsize == 2:
        cap = max(16, (1 << 16) // _pow2(L))  # columns of an L-deep 2-byte tile in 128 KB
        return (min(128, cap, _pow2(Vh)), 8) if rows >= 16 else (min(64, cap, _pow2(Vh)), 4)
    return min(16 if dtype.itemsize > 4 else 32, _pow2(Vh)), 4


def _row_mask(block_m: int) -> bool:
    """How the attention loads a partial step's key tiles (the same bits either way): rows past the
    slice's end masked (32-row programs), or read as its last key's row and masked out of the scores
    (16-row programs, whose loads then carry no predicates: latency-bound, they gain from the
    simpler loads, while 32-row programs are faster masked; ``benchmarks/tune.py mla --parts
    loads``)."""
    return block_m >= 32


def _block_m(B: int, rows: int, D1: int, depth: int, sms: int) -> int:
    """Query rows per program (rows: a sequence's query rows, T * N or T; depth: key slices per
    sequence, the grid's third axis). 512-wide keys: 32 once 32-row programs fill the GPU (at least
    one per SM), else 16 (more programs; each reads its key tiles, which the other row block of
    the sequence reads too). Never a bit: a row's arithmetic is the same in either. Below one
    32-row program per SM the idle SMs cost more than the repeated key reads; above it the reads
    do (``benchmarks/tune.py mla --parts occupancy``)."""
    if rows <= 16:
        return 16
    if D1 > 256:
        return 32 if B * depth * triton.cdiv(rows, 32) >= sms else 16
    return 64


def _w_views(w_kvb: torch.Tensor, N: int, P: int, Vh: int):
    """W_UK [N, P, L] and W_UV [N, Vh, L] as views of w_kvb (no copy)."""
    w = w_kvb.view(N, P + Vh, w_kvb.shape[1])
    return w[:, :P, :], w[:, P:, :]


#: Output columns (of L) per ``_q_lat_kernel`` program on a GPU (``Launch.q_lat_block_l``): 4
#: programs per head and row block at L = 512. Only which program computes a column; never its
#: reduction.
Q_LAT_L = 128


def _q_lat(q_nope: torch.Tensor, w_uk: torch.Tensor, launch: Launch) -> torch.Tensor:
    """q_nope [B, T, N, P] -> q_lat [B, T, N, L] = q_nope @ W_UK per head (``_q_lat_kernel``: a row's
    result does not depend on how many rows come with it). Programs per (head, 16 rows, Q_LAT_L
    columns): at decode the few rows alone would leave most SMs idle on the W_UK read."""
    B, T, N, P = q_nope.shape
    L = w_uk.shape[-1]
    M = B * T
    q2 = q_nope.reshape(M, N, P)
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    out = torch.empty((M, N, L), dtype=q_nope.dtype, device=q_nope.device)
    if M:
        bm = 16
        # one L tile per program on the CPU interpreter (a program costs its Python overhead there)
        bl = min(_pick(launch.q_lat_block_l, Q_LAT_L if q_nope.device.type == "cuda" else _pow2(L)), _pow2(L))
        pdl = _pdl.enabled(q_nope.device)
        _q_lat_kernel[(N, triton.cdiv(M, bm), triton.cdiv(L, bl))](
            q2, w_uk, out, M, P, L, q2.stride(0), q2.stride(1), w_uk.stride(0), w_uk.stride(1),
            out.stride(0), out.stride(1), CD=tl_compute_dtype(q_nope.dtype), BLOCK_M=bm,
            BLOCK_P=_pick(launch.q_lat_block_p, 16 if q_nope.dtype == torch.float64 else 32), BLOCK_L=bl,
            PDL=pdl, launch_pdl=pdl, PREFETCH=_pow2(P) if pdl and bl % 64 == 0 and launch.prefetch_w else 0,
            num_warps=launch.q_lat_warps,
            num_stages=_pick(launch.q_lat_stages, 2 if q_nope.dtype.itemsize <= 2 else 1))
    return out.view(B, T, N, L)


def absorbed(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kvb: torch.Tensor, *,
             scale: float | None = None, num_splits: int | None = None,
             launch: Launch | None = None) -> torch.Tensor:
    """Absorbed ("data-movement-friendly") MLA over a contiguous latent cache.

    q: [B, T, N, P+R]; latent: [B, S, L]; k_pe: [B, S, R]; w_kvb: [N*(P+Vh), L]; one dtype.
    Returns o [B, T, N, Vh] in q's dtype. ``num_splits`` (tuning; default: chosen from the GPU size)
    slices the key range for flash-decoding; it changes the reduction order, not the math.
    ``launch``: a :class:`Launch` (default: the tuned settings; never a bit).
    """
    op = "mla.absorbed"
    _counters.record(op)
    B, T, S, L, R, N, P, Vh = _check_contiguous(op, q, latent, k_pe, w_kvb)
    require_ieee_fp32_matmul(op, q)
    launch = _launch.resolve(op, launch, LAUNCH)
    scale = (P + R) ** -0.5 if scale is None else scale
    w_uk, w_uv = _w_views(w_kvb, N, P, Vh)
    q_lat = _q_lat(q[..., :P], w_uk, launch)
    latent, k_pe = _last_contig(latent), _last_contig(k_pe)
    if num_splits is None:
        bm = _block_m(B, T * N, L, 1, _launch.sm_count(q.device))  # depth 1: the slices are chosen from it
        num_splits = _default_splits(q.device, B * triton.cdiv(T * N, bm), S)
    o = torch.empty((B, T, N, Vh), dtype=q.dtype, device=q.device)
    call = _Call(T=T, S=S, N=N, D1=L, R=R, DV=L, scale=scale, shared_kv=True, split_keys=1,
                 max_splits=num_splits)
    return _attend(q_lat, q[..., P:], latent, k_pe, latent, o, call, launch, w_uv=w_uv)


def naive(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kvb: torch.Tensor, *,
          scale: float | None = None, num_splits: int | None = None,
          launch: Launch | None = None) -> torch.Tensor:
    """Naive ("compute-friendly") MLA: expand ``kv = latent @ w_kvb^T`` into per-head keys
    ``[k_nope_h ; k_pe]`` (P+R) and values ``v_h`` (Vh) with one torch GEMM (rounded to the input
    dtype, as HF does), then per-head causal flash attention in Triton.

    Same arguments and result as :func:`absorbed`: q [B, T, N, P+R], latent [B, S, L],
    k_pe [B, S, R], w_kvb [N*(P+Vh), L] -> o [B, T, N, Vh].
    """
    op = "mla.naive"
    _counters.record(op)
    B, T, S, L, R, N, P, Vh = _check_contiguous(op, q, latent, k_pe, w_kvb)
    require_ieee_fp32_matmul(op, q)
    launch = _launch.resolve(op, launch, LAUNCH)
    scale = (P + R) ** -0.5 if scale is None else scale
    kv = (latent @ w_kvb.T).view(B, S, N, P + Vh)
    k_pe = _last_contig(k_pe)
    q = _last_contig(q)
    if num_splits is None:
        num_splits = _default_splits(q.device, B * N * triton.cdiv(T, 16), S)
    o = torch.empty((B, T, N, Vh), dtype=q.dtype, device=q.device)
    call = _Call(T=T, S=S, N=N, D1=P, R=R, DV=Vh, scale=scale, shared_kv=False, split_keys=1,
                 max_splits=num_splits)
    _attend(q[..., :P], q[..., P:], kv[..., :P], k_pe, kv[..., P:], o, call, launch)
    return o


class PagedLatentCache:
    """The MLA latent cache as a serving engine pages it.

    Storage ``kv [num_blocks, block_size, L+R]``: each position is one 576-wide row ``[c ; k_pe]``
    (vLLM's MLA layout). A sequence owns a list of blocks (its row of ``block_tables``, chosen by the
    caller's allocator); position ``p`` of sequence ``b`` lives at slot
    ``block_tables[b, p // block_size] * block_size + p % block_size``. Writes go through a slot
    mapping; rows not written stay bit-identical.
    """

    def __init__(self, num_blocks: int, block_size: int, L: int, R: int, dtype: torch.dtype,
                 device: torch.device | str):
        if num_blocks < 1 or block_size < 1 or L < 1 or R < 1:
            raise ValueError(f"PagedLatentCache: num_blocks, block_size, L, R must be >= 1, got "
                             f"{num_blocks}, {block_size}, {L}, {R}")
        self.num_blocks, self.block_size, self.L, self.R = num_blocks, block_size, L, R
        self.kv = torch.zeros((num_blocks, block_size, L + R), dtype=dtype, device=device)

    def grow(self, num_blocks: int) -> None:
        """Enlarge the block store to ``num_blocks`` blocks in place: rows kept, new rows zero, and the
        object stays the one its holders have (a replaced object would take writes meant for the
        new store, past the end of the old one)."""
        if num_blocks <= self.num_blocks:
            raise ValueError(f"PagedLatentCache.grow: {num_blocks} blocks is not more than {self.num_blocks}")
        kv = torch.zeros((num_blocks, self.block_size, self.L + self.R), dtype=self.kv.dtype,
                         device=self.kv.device)
        kv[: self.num_blocks].copy_(self.kv)
        self.kv, self.num_blocks = kv, num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def latent(self) -> torch.Tensor:
        """[num_blocks, block_size, L] view."""
        return self.kv[..., : self.L]

    @property
    def k_pe(self) -> torch.Tensor:
        """[num_blocks, block_size, R] view."""
        return self.kv[..., self.L:]

    @staticmethod
    def slot_mapping(block_tables: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
        """Slots of positions ``positions[i]`` of sequences ``seq_idx[i]`` (torch, on the device)."""
        blk = block_tables[seq_idx.long(), positions.long() // block_size].long()
        return blk * block_size + positions.long() % block_size

    def write(self, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``latent [n, L]`` and ``k_pe [n, R]`` at ``slot_mapping [n]`` (int; a negative slot
        is padding and writes nothing). Slots must be distinct and < num_blocks * block_size."""
        op = "mla.PagedLatentCache.write"
        _counters.record(op)
        _check_dtypes(op, latent=latent, k_pe=k_pe)
        n = latent.shape[0]
        if latent.dim() != 2 or latent.shape[1] != self.L:
            raise ValueError(f"{op}: latent: expected [n, L] with L = {self.L}, got {tuple(latent.shape)}")
        if k_pe.shape != (n, self.R):
            raise ValueError(f"{op}: k_pe: expected [n, R] = {(n, self.R)}, got {tuple(k_pe.shape)}")
        if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (n,):
            raise ValueError(f"{op}: slot_mapping: expected [n] = ({n},) int32/int64, got "
                             f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
        if latent.dtype != self.dtype:
            raise TypeError(f"{op}: latent: dtype {latent.dtype} differs from the cache's {self.dtype}")
        check_same_device(op, latent=latent, k_pe=k_pe, slot_mapping=slot_mapping, cache=self.kv)
        if n == 0:
            return
        latent, k_pe = _last_contig(latent), _last_contig(k_pe)
        kv = self.kv.view(-1, self.L + self.R)
        pdl = _pdl.enabled(kv.device)
        _paged_write_kernel[(n,)](
            latent, k_pe, slot_mapping.contiguous(), kv, self.L, self.R, latent.stride(0),
            k_pe.stride(0), kv.stride(0), BLOCK_L=triton.next_power_of_2(self.L),
            BLOCK_R=triton.next_power_of_2(self.R), PDL=pdl, launch_pdl=pdl, num_warps=4)

    def gather(self, block_table: torch.Tensor, length: int):
        """(latent [length, L], k_pe [length, R]) of one sequence, in position order (a copy)."""
        pos = torch.arange(length, device=self.device)
        rows = block_table[pos // self.block_size].long() * self.block_size + pos % self.block_size
        flat = self.kv.view(-1, self.L + self.R)[rows]
        return flat[:, : self.L], flat[:, self.L:]


def paged_decode(q: torch.Tensor, cache: PagedLatentCache, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, w_kvb: torch.Tensor, *, scale: float | None = None,
                 num_splits: int | None = None, split_keys: int | None = None,
                 out: torch.Tensor | None = None, launch: Launch | None = None) -> torch.Tensor:
    """Absorbed MLA decode over a paged cache: one query token per sequence.

    q: [B, N, P+R] (the token at position ``seq_lens[b] - 1``, already written to the cache);
    block_tables: [B, max_blocks] int32/int64; seq_lens: [B] int32/int64 (each in
    ``[0, max_blocks * block_size]``, not checked on the device; 0 marks an idle row, e.g. the
    padding of a fixed-size decode step: it reads nothing and its output is 0); w_kvb: [N*(P+Vh), L].
    Returns o [B, N, Vh] in q's dtype. Key slices (flash-decoding): ``num_splits`` fixes their count
    (with the same count the key reduction runs in the order of :func:`absorbed` on the contiguous
    cache, so the results are bitwise equal); ``split_keys`` gives each sequence one slice per
    ``split_keys`` keys of its own length, at most :data:`DECODE_MAX_SPLITS`. At most one of the two;
    neither: ``split_keys =`` :data:`DECODE_SPLIT_KEYS` on a GPU, one slice on CPU. Either way a
    sequence's slices depend only on its own length, never on the batch or the block-table width,
    so its output is bitwise the same whatever it is batched with. ``out`` (optional, a contiguous
    [B, N, Vh] tensor of q's dtype on q's device, e.g. the first rows of a padded decode tile): o is
    written there and returned. ``launch``: a :class:`Launch` (default: the tuned settings; never a
    bit).
    """
    op = "mla.paged_decode"
    _counters.record(op)
    if not isinstance(cache, PagedLatentCache):
        raise TypeError(f"{op}: cache: expected a PagedLatentCache, got {type(cache).__name__}")
    _check_dtypes(op, q=q, cache=cache.kv, w_kvb=w_kvb)
    if q.dim() != 3:
        raise ValueError(f"{op}: q: expected [B, N, P+R], got {tuple(q.shape)}")
    B = q.shape[0]
    L, R = cache.L, cache.R
    N, P, Vh = _dims(op, q, L, R, w_kvb)
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2 \
            or block_tables.shape[0] != B:
        raise ValueError(f"{op}: block_tables: expected [B, max_blocks] int with B = {B}, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if seq_lens.dtype not in (torch.int32, torch.int64) or seq_lens.shape != (B,):
        raise ValueError(f"{op}: seq_lens: expected [B] = ({B},) int32/int64, got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    check_same_device(op, q=q, block_tables=block_tables, seq_lens=seq_lens, cache=cache.kv)
    require_ieee_fp32_matmul(op, q)
    launch = _launch.resolve(op, launch, LAUNCH)
    scale = (P + R) ** -0.5 if scale is None else scale
    capacity = block_tables.shape[1] * cache.block_size
    for name, value in (("num_splits", num_splits), ("split_keys", split_keys)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{op}: {name}: expected a positive int, got {value!r}")
    if num_splits is not None and split_keys is not None:
        raise ValueError(f"{op}: num_splits and split_keys both given; name one or neither")
    if num_splits is not None:
        split_keys, max_splits = 1, num_splits
    elif split_keys is not None or q.device.type == "cuda":
        split_keys, max_splits = split_keys or DECODE_SPLIT_KEYS, DECODE_MAX_SPLITS
    else:
        split_keys, max_splits = 1, 1
    w_uk, w_uv = _w_views(w_kvb, N, P, Vh)
    # copies (if any) before q_lat: the attention reads the lengths and the table before its PDL
    # wait, which only the kernel just before it (q_lat) may not be writing (optimized/_pdl.py)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    q4 = q[:, None]  # [B, 1, N, P+R]
    q_lat = _q_lat(q4[..., :P], w_uk, launch)
    o = out_or_new(op, out, (B, N, Vh), q)[:, None]  # [B, 1, N, Vh]
    kv = cache.kv.view(-1, L + R)
    call = _Call(T=1, S=capacity, N=N, D1=L, R=R, DV=L, scale=scale, shared_kv=True,
                 split_keys=split_keys, max_splits=max_splits, block_tables=block_tables,
                 block_size=cache.block_size, seq_lens=seq_lens)
    _attend(q_lat, q4[..., P:], kv, kv[:, L:], kv, o, call, launch, w_uv=w_uv)
    return o[:, 0]
