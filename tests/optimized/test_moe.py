"""optimized.moe: values judged through the registry (``parity.testing.assert_parity``: the moe
records' bounds; router ids exact), on inputs that reach the kernels' forms (GEMV and grouped
experts, the torch and one-GEMM SwiGLU, grouped routing, exact ties); batch invariance, strides,
the decode fusions' bits, unrouted-expert reads, counters and argument errors here.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from optimized import _counters, moe
from parity.certify.candidate import of
from parity.testing import assert_parity

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def name(dtype):
    return str(dtype).replace("torch.", "")


def kernel(fn):
    """A call of this repository's kernels another way than the record's: rounding as measured."""
    return of(fn, triton=True)


# ------------------------------------------------------------------------------------------------
# router logits


def logits_inputs(T, D, E, dtype, seed, device):
    """x [T, D] in ``dtype``; weight [E, D] in the compute dtype (fp32, fp64 for fp64 x)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(E, D, generator=g, dtype=torch.float64) * D ** -0.5).to(
        torch.float64 if dtype == torch.float64 else torch.float32)
    return x.to(device), w.to(device)


def bits(t):
    return t.view({4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("T,D,E", [(37, 200, 40), (1, 64, 16), (18, 129, 7)])
def test_router_logits_within_bound(T, D, E, dtype, parity_device):
    x, w = logits_inputs(T, D, E, dtype, seed=T + D + E, device=parity_device)
    out = assert_parity("moe.router_logits", {"x": x, "weight": w}, dtype=name(dtype)).values["logits"]
    assert out.shape == (T, E) and out.dtype == w.dtype


def test_router_logits_rows_do_not_depend_on_the_batch(parity_device):
    """A row's bits are the same computed alone (T = 1), in a decode batch (T = 5, 64) or in a long
    prefill chunk, at any position in it (the launch configuration never depends on T)."""
    x, w = logits_inputs(300, 48, 12, torch.bfloat16, seed=5, device=parity_device)
    full = bits(moe.router_logits(x, w))
    for start, n in ((0, 1), (7, 1), (299, 1), (3, 5), (17, 5), (6, 64), (200, 64), (1, 299)):
        assert torch.equal(bits(moe.router_logits(x[start:start + n], w)), full[start:start + n]), (start, n)
    rolled = moe.router_logits(x.roll(9, 0), w).roll(-9, 0)   # every row at another tile position
    assert torch.equal(bits(rolled), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_router_logits_strided_x_gives_the_bits_of_its_contiguous_copy(dtype, parity_device):
    x, w = logits_inputs(21, 80, 24, dtype, seed=6, device=parity_device)
    wide = torch.zeros(21, 80 + 40, dtype=dtype, device=parity_device)
    wide[:, 13:93] = x
    view = wide[:, 13:93]                                    # row stride 120, last dim contiguous
    assert view.stride() == (120, 1)
    want = bits(moe.router_logits(x.contiguous(), w))
    assert torch.equal(bits(moe.router_logits(view, w)), want)
    cols = x.t().contiguous().t()                           # last dim not contiguous: copied
    assert cols.stride(1) != 1 and torch.equal(bits(moe.router_logits(cols, w)), want)
    w_cols = w.t().contiguous().t()
    assert torch.equal(bits(moe.router_logits(x, w_cols)), want)


def test_router_logits_counted_and_empty(parity_device):
    x, w = logits_inputs(3, 32, 8, torch.bfloat16, seed=7, device=parity_device)
    c0 = _counters.snapshot()
    a, b = moe.router_logits(x, w), moe.router_logits(x, w)
    assert torch.equal(bits(a), bits(b))
    assert moe.router_logits(x[:0], w).shape == (0, 8)
    assert (_counters.snapshot() - c0)["moe.router_logits"] == 3


def test_router_logits_errors_are_one_line_and_name_the_argument():
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8)
    cases = [
        (ValueError, "x: expected \\[T, D\\]", (x[0], w)),
        (ValueError, "weight: expected \\[E, D\\] with D = 8", (x, w[:, :7])),
        (ValueError, "weight: expected \\[E, D\\]", (x, w[0])),
        (TypeError, "weight: expected torch.float32", (x, w.bfloat16())),
        (TypeError, "weight: expected torch.float64", (x.double(), w)),
        (TypeError, "weight: expected torch.float32", (x.float(), w.double())),
        (TypeError, "x: dtype torch.int64 not supported", (x.long(), w)),
        (TypeError, "x: expected a torch.Tensor", ([[0.0] * 8], w)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match="moe.router_logits: " + msg) as e:
            moe.router_logits(*args)
        assert "\n" not in str(e.value)


@pytest.mark.parity_gpu
def test_router_logits_refuses_operands_on_different_devices(parity_device):
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="different devices"):
        moe.router_logits(x.to(parity_device), w)


@pytest.mark.parity_gpu
def test_gpu_router_logits_model_shapes(parity_device):
    """E = 256, D = 2304 (Kimi-Linear): within the bound, and a row's bits the same at T = 1, 64 and
    in a 4096-row prefill chunk."""
    x, w = logits_inputs(4096, 2304, 256, torch.bfloat16, seed=9, device=parity_device)
    full = moe.router_logits(x, w)
    rows = [0, 1, 37, 63, 64, 4095]
    assert_parity("moe.router_logits", {"x": x[rows], "weight": w}, dtype="bfloat16",
                  candidate=kernel(lambda *a: full[rows]))
    for start, n in ((0, 1), (37, 1), (0, 64), (5, 64), (4095, 1), (100, 2048)):
        assert torch.equal(bits(moe.router_logits(x[start:start + n], w)), bits(full[start:start + n])), (start, n)


# ------------------------------------------------------------------------------------------------
# router


def ref_router(logits, bias, **kw):
    from reference import moe as R

    w, i = R.router(logits.double().cpu().numpy(), bias.double().cpu().numpy(), **kw)
    return torch.from_numpy(np.asarray(w)), torch.from_numpy(np.asarray(i)).long()


def well_separated(T, E, dtype, seed, device):
    """Random logits and bias whose selection scores (and group scores) have no near-ties: the
    rank order must not be decidable by rounding noise (checked, 1e-4 >> fp32 noise)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g, dtype=torch.float64) * 2).to(dtype)
    bias = (torch.randn(E, generator=g, dtype=torch.float64) * 0.3).float()
    sel = torch.sigmoid(logits.double()) + bias.double()
    gaps = sel.sort(1).values.diff(1)
    assert gaps.min() > 1e-4, "test data has a near-tie; change the seed"
    return logits.to(device), bias.to(device)

CASES = [  # (E, top_k, num_groups, topk_groups)
    (24, 4, 1, 1), (24, 4, 4, 2), (24, 5, 6, 3), (24, 3, 24, 5), (16, 8, 1, 1), (10, 1, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,top_k,G,KG", CASES)
@pytest.mark.parametrize("combine,renormalize,scaling", [("unbiased", True, 2.446), ("biased", True, 1.0),
                                                         ("unbiased", False, 1.5)])
def test_router_ids_exact_weights_within_bound(E, top_k, G, KG, dtype, combine, renormalize, scaling, parity_device):
    logits, bias = well_separated(9, E, dtype, seed=E + top_k + G, device=parity_device)
    kw = dict(top_k=top_k, num_groups=G, topk_groups=KG, renormalize=renormalize, scaling=scaling,
              combine=combine)
    j = assert_parity("moe.router", {"logits": logits, "bias": bias}, kwargs=kw, dtype=name(dtype))
    w, ids = j.values["weights"], j.values["ids"]
    assert ids.dtype == torch.int64 and w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_router_exact_ties_go_to_the_lower_index(parity_device):
    E = 8
    logits = torch.zeros(3, E)
    logits[:, [1, 2, 5, 6]] = 1.0  # four-way tie, three slots
    logits[1, 7] = 3.0  # one clear winner first
    logits[2, [1, 2, 5, 6]] = torch.tensor([1.0, 0.5, 1.0, 1.0])
    bias = torch.zeros(E)
    logits, bias = logits.to(parity_device), bias.to(parity_device)
    w, ids = moe.router(logits, bias, top_k=3)
    _, ir = ref_router(logits, bias, top_k=3)
    assert torch.equal(ids.cpu(), ir)
    assert ids.tolist() == [[1, 2, 5], [7, 1, 2], [1, 5, 6]]
    # bias ties too: equal selection scores s + b built from different (s, b) are not exact, but
    # identical (logit, bias) pairs are
    bias = torch.tensor([0.5, 0, 0, 0.5, 0, 0, 0.5, 0], device=parity_device)
    logits = torch.zeros(1, E, device=parity_device)
    _, ids = moe.router(logits, bias, top_k=2)
    assert ids.tolist() == [[0, 3]] and torch.equal(ids.cpu(), ref_router(logits, bias, top_k=2)[1])


def test_router_grouped_selection_drops_the_best_expert_of_a_weak_group(parity_device):
    # groups of 2: {0,1} {2,3} {4,5} {6,7}; expert 0 is the best single expert, but its group's
    # top-2 sum is the lowest, so with topk_groups=2 it must not be chosen
    logits = torch.tensor([[4.0, -6.0, 2.0, 2.0, 1.5, 1.5, -1.0, -1.0]], device=parity_device)
    bias = torch.zeros(8, device=parity_device)
    kw = dict(top_k=3, num_groups=4, topk_groups=2)
    _, ids = moe.router(logits, bias, **kw)
    _, ir = ref_router(logits, bias, **kw)
    assert ids.tolist() == [[2, 3, 4]] and torch.equal(ids.cpu(), ir)
    # group-score tie ({2,3} and {4,5} equal): the lower group wins
    logits = torch.tensor([[4.0, -6.0, 2.0, 1.0, 1.0, 2.0, -1.0, -1.0]], device=parity_device)
    _, ids = moe.router(logits, bias, top_k=2, num_groups=4, topk_groups=1)
    _, ir = ref_router(logits, bias, top_k=2, num_groups=4, topk_groups=1)
    assert ids.tolist() == [[2, 3]] and torch.equal(ids.cpu(), ir)


def test_router_run_to_run_bitwise_and_counted(parity_device):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(40, 64, generator=g).bfloat16().to(parity_device)
    bias = (torch.randn(64, generator=g) * 0.1).to(parity_device)
    c0 = _counters.snapshot()
    a = moe.router(logits, bias, top_k=8, scaling=2.446)
    b = moe.router(logits, bias, top_k=8, scaling=2.446)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (_counters.snapshot() - c0)["moe.router"] == 2


def test_router_errors_name_the_argument():
    logits, bias = torch.zeros(2, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="bias"):
        moe.router(logits, bias[:7], top_k=2)
    with pytest.raises(ValueError, match="num_groups"):
        moe.router(logits, bias, top_k=2, num_groups=3)
    with pytest.raises(ValueError, match="top_k"):
        moe.router(logits, bias, top_k=5, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="combine"):
        moe.router(logits, bias, top_k=2, combine="HF")


# ------------------------------------------------------------------------------------------------
# SwiGLU and experts


def make_ffn(T, D, F, E, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    w1 = (torch.randn(E, F, D, generator=g, dtype=torch.float64) / D ** 0.5).to(dtype)
    w3 = (torch.randn(E, F, D, generator=g, dtype=torch.float64) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g, dtype=torch.float64) / F ** 0.5).to(dtype)
    return x.to(device), w1.to(device), w2.to(device), w3.to(device)


def route(T, E, KE, seed, device):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).to(device)
    return moe.router(logits, torch.zeros(E, device=device), top_k=KE, scaling=2.446)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,D,F", [(5, 40, 24), (1, 64, 96), (37, 24, 40)])  # GEMV / torch forms
def test_swiglu_within_bound(T, D, F, dtype, parity_device):
    x, w1, w2, w3 = make_ffn(T, D, F, 1, dtype, seed=T, device=parity_device)
    j = assert_parity("moe.swiglu", {"x": x, "w_gate": w1[0], "w_up": w3[0], "w_down": w2[0]}, dtype=name(dtype))
    assert j.values["y"].shape == (T, D) and j.values["y"].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_stacked_gate_up_is_one_gemm_within_bound(dtype, parity_device):
    """The model's layout (gate and up as adjacent views of one [2F, D] block) takes the one-GEMM
    path; its result stays within the same bound, and a wrong split of the block does not."""
    T, D, F = 40, 48, 24  # > GEMV_MAX_PAIRS: the torch GEMM form
    x, w1, w2, w3 = make_ffn(T, D, F, 1, dtype, seed=7, device=parity_device)
    block = torch.cat([w1[0], w3[0]]).contiguous()
    gate, up = block[:F], block[F:]
    assert moe._stacked(gate, up) and not moe._stacked(w1[0], w3[0])

    def one_block(x, w_gate, w_up, w_down):  # gate and up as adjacent views of one block
        block = torch.cat([w_gate, w_up]).contiguous()
        assert moe._stacked(block[:F], block[F:])
        return moe.swiglu(x, block[:F], block[F:], w_down)

    assert_parity("moe.swiglu", {"x": x, "w_gate": w1[0], "w_up": w3[0], "w_down": w2[0]}, dtype=name(dtype),
                  candidate=kernel(one_block))


def dense(x, shared, form):
    """The shared expert as a dense expert of ``form``: one expert, weight 1 (the bits its fused
    pair must give)."""
    T = x.shape[0]
    gate, up, down = shared
    ones = torch.ones(T, 1, device=x.device)
    zeros = torch.zeros(T, 1, dtype=torch.int64, device=x.device)
    return moe._experts("test", x, ones, zeros, gate[None], down[None], up[None], form=form)


@pytest.mark.parametrize("form", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_add_to_is_the_add_bitwise(dtype, form, parity_device):
    """Decode's ``add_to`` (the routed sum added inside the combine kernel, in place) gives the bits
    of a torch add of the shared output and the routed result, in either form."""
    T, D, F, E, KE = 3, 40, 24, 8, 2
    x, w1, w2, w3 = make_ffn(T, D, F, E, dtype, seed=11, device=parity_device)
    weights, ids = route(T, E, KE, seed=12, device=parity_device)
    shared = make_ffn(T, D, F, 1, dtype, seed=13, device=parity_device)[0] * 3
    routed = moe._experts("test", x, weights, ids, w1, w2, w3, form=form)
    y = shared.clone()
    out = moe._experts("test", x, weights, ids, w1, w2, w3, form=form, add_to=y)
    assert out is y
    assert torch.equal(y, shared + routed) and not torch.equal(y, routed)


@pytest.mark.parametrize("form", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_with_the_shared_expert_fused_is_the_dense_expert_added_bitwise(dtype, form, parity_device):
    """Decode's ``shared`` (the shared expert as one more pair per token, in the grouped form one
    more group, added in the combine) gives the bits of ``experts(add_to=<the shared expert as a
    dense expert of the same form>)`` at T = 3 and, row by row, at T = 20 (each row's bits whatever
    its batch: the decode's batch invariance); into ``out``'s rows only."""
    D, F, E, KE = 40, 24, 8, 2
    x, w1, w2, w3 = make_ffn(20, D, F, E, dtype, seed=21, device=parity_device)
    weights, ids = route(20, E, KE, seed=22, device=parity_device)
    _, sg, sd, su = make_ffn(1, D, F, 1, dtype, seed=23, device=parity_device)
    shared = (sg[0], su[0], sd[0])
    y = moe._experts("test", x[:3], weights[:3], ids[:3], w1, w2, w3, form=form, shared=shared)
    want = moe._experts("test", x[:3], weights[:3], ids[:3], w1, w2, w3, form=form,
                        add_to=dense(x[:3], shared, form))
    assert torch.equal(y, want)
    if form == "gemv":  # swiglu's GEMV form (T <= GEMV_MAX_PAIRS) is that dense expert
        assert torch.equal(dense(x[:3], shared, form), moe.swiglu(x[:3], *shared))
    tile = torch.zeros(24, D, dtype=dtype, device=parity_device)
    moe._experts("test", x, weights, ids, w1, w2, w3, form=form, shared=shared, out=tile[:20])
    for t in (0, 7, 19):
        alone = moe._experts("test", x[t:t + 1], weights[t:t + 1], ids[t:t + 1], w1, w2, w3,
                             form=form, shared=shared)
        assert torch.equal(tile[t], alone[0]), t
    assert not tile[20:].any()
    routed = moe._experts("test", x[:3], weights[:3], ids[:3], w1, w2, w3, form=form)
    assert not torch.equal(y, routed)  # teeth: the shared expert is in it
    with pytest.raises(ValueError, match="shared up"):
        moe._experts("test", x, weights, ids, w1, w2, w3, form=form, shared=(sg[0], su[0][:-1], sd[0]))
    with pytest.raises(ValueError, match="out"):
        moe._experts("test", x, weights, ids, w1, w2, w3, form=form, shared=shared, out=tile)
    with pytest.raises(ValueError, match="add_to"):
        moe._experts("test", x, weights, ids, w1, w2, w3, form=form, shared=shared, add_to=tile[:20])


@pytest.mark.parametrize("shared", [False, True])
def test_grouped_form_sorts_on_the_device_as_argsort_does(shared, monkeypatch, parity_device):
    """The one-program sort of a decode step's pairs (``_bucket_kernel``) gives the tile map of
    torch's argsort and counts, and so the same bits; a tile of 16 rows with an expert of 17 pairs
    (two tiles), experts with none, and the shared expert's group of every token."""
    T, D, F, E, KE = 17, 32, 24, 6, 2
    x, w1, w2, w3 = make_ffn(T, D, F, E, torch.bfloat16, seed=31, device=parity_device)
    weights, ids = route(T, E, KE, seed=32, device=parity_device)
    ids[:, 0] = 4  # expert 4 in every token: 17 pairs
    ids[:, 1] = 1 + torch.arange(T, device=ids.device) % 3  # experts 0 and 5 in none
    sh = tuple(w[0] for w in make_ffn(1, D, F, 1, torch.bfloat16, seed=33, device=parity_device)[1:])
    sh = (sh[0], sh[2], sh[1]) if shared else None
    got = moe._sorted_pairs(ids, T, KE, E, shared, 16, False)
    y = moe._experts("test", x, weights, ids, w1, w2, w3, form="grouped", shared=sh)
    monkeypatch.setattr(moe, "BUCKET_MAX_PAIRS", 0)
    want = moe._sorted_pairs(ids, T, KE, E, shared, 16, False)
    for a, b in zip(got, want):
        assert torch.equal(a.long(), b.long())
    assert got[3][4].item() == T and got[3][0].item() == 0 and (not shared or got[3][E].item() == T)
    assert torch.equal(y, moe._experts("test", x, weights, ids, w1, w2, w3, form="grouped", shared=sh))


def test_swiglu_refuses_tf32_in_fp32(parity_device):
    x, w1, w2, w3 = make_ffn(20, 16, 8, 1, torch.float32, seed=0, device=parity_device)  # > GEMV_MAX_PAIRS: torch GEMMs
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with pytest.raises(RuntimeError, match="allow_tf32"):
            moe.swiglu(x, w1[0], w3[0], w2[0])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old

def test_swiglu_with_gate_and_up_adjacent_in_two_storages_runs_them_apart(parity_device):
    """Two weights back to back in memory but in different storages (as the caching allocator can
    place them) are not one block: a [2F, D] view over the first would reach outside its storage."""
    T, D, F = 20, 16, 8  # > GEMV_MAX_PAIRS: the torch GEMM form
    rng = np.random.default_rng(0)
    block = rng.standard_normal((2 * F, D)).astype(np.float32)
    gate, up = torch.from_numpy(block[:F]), torch.from_numpy(block[F:])
    assert up.data_ptr() == gate.data_ptr() + gate.numel() * 4
    x = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32))
    down = torch.from_numpy(rng.standard_normal((D, F)).astype(np.float32))
    one = torch.from_numpy(block.copy())
    assert not moe._stacked(gate, up) and moe._stacked(one[:F], one[F:])
    x, gate, up, down = (t.to(parity_device) for t in (x, gate, up, down))
    got = moe.swiglu(x, gate, up, down)  # before the storage check: a RuntimeError (out of bounds)
    assert torch.equal(got, moe._silu_mul(x @ gate.T, x @ up.T, x.dtype) @ down.T)


EXPERT_CASES = [  # (T, D, F, E, k_e, form): decode and a few tokens in both forms; prefill-like
    # (grouped: several tiles per expert, partial tiles, an expert with no tokens possible)
    (1, 40, 24, 16, 8, "gemv"), (1, 40, 24, 16, 8, "grouped"), (5, 40, 24, 6, 3, "gemv"),
    (5, 40, 24, 6, 3, "grouped"), (37, 24, 40, 4, 2, "grouped")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,D,F,E,KE,form", EXPERT_CASES)
def test_experts_within_bound(T, D, F, E, KE, form, dtype, parity_device):
    x, w1, w2, w3 = make_ffn(T, D, F, E, dtype, seed=E, device=parity_device)
    weights, ids = route(T, E, KE, seed=T, device=parity_device)
    j = assert_parity("moe.experts", {"x": x, "weights": weights, "ids": ids, "w1": w1, "w2": w2, "w3": w3},
                      dtype=name(dtype), candidate=kernel(functools.partial(moe._experts, "test", form=form)))
    assert j.values["y"].shape == (T, D) and j.values["y"].dtype == dtype


@pytest.mark.parametrize("T,KE", [(1, 8), (6, 4)])
def test_experts_read_only_routed_experts(T, KE, parity_device):
    """Unrouted experts' weights are NaN: any read of them would poison the output."""
    E = 16
    x, w1, w2, w3 = make_ffn(T, 32, 24, E, torch.bfloat16, seed=5, device=parity_device)
    weights, ids = route(T, E, KE, seed=6, device=parity_device)
    unused = [e for e in range(E) if e not in ids.flatten().tolist()]
    assert unused
    for w in (w1, w2, w3):
        w[unused] = float("nan")
    y = moe.experts(x, weights, ids.int(), w1, w2, w3)
    assert torch.isfinite(y.float()).all()


def test_experts_run_to_run_bitwise_and_counted(parity_device):
    x, w1, w2, w3 = make_ffn(37, 24, 40, 4, torch.bfloat16, seed=7, device=parity_device)
    weights, ids = route(37, 4, 2, seed=8, device=parity_device)
    c0 = _counters.snapshot()
    a = moe.experts(x, weights, ids, w1, w2, w3)
    b = moe.experts(x, weights, ids, w1, w2, w3)
    c = moe.experts(x[:1], weights[:1], ids[:1], w1, w2, w3)
    d = moe.experts(x[:1], weights[:1], ids[:1], w1, w2, w3)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(c.view(torch.int16), d.view(torch.int16))
    assert (_counters.snapshot() - c0)["moe.experts"] == 4


def test_experts_errors_name_the_argument(parity_device):
    x, w1, w2, w3 = make_ffn(2, 16, 8, 3, torch.float32, seed=0, device=parity_device)
    weights, ids = route(2, 3, 2, seed=0, device=parity_device)
    with pytest.raises(ValueError, match="w2"):
        moe.experts(x, weights, ids, w1, w2.transpose(1, 2).contiguous(), w3)
    with pytest.raises(ValueError, match="ids"):
        moe.experts(x, weights, ids[:, :1], w1, w2, w3)
    with pytest.raises(TypeError, match="w1"):
        moe.experts(x, weights, ids, [w1[0]], w2, w3)


@pytest.mark.parity_gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_model_shapes(T, parity_device):
    D, F, E, KE = 2304, 1024, 256, 8
    dtype = torch.bfloat16
    g = torch.Generator(device=parity_device).manual_seed(0)
    x = torch.randn(T, D, device=parity_device, generator=g).to(dtype)
    w1 = (torch.randn(E, F, D, device=parity_device, generator=g) / D ** 0.5).to(dtype)
    w3 = (torch.randn(E, F, D, device=parity_device, generator=g) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, D, F, device=parity_device, generator=g) / F ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=parity_device, generator=g)
    bias = torch.randn(E, device=parity_device, generator=g) * 0.1
    j = assert_parity("moe.router", {"logits": logits, "bias": bias}, kwargs={"top_k": KE, "scaling": 2.446},
                      dtype="float32", device=parity_device)
    weights, ids = j.values["weights"], j.values["ids"]
    y = moe.experts(x, weights, ids, w1, w2, w3)
    n = min(T, 4)  # the float64 reference on a few tokens, over the experts they use only
    used = sorted(set(ids[:n].flatten().tolist()))
    remap = torch.tensor([used.index(e) if e in used else -1 for e in range(E)], device=ids.device)
    x_n = {"x": x[:n], "weights": weights[:n], "ids": remap[ids[:n]], "w1": w1[used], "w2": w2[used], "w3": w3[used]}
    assert_parity("moe.experts", x_n, dtype="bfloat16", device=parity_device, candidate=kernel(lambda *a: y[:n]))
    assert torch.equal(y.view(torch.int16), moe.experts(x, weights, ids, w1, w2, w3).view(torch.int16))


def test_nan_scores_are_selected_last_so_ids_stay_in_range_and_distinct(parity_device):
    """A NaN router logit must not produce an out-of-range or repeated expert id (the experts
    kernel would read out of bounds); as in the reference's sort, NaN scores rank last."""
    from reference import moe as ref_moe

    logits = torch.randn(3, 8, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    logits[0, 2] = float("nan")
    logits[1, :] = float("nan")
    bias = torch.zeros(8)
    weights, ids = moe.router(logits.to(parity_device), bias.to(parity_device), top_k=2)
    _, ref_ids = ref_moe.router(logits.double().numpy(), bias.double().numpy(), top_k=2)
    assert ids.cpu().tolist() == ref_ids.tolist()
    assert torch.isnan(weights[1]).all() and torch.isfinite(weights[[0, 2]]).all()
