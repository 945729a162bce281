"""optimized.kda.fused_recurrent_decode: one token per sequence, states updated in place in a pool.

Correctness is judged with the bound of test_kda.py (its module docstring has the model; one step,
so T = 1); slot isolation, batch invariance and prefill continuation are judged in bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from optimized import _counters, kda
from ._bounds import assert_within, np64

rk = pytest.importorskip("reference.kda")

# self-contained (test modules with the same basename exist under tests/reference, so this file does
# not import test_kda.py); U, C and the check are those of test_kda.py
U = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
C = 4.0
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


SENTINEL = 1e30  # fills every slot no sequence names: must come back bit-identical


def make_step(B, H, HV, K, V, dtype, num_slots, slots, *, seed=0, device=DEV):
    """Inputs of one decode step and a pool whose named slots hold random states, the rest SENTINEL."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    side = f64 if dtype == f64 else torch.float32
    d = dict(q=torch.randn(B, H, K, generator=gen, dtype=f64).to(dtype),
             k=torch.randn(B, H, K, generator=gen, dtype=f64).to(dtype),
             v=torch.randn(B, HV, V, generator=gen, dtype=f64).to(dtype),
             g_raw=torch.randn(B, HV, K, generator=gen, dtype=f64).to(side),
             beta_logits=torch.randn(B, HV, generator=gen, dtype=f64).to(side),
             A_log=torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=f64)).to(side),
             dt_bias=(torch.randn(HV * K, generator=gen, dtype=f64) - 3).to(side))
    pool = torch.full((num_slots, HV, K, V), SENTINEL, dtype=side)
    for s in slots:
        if s >= 0:
            pool[s] = torch.randn(HV, K, V, generator=gen, dtype=f64).to(side)
    d = {n: x.to(device) for n, x in d.items()}
    return d, pool.to(device), torch.tensor(slots, dtype=torch.int32, device=device)


def decode(d, pool, slots, **kw):
    return kda.fused_recurrent_decode(d["q"], d["k"], d["v"], d["g_raw"], d["beta_logits"], d["A_log"],
                                      d["dt_bias"], pool, slots, **kw)


def reference_step(d, pool_before, slots):
    """reference.kda.fused_recurrent with T = 1 per sequence, from its slot's state."""
    idx = [int(s) for s in slots]
    h0 = np64(pool_before)[idx]
    o, s = rk.fused_recurrent(np64(d["q"])[:, None], np64(d["k"])[:, None], np64(d["v"])[:, None],
                              np64(d["g_raw"])[:, None], np64(d["beta_logits"])[:, None],
                              np64(d["A_log"]), np64(d["dt_bias"]), initial_state=h0)
    return torch.from_numpy(np.asarray(o))[:, 0], torch.from_numpy(np.asarray(s))


def step_bound(d, pool_before, slots, dtype):
    """The test_kda bound for T = 1: C * mag * (rho_d + u_a sqrt(K + 2)), mag from the step itself."""
    K = d["q"].shape[-1]
    HV = d["v"].shape[1]
    H = d["q"].shape[1]
    idx = [int(s) for s in slots]
    S0 = pool_before.detach().cpu().double()[idx]
    q = d["q"].detach().cpu().double()
    q = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(HV // H, 1)
    _, S1 = reference_step(d, pool_before, slots)
    Smax = torch.maximum(torch.maximum(S0.abs().amax((2, 3)), S1.abs().amax((2, 3))),
                         d["v"].detach().cpu().double().abs().amax(-1))  # [B, HV]
    u_a = U[torch.float64] if dtype == torch.float64 else U[torch.float32]
    rho_d = U[dtype] if U[dtype] > U[torch.float32] else 0.0
    e = C * (rho_d + u_a * (K + 2) ** 0.5)
    mag_o = K ** -0.5 * q.abs().sum(-1) * Smax
    return e * mag_o[..., None], e * Smax[..., None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_decode_matches_reference_and_isolates_slots(dtype):
    slots = [4, 0, 2]
    d, pool, sl = make_step(3, 1, 2, 32, 48, dtype, 6, slots, seed=1)  # V = 48: a partial V block
    before = pool.clone()
    _counters.reset()
    o = decode(d, pool, sl)
    assert _counters.snapshot()["kda.fused_recurrent_decode"] == 1
    assert o.shape == (3, 2, 48) and o.dtype == dtype
    ro, rs = reference_step(d, before, sl)
    bo, bs = step_bound(d, before, sl, dtype)
    assert_within(f"decode {dtype} o", o, ro, bo)
    assert_within(f"decode {dtype} state", pool[slots], rs, bs)
    for s in (1, 3, 5):  # never named: bit-identical
        assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    # teeth: reading the wrong slot fails the same check
    pool2 = before.clone()
    o_bad = decode(d, pool2, torch.tensor([0, 4, 2], dtype=torch.int32, device=DEV))
    with pytest.raises(AssertionError):
        assert_within("decode wrong slot", o_bad, ro, bo)


def test_decode_batched_equals_alone_bitwise():
    slots = [3, 1, 0, 5]
    d, pool, sl = make_step(4, 2, 4, 32, 32, torch.bfloat16, 6, slots, seed=2)
    before = pool.clone()
    o = decode(d, pool, sl)
    for b in range(4):
        p1 = before.clone()
        ob = decode({n: (x[b:b + 1] if n not in ("A_log", "dt_bias") else x) for n, x in d.items()},
                    p1, sl[b:b + 1])
        assert torch.equal(ob[0], o[b]), f"sequence {b}: batched output differs from alone"
        assert torch.equal(p1[slots[b]], pool[slots[b]]), f"sequence {b}: state differs"


def test_decode_reads_strided_rows_in_place_bitwise():
    """q, k, v, g_raw and beta_logits as column slices of wider [B, N] tensors (as the model's fused
    projection output) give the bits of their contiguous copies."""
    slots = [3, 1, 0]
    d, pool, sl = make_step(3, 2, 4, 32, 16, torch.bfloat16, 6, slots, seed=4)
    views = {}
    for n in ("q", "k", "v", "g_raw", "beta_logits"):
        flat = d[n].reshape(3, -1)
        pad = torch.full((3, 7), float("nan"), dtype=flat.dtype, device=DEV)  # read = a NaN output
        views[n] = torch.cat([pad, flat, pad], dim=1)[:, 7:7 + flat.shape[1]].view(d[n].shape)
    assert not views["q"].is_contiguous()
    p_view, p_copy = pool.clone(), pool.clone()
    o_view = decode({**d, **views}, p_view, sl)
    o_copy = decode(d, p_copy, sl)
    assert torch.equal(o_view, o_copy) and torch.equal(p_view, p_copy)


def test_decode_run_to_run_and_padding_slot():
    slots = [2, -1, 0]  # -1: a padding entry
    d, pool, sl = make_step(3, 1, 1, 16, 32, torch.float32, 3, slots, seed=3)
    before = pool.clone()
    p1, p2 = before.clone(), before.clone()
    o1, o2 = decode(d, p1, sl), decode(d, p2, sl)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    assert bool((o1[1] == 0).all()), "padding entry must output 0"
    assert torch.equal(p1[1], before[1]), "slot 1 is named by nobody: untouched"


def test_decode_into_out_rows_of_a_padded_tile_bitwise():
    """``out`` = the first B rows of a wider zero tile (the model's decode tile): the bits of a fresh
    output, written there and returned; the tile's other rows untouched; a wrong ``out`` is one
    ValueError naming it, raised before any state is updated."""
    slots = [3, 1, 0]
    d, pool, sl = make_step(3, 2, 4, 32, 16, torch.bfloat16, 6, slots, seed=6)
    p_out, p_new = pool.clone(), pool.clone()
    tile = torch.zeros((5, 4, 16), dtype=torch.bfloat16, device=DEV)
    o = decode(d, p_out, sl, out=tile[:3])
    want = decode(d, p_new, sl)
    assert o.data_ptr() == tile.data_ptr()
    assert torch.equal(tile[:3], want) and torch.equal(p_out, p_new)
    assert not tile[3:].any(), "rows past B must stay as they were"
    for bad in (tile[:2], tile[:3].float(), tile[:3, :, ::2], torch.zeros((3, 4, 32), dtype=torch.bfloat16)):
        before = p_out.clone()
        with pytest.raises(ValueError, match=r"^kda.fused_recurrent_decode: out: expected a contiguous") as e:
            decode(d, p_out, sl, out=bad)
        assert "\n" not in str(e.value) and torch.equal(p_out, before)


def test_decode_continues_prefill_bitwise():
    """fused_recurrent over T tokens, then decode token T from the returned state (in a pool slot) ==
    fused_recurrent over T + 1 tokens: the output in bytes, the state in bytes under the interpreter
    and within one rounding of its last update on a GPU (state fp32 in between)."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, HV, K, V = 2, 9, 1, 2, 32, 32
    bf = torch.bfloat16
    q, k = (torch.randn(B, T + 1, H, K, generator=gen).to(bf) for _ in range(2))
    v = torch.randn(B, T + 1, HV, V, generator=gen).to(bf)
    g_raw = torch.randn(B, T + 1, HV, K, generator=gen)
    bl = torch.randn(B, T + 1, HV, generator=gen)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen))
    dt_bias = torch.randn(HV * K, generator=gen) - 3
    args = [x.to(DEV) for x in (q, k, v, g_raw, bl, A_log, dt_bias)]
    o_full, s_full = kda.fused_recurrent(*args)
    pre = [x[:, :T] for x in args[:5]] + args[5:]
    _, s_pre = kda.fused_recurrent(*pre)
    pool = torch.full((4, HV, K, V), SENTINEL, device=DEV)
    pool[[3, 1]] = s_pre
    step = [x[:, T] for x in args[:5]] + args[5:]
    o_step = kda.fused_recurrent_decode(*step, pool, torch.tensor([3, 1], device=DEV))
    assert torch.equal(o_step, o_full[:, T])
    if CUDA:
        # the same formula compiled into two kernel variants (a T-token loop, one indexed step): the
        # GPU compiler may contract a multiply-add into an FMA in one and not the other, so the last
        # update may round differently: at most one fp32 rounding of each of its two terms (u =
        # 2^-24 relative to the state's scale); on the H200 the bytes differed. The interpreter (numpy, no
        # contraction) must give the same bytes.
        u = 2.0 ** -24
        scale = torch.maximum(s_full.abs().amax(), s_pre.abs().amax())
        diff = (pool[[3, 1]] - s_full).abs().amax()
        assert diff <= 4 * u * scale, f"state differs by {float(diff):.3g} > 4u * {float(scale):.3g}"
    else:
        assert torch.equal(pool[[3, 1]], s_full)
    assert torch.equal(pool[0], torch.full_like(pool[0], SENTINEL))


def test_decode_argument_errors():
    d, pool, sl = make_step(2, 1, 1, 16, 16, torch.float32, 3, [0, 1])
    with pytest.raises(ValueError, match="state_pool"):
        decode(d, pool[:, :, :, :8], sl)
    with pytest.raises(ValueError, match="state_pool"):
        decode(d, pool.transpose(-1, -2), sl)  # not contiguous: an in-place update would be lost
    with pytest.raises(TypeError, match="state_pool"):
        decode(d, pool.bfloat16(), sl)
    with pytest.raises(ValueError, match="slot_ids"):
        decode(d, pool, sl[:1])


@pytest.mark.skipif(not CUDA, reason="needs CUDA (real shapes are too slow for the interpreter)")
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_decode_real_shapes(B):
    H, K, V = 32, 128, 128
    slots = list(range(2 * B - 1, -1, -2))  # every other slot, reversed
    d, pool, sl = make_step(B, H, H, K, V, torch.bfloat16, 2 * B, slots, seed=B)
    before = pool.clone()
    o = decode(d, pool, sl)
    ro, rs = reference_step(d, before, sl)
    bo, bs = step_bound(d, before, sl, torch.bfloat16)
    assert_within(f"gpu decode B={B} o", o, ro, bo)
    assert_within(f"gpu decode B={B} state", pool[slots], rs, bs)
    untouched = sorted(set(range(2 * B)) - set(slots))
    assert torch.equal(pool[untouched], before[untouched])
    for b in (0, B - 1):
        p1 = before.clone()
        ob = decode({n: (x[b:b + 1] if n not in ("A_log", "dt_bias") else x) for n, x in d.items()},
                    p1, sl[b:b + 1])
        assert torch.equal(ob[0], o[b]) and torch.equal(p1[slots[b]], pool[slots[b]])
