"""optimized.kda.fused_recurrent_decode: one token per sequence, states updated in place in a pool.

Values and slot isolation are judged through the registry (the kda.fused_recurrent_decode record:
kda.fused_recurrent's bound on the named slots, every other pool row exact); batch invariance,
strided inputs, padding rows, the output tile and prefill continuation are judged in bytes here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import optimized
from optimized import _counters, kda
from parity.bounds.core import unit_roundoff
from parity.ops.kda.inputs import decode_case
from parity.testing import assert_parity



SENTINEL = 1e30  # fills every slot no sequence names: must come back bit-identical


def make_step(B, H, HV, K, V, dtype, num_slots, slots, *, device, seed=0):
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


def judged_case(B, H, HV, K, V, num_slots, slots, seed):
    """The record's decode case with the given slots; every slot nobody names holds SENTINEL."""
    c = decode_case(B, H, HV, K, V, seed, n_slots=num_slots)
    c.arrays["slot_ids"] = np.array(slots, dtype=np.int64)
    unnamed = [s for s in range(num_slots) if s not in slots]
    c.arrays["state_pool"][unnamed] = SENTINEL
    return c


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_decode_matches_reference_and_isolates_slots(dtype):
    _counters.reset()
    c = judged_case(3, 1, 2, 32, 48, 6, [4, 0, 2], seed=1)  # V = 48: a partial V block
    o = assert_parity("kda.fused_recurrent_decode", c, dtype=dtype).values["o"]
    assert _counters.snapshot()["kda.fused_recurrent_decode"] == 1
    assert o.shape == (3, 2, 48) and o.dtype == getattr(torch, dtype)


def test_decode_batched_equals_alone_bitwise(parity_device):
    slots = [3, 1, 0, 5]
    d, pool, sl = make_step(4, 2, 4, 32, 32, torch.bfloat16, 6, slots, seed=2, device=parity_device)
    before = pool.clone()
    o = decode(d, pool, sl)
    for b in range(4):
        p1 = before.clone()
        ob = decode({n: (x[b:b + 1] if n not in ("A_log", "dt_bias") else x) for n, x in d.items()},
                    p1, sl[b:b + 1])
        assert torch.equal(ob[0], o[b]), f"sequence {b}: batched output differs from alone"
        assert torch.equal(p1[slots[b]], pool[slots[b]]), f"sequence {b}: state differs"


def test_decode_reads_strided_rows_in_place_bitwise(parity_device):
    """q, k, v, g_raw and beta_logits as column slices of wider [B, N] tensors (as the model's fused
    projection output) give the bits of their contiguous copies."""
    slots = [3, 1, 0]
    d, pool, sl = make_step(3, 2, 4, 32, 16, torch.bfloat16, 6, slots, seed=4, device=parity_device)
    views = {}
    for n in ("q", "k", "v", "g_raw", "beta_logits"):
        flat = d[n].reshape(3, -1)
        pad = torch.full((3, 7), float("nan"), dtype=flat.dtype, device=parity_device)  # read = a NaN output
        views[n] = torch.cat([pad, flat, pad], dim=1)[:, 7:7 + flat.shape[1]].view(d[n].shape)
    assert not views["q"].is_contiguous()
    p_view, p_copy = pool.clone(), pool.clone()
    o_view = decode({**d, **views}, p_view, sl)
    o_copy = decode(d, p_copy, sl)
    assert torch.equal(o_view, o_copy) and torch.equal(p_view, p_copy)


def test_decode_run_to_run_and_padding_slot(parity_device):
    slots = [2, -1, 0]  # -1: a padding entry
    d, pool, sl = make_step(3, 1, 1, 16, 32, torch.float32, 3, slots, seed=3, device=parity_device)
    before = pool.clone()
    p1, p2 = before.clone(), before.clone()
    o1, o2 = decode(d, p1, sl), decode(d, p2, sl)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    assert bool((o1[1] == 0).all()), "padding entry must output 0"
    assert torch.equal(p1[1], before[1]), "slot 1 is named by nobody: untouched"


def test_decode_into_out_rows_of_a_padded_tile_bitwise(parity_device):
    """``out`` = the first B rows of a wider zero tile (the model's decode tile): the bits of a fresh
    output, written there and returned; the tile's other rows untouched; a wrong ``out`` is one
    ValueError naming it, raised before any state is updated."""
    slots = [3, 1, 0]
    d, pool, sl = make_step(3, 2, 4, 32, 16, torch.bfloat16, 6, slots, seed=6, device=parity_device)
    p_out, p_new = pool.clone(), pool.clone()
    tile = torch.zeros((5, 4, 16), dtype=torch.bfloat16, device=parity_device)
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


def test_decode_continues_prefill_bitwise(parity_device):
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
    args = [x.to(parity_device) for x in (q, k, v, g_raw, bl, A_log, dt_bias)]
    o_full, s_full = kda.fused_recurrent(*args)
    pre = [x[:, :T] for x in args[:5]] + args[5:]
    _, s_pre = kda.fused_recurrent(*pre)
    pool = torch.full((4, HV, K, V), SENTINEL, device=parity_device)
    pool[[3, 1]] = s_pre
    step = [x[:, T] for x in args[:5]] + args[5:]
    o_step = kda.fused_recurrent_decode(*step, pool, torch.tensor([3, 1], device=parity_device))
    assert torch.equal(o_step, o_full[:, T])
    if not optimized.interpreting():
        # the same formula compiled into two kernel variants (a T-token loop, one indexed step): the
        # GPU compiler may contract a multiply-add into an FMA in one and not the other, so the last
        # update may round differently: at most one fp32 rounding of each of its two terms (u =
        # 2^-24 relative to the state's scale); on the H200 the bytes differed. The interpreter (numpy, no
        # contraction) must give the same bytes.
        u = unit_roundoff("float32")
        scale = torch.maximum(s_full.abs().amax(), s_pre.abs().amax())
        diff = (pool[[3, 1]] - s_full).abs().amax()
        assert diff <= 4 * u * scale, f"state differs by {float(diff):.3g} > 4u * {float(scale):.3g}"
    else:
        assert torch.equal(pool[[3, 1]], s_full)
    assert torch.equal(pool[0], torch.full_like(pool[0], SENTINEL))


def test_decode_argument_errors(parity_device):
    d, pool, sl = make_step(2, 1, 1, 16, 16, torch.float32, 3, [0, 1], device=parity_device)
    with pytest.raises(ValueError, match="state_pool"):
        decode(d, pool[:, :, :, :8], sl)
    with pytest.raises(ValueError, match="state_pool"):
        decode(d, pool.transpose(-1, -2), sl)  # not contiguous: an in-place update would be lost
    with pytest.raises(TypeError, match="state_pool"):
        decode(d, pool.bfloat16(), sl)
    with pytest.raises(ValueError, match="slot_ids"):
        decode(d, pool, sl[:1])


@pytest.mark.parity_gpu
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_decode_real_shapes(B, parity_device):
    H, K, V = 32, 128, 128
    slots = list(range(2 * B - 1, -1, -2))  # every other slot, reversed
    assert_parity("kda.fused_recurrent_decode", judged_case(B, H, H, K, V, 2 * B, slots, seed=B),
                  dtype="bfloat16", device=parity_device)
    d, pool, sl = make_step(B, H, H, K, V, torch.bfloat16, 2 * B, slots, seed=B, device=parity_device)
    before = pool.clone()
    o = decode(d, pool, sl)
    for b in (0, B - 1):
        p1 = before.clone()
        ob = decode({n: (x[b:b + 1] if n not in ("A_log", "dt_bias") else x) for n, x in d.items()},
                    p1, sl[b:b + 1])
        assert torch.equal(ob[0], o[b]) and torch.equal(p1[slots[b]], pool[slots[b]])
