"""optimized.mla: values judged through the registry (``parity.testing.assert_parity``: the mla
records' bounds, docs/error-bounds.md), on shapes that reach the kernels' paths (key splits, the
model's widths, a custom scale, ragged paged lengths, sliced and tiled decode grids); the paged
cache's contracts (paged == contiguous bitwise at equal reduction order; untouched rows unchanged),
load forms, output tiles and argument errors here.
"""
from __future__ import annotations

import functools

import pytest
import torch

import optimized
from optimized import _counters, mla
from parity.certify.candidate import of
from parity.testing import assert_parity

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def judge(form, o, q, latent, k_pe, w_kvb, dtype, **kw):
    """``o``, computed by the kernel under test on these inputs, judged by the ``mla.<form>`` record."""
    return assert_parity(f"mla.{form}", {"q": q, "latent": latent, "k_pe": k_pe, "w_kvb": w_kvb}, kwargs=kw,
                         dtype=str(dtype).replace("torch.", ""), candidate=of(lambda *a, **k: o, triton=True))


def judge_row(o, b, n, q, latent, k_pe, w_kvb, dtype):
    """Row b of a paged decode output: the absorbed form at the last of sequence b's n positions."""
    judge("absorbed", o[b:b + 1, None], q[b:b + 1, None], latent[b:b + 1, :n], k_pe[b:b + 1, :n], w_kvb, dtype)


def make(B, T, S, N, P, Rr, Vh, L, dtype, seed=0, *, device):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, N, P + Rr, generator=g, dtype=torch.float64).to(dtype)
    latent = torch.randn(B, S, L, generator=g, dtype=torch.float64).to(dtype)  # normed: rms ~ 1
    k_pe = torch.randn(B, S, Rr, generator=g, dtype=torch.float64).to(dtype)
    w_kvb = (torch.randn(N * (P + Vh), L, generator=g, dtype=torch.float64) * L ** -0.5 * 2).to(dtype)
    return q.to(device), latent.to(device), k_pe.to(device), w_kvb.to(device)

SMALL = dict(N=3, P=16, Rr=8, Vh=12, L=24)
SHAPES = [(2, 3, 37, 1), (1, 20, 20, 2), (3, 1, 45, 3)]  # (B, T, S, num_splits): chunk, prefill, decode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["absorbed", "naive"])
@pytest.mark.parametrize("B,T,S,splits", SHAPES)
def test_within_bound_of_reference(form, B, T, S, splits, dtype, parity_device):
    q, latent, k_pe, w_kvb = make(B, T, S, **SMALL, dtype=dtype, seed=S, device=parity_device)
    kernel = functools.partial(getattr(mla, form), num_splits=splits)
    out = assert_parity(f"mla.{form}", {"q": q, "latent": latent, "k_pe": k_pe, "w_kvb": w_kvb},
                        dtype=str(dtype).replace("torch.", ""), candidate=of(kernel, triton=True)).values["o"]
    assert out.shape == (B, T, SMALL["N"], SMALL["Vh"]) and out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_widths(dtype, parity_device):
    """L = 512, R = 64, P = Vh = 128 (the model's), few heads and positions."""
    q, latent, k_pe, w_kvb = make(1, 2, 40, N=2, P=128, Rr=64, Vh=128, L=512, dtype=dtype, seed=1, device=parity_device)
    for form in ("absorbed", "naive"):
        judge(form, getattr(mla, form)(q, latent, k_pe, w_kvb, num_splits=2), q, latent, k_pe, w_kvb, dtype)


def test_custom_scale(parity_device):
    q, latent, k_pe, w_kvb = make(1, 2, 9, **SMALL, dtype=torch.float64, seed=2, device=parity_device)
    assert_parity("mla.absorbed", {"q": q, "latent": latent, "k_pe": k_pe, "w_kvb": w_kvb}, kwargs={"scale": 0.3},
                  dtype="float64")


# ------------------------------------------------------------------------------------------------
# paged cache


def paged_setup(lens, dtype, block_size=4, num_blocks=64, seed=0, fill="random", dims=SMALL, *, device):
    """A cache holding sequences of lengths ``lens`` in shuffled blocks; returns contiguous copies."""
    B, S = len(lens), max(lens)
    q4, latent, k_pe, w_kvb = make(B, 1, S, **dims, dtype=dtype, seed=seed, device=device)
    cache = mla.PagedLatentCache(num_blocks, block_size, dims["L"], dims["Rr"], dtype, device)
    if fill == "random":
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(99)).to(dtype))
    max_blocks = -(-S // block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    block_tables = perm[: B * max_blocks].view(B, max_blocks).to(dtype=torch.int32, device=device)
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)]).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    cache.write(latent[seq, pos], k_pe[seq, pos],
                mla.PagedLatentCache.slot_mapping(block_tables, seq, pos, block_size))
    return q4[:, 0], latent, k_pe, w_kvb, cache, block_tables, torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_equals_contiguous_bitwise(dtype, splits, parity_device):
    lens = [37, 37, 37]
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, dtype, seed=splits, device=parity_device)
    op = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=splits)
    oc = mla.absorbed(q[:, None], latent, k_pe, w_kvb, num_splits=splits)[:, 0]
    assert op.shape == (3, SMALL["N"], SMALL["Vh"])
    assert torch.equal(op, oc), "paged decode differs from the contiguous absorbed form"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_ragged_lengths_within_bound(dtype, parity_device):
    lens = [37, 5, 1, 16]  # not multiples of the block size; one single-key sequence
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, dtype, seed=4, device=parity_device)
    o = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2)
    for b, n in enumerate(lens):
        judge_row(o, b, n, q, latent, k_pe, w_kvb, dtype)
        lat_b, kpe_b = cache.gather(bt[b], n)
        assert torch.equal(lat_b, latent[b, :n]) and torch.equal(kpe_b, k_pe[b, :n])


@pytest.mark.parametrize("splits", [1, 3])
def test_idle_rows_give_zeros_and_leave_the_live_rows_bitwise_unchanged(splits, parity_device):
    # seq_len 0 marks an idle row (the padding of a fixed-size decode step): it reads nothing
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup([21, 13, 8], torch.bfloat16, seed=8, device=parity_device)
    full = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=splits)
    idle = sl.clone()
    idle[1] = 0
    o = mla.paged_decode(q, cache, bt, idle, w_kvb, num_splits=splits)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(o[0].view(torch.int16), full[0].view(torch.int16))
    assert torch.equal(o[2].view(torch.int16), full[2].view(torch.int16))


@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 8), (torch.bfloat16, 64), (torch.float64, 32)],
                         ids=str)
def test_split_keys_slices_each_sequence_by_its_own_length(dtype, block_size, monkeypatch, parity_device):
    """``split_keys``: sequence b gets min(cdiv(S_b, split_keys), DECODE_MAX_SPLITS) key slices
    whatever it is batched with: its row is bitwise the paged decode of that sequence alone with
    that fixed count (the same slice boundaries), idle rows give zeros, and live rows are within the
    bound. Lengths cover the clamp (150 keys: 5 slices, clamped to 4), several slices, one slice;
    pages as long as a step's keys or longer (bf16 64, fp64 32) take the kernel's one-table-entry-
    per-step path, pages of 8 the per-key one."""
    monkeypatch.setattr(mla, "DECODE_MAX_SPLITS", 4)
    lens = [150, 37, 0, 5, 90]
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, dtype, block_size=block_size, num_blocks=100, seed=12, device=parity_device)
    o = mla.paged_decode(q, cache, bt, sl, w_kvb, split_keys=32)
    # the epilogue's rows per program (8 here, 1 alone below, 16 from 9 rows up) never change a bit
    sixteen = mla.Launch(epi_block_r=16)
    assert torch.equal(mla.paged_decode(q, cache, bt, sl, w_kvb, split_keys=32, launch=sixteen), o), \
        "16-row epilogue"
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(o[b], torch.zeros_like(o[b])), f"idle row {b} not zero"
            continue
        count = min(-(-n // 32), 4)
        alone = mla.paged_decode(q[b:b + 1], cache, bt[b:b + 1], sl[b:b + 1], w_kvb, num_splits=count)
        assert torch.equal(o[b], alone[0]), f"seq {b} (len {n}): batched differs from alone, {count} slices"
        judge_row(o, b, n, q, latent, k_pe, w_kvb, dtype)


@pytest.mark.parametrize("block_size", [4, 32])
def test_attention_load_forms_agree_bitwise_and_never_read_past_a_sequence(block_size, parity_device):
    """The attention kernel's two ways to load a partial step's key tiles (rows past the slice's
    end masked to 0, or read as the last key's row and masked out of the scores) give the same bits,
    on the one-table-entry-per-step path (pages of 32 = an fp32 step) and the per-key one (pages of
    4). Every cache row no sequence wrote is NaN, so a load that reached past a sequence's last key
    would turn its row NaN."""
    lens = [37, 5, 70, 1]
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, torch.float32, block_size=block_size,
                                                        num_blocks=96, seed=13, fill=None, device=parity_device)
    written = torch.zeros(cache.kv.shape[:2], dtype=torch.bool, device=parity_device)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=parity_device)
        written[bt[b, pos // block_size].long(), pos % block_size] = True
    cache.kv[~written] = float("nan")
    outs = {}
    for row_mask in (True, False):
        outs[row_mask] = mla.paged_decode(q, cache, bt, sl, w_kvb, split_keys=16,
                                          launch=mla.Launch(attn_row_mask=row_mask))
    assert torch.isfinite(outs[False]).all(), "a key tile load read an unwritten (NaN) cache row"
    assert torch.equal(outs[True], outs[False]), "the masked and clamped key loads differ"


@pytest.mark.parametrize("block_size", [8, 64])
def test_early_setup_forms_agree_bitwise(block_size, parity_device):
    """The attention's slice bounds (sequence length, first block-table entry) and the epilogue's
    sequence lengths read before the PDL wait (one-wave grids) or after it: the same bits, with idle
    rows and programs past their sequence's slices (which return) in the batch, on the
    one-table-entry-per-step path (pages of 64) and the per-key one (pages of 8)."""
    lens = [150, 0, 37, 1, 90]
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, torch.bfloat16, block_size=block_size,
                                                        num_blocks=100, seed=14, device=parity_device)
    outs = {}
    for early in (False, True):
        outs[early] = mla.paged_decode(q, cache, bt, sl, w_kvb, split_keys=64,
                                       launch=mla.Launch(attn_early=early, epi_early=early))
    assert torch.equal(outs[True], outs[False]), "reading the bounds before the wait changed a result"
    assert not outs[True][1].any() and outs[True][0].abs().sum() > 0


def test_paged_decode_refuses_bad_slicing(parity_device):
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup([5, 7], torch.float32, seed=1, device=parity_device)
    for kw, match in ((dict(num_splits=0), "num_splits: expected a positive int"),
                      (dict(split_keys=-2), "split_keys: expected a positive int"),
                      (dict(num_splits=2, split_keys=8), "both given")):
        with pytest.raises(ValueError, match=r"^mla.paged_decode: .*" + match) as e:
            mla.paged_decode(q, cache, bt, sl, w_kvb, **kw)
        assert "\n" not in str(e.value)


def test_paged_decode_into_out_rows_of_a_padded_tile_bitwise(parity_device):
    """``out`` = the first B rows of a wider zero tile (the model's decode tile): the bits of a fresh
    output, written there; the other rows untouched; a wrong ``out`` is one ValueError naming it."""
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup([21, 13, 8], torch.bfloat16, seed=9, device=parity_device)
    N, Vh = SMALL["N"], SMALL["Vh"]
    want = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2)
    tile = torch.zeros((5, N * Vh), dtype=torch.bfloat16, device=parity_device)
    o = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2, out=tile[:3].view(3, N, Vh))
    assert o.data_ptr() == tile.data_ptr() and o.shape == (3, N, Vh)
    assert torch.equal(tile[:3].view(3, N, Vh), want) and not tile[3:].any()
    for bad in (tile[:2].view(2, N, Vh), tile[:3].view(3, N, Vh).float(), tile[:3].view(3, N, Vh)[:, :, ::2]):
        with pytest.raises(ValueError, match=r"^mla.paged_decode: out: expected a contiguous") as e:
            mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2, out=bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_decode_split_grids_padding_blocks(dtype, parity_device):
    """The column splits of the two GEMV-like kernels (q_lat over L, the merge + W_UV epilogue over
    Vh) with ragged last tiles (L = 40 in q_lat tiles of 16, Vh = 40 in chunks of 16), the merge
    unrolled by 3, and a batch
    whose second 16-row block of the epilogue is all padding (seq_len 0) between live rows: live
    rows within the bound of the reference, idle rows zero, and (compiled, on a GPU) bitwise what the
    default tiles give: the tiles only choose which program computes a column, never a reduction
    order. Not checked under the interpreter, whose tl.dot is np.matmul: its BLAS may round a float32
    column differently depending on how many columns come with it."""
    dims = dict(N=2, P=16, Rr=8, Vh=40, L=40)
    lens = [(3 + 5 * b) % 13 + 1 if b % 3 else 0 for b in range(16)] + [0] * 16 + [7, 12]
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup(lens, dtype, num_blocks=160, seed=10, dims=dims, device=parity_device)
    default = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2) if not optimized.interpreting() else None
    o = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2,
                         launch=mla.Launch(q_lat_block_l=16, epi_block_v=16, epi_unroll=3))
    if default is not None:
        assert torch.equal(o, default), "the q_lat / W_UV column tiles changed a result"
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(o[b], torch.zeros_like(o[b])), f"idle row {b} not zero"
            continue
        judge_row(o, b, n, q, latent, k_pe, w_kvb, dtype)


def test_writes_leave_untouched_rows_bit_identical(parity_device):
    dtype = torch.bfloat16
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup([9, 6], dtype, seed=5, device=parity_device)
    before = cache.kv.clone()
    # decode: append one position to sequence 0 and nothing (a padding slot) for sequence 1
    new_lat = torch.randn(2, SMALL["L"]).to(dtype=dtype, device=parity_device)
    new_kpe = torch.randn(2, SMALL["Rr"]).to(dtype=dtype, device=parity_device)
    slot0 = int(mla.PagedLatentCache.slot_mapping(bt, torch.tensor([0], device=parity_device),
                                                  torch.tensor([9], device=parity_device), 4))
    cache.write(new_lat, new_kpe, torch.tensor([slot0, -1], device=parity_device))
    flat_b, flat_a = before.view(-1, before.shape[-1]), cache.kv.view(-1, before.shape[-1])
    changed = (flat_b.view(torch.int16) != flat_a.view(torch.int16)).any(1).nonzero().flatten().tolist()
    assert changed == [slot0]
    assert torch.equal(flat_a[slot0, :SMALL["L"]], new_lat[0]) and torch.equal(flat_a[slot0, SMALL["L"]:], new_kpe[0])
    # a decode step reads the cache and writes nothing
    snap = cache.kv.clone()
    mla.paged_decode(q, cache, bt, torch.tensor([10, 6], dtype=torch.int32, device=parity_device), w_kvb)
    assert torch.equal(cache.kv.view(torch.int16), snap.view(torch.int16))


def test_run_to_run_bitwise_and_counted(parity_device):
    q, latent, k_pe, w_kvb, cache, bt, sl = paged_setup([21, 13], torch.bfloat16, seed=6, device=parity_device)
    c0 = _counters.snapshot()
    a = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2)
    b = mla.paged_decode(q, cache, bt, sl, w_kvb, num_splits=2)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    q4, latent, k_pe, w_kvb = make(1, 4, 19, **SMALL, dtype=torch.bfloat16, seed=7, device=parity_device)
    x, y = (mla.absorbed(q4, latent, k_pe, w_kvb) for _ in range(2))
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    mla.naive(q4, latent, k_pe, w_kvb)
    d = _counters.snapshot() - c0
    assert d["mla.paged_decode"] == 2 and d["mla.absorbed"] == 2 and d["mla.naive"] == 1
    assert d["mla.PagedLatentCache.write"] == 0


def test_errors_name_the_argument(parity_device):
    q, latent, k_pe, w_kvb = make(2, 3, 10, **SMALL, dtype=torch.float32, device=parity_device)
    with pytest.raises(ValueError, match="latent"):
        mla.absorbed(q, latent[:1], k_pe, w_kvb)
    with pytest.raises(ValueError, match="w_kvb"):
        mla.absorbed(q, latent, k_pe, w_kvb[:, :-1])
    with pytest.raises(ValueError, match="k_pe"):
        mla.naive(q, latent, k_pe[:, :-1], w_kvb)
    with pytest.raises(ValueError, match="S = 2"):
        mla.absorbed(q, latent[:, :2], k_pe[:, :2], w_kvb)
    with pytest.raises(TypeError, match="latent"):
        mla.absorbed(q, latent.double(), k_pe, w_kvb)
    cache = mla.PagedLatentCache(4, 4, SMALL["L"], SMALL["Rr"], torch.float32, parity_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.write(latent[0], k_pe[0], torch.arange(3))
    with pytest.raises(ValueError, match="block_tables"):
        mla.paged_decode(q[:, 0], cache, torch.zeros(1, 2, dtype=torch.int32),
                         torch.ones(2, dtype=torch.int32), w_kvb)


def test_refuses_tf32_in_fp32(parity_device):
    q, latent, k_pe, w_kvb = make(1, 1, 4, **SMALL, dtype=torch.float32, device=parity_device)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with pytest.raises(RuntimeError, match="allow_tf32"):
            mla.absorbed(q, latent, k_pe, w_kvb)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
