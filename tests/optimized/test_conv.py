"""optimized.conv: values judged through the registry (``parity.testing.assert_parity``: the
conv records' bounds, final states exact), on shapes that reach the kernels' edges (odd channel
counts, T shorter than the window, W = 2); the bitwise contracts of chunked prefill, decode steps
and the in-place state pool, and argument errors here.
"""
from __future__ import annotations

import pytest
import torch

from optimized import _counters, conv
from parity.testing import assert_parity

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def name(dtype):
    return str(dtype).replace("torch.", "")


def make(B, T, C, W, dtype, seed=0, *, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(C, W, generator=g, dtype=torch.float64) / W ** 0.5).to(dtype)
    s0 = torch.randn(B, C, W - 1, generator=g, dtype=torch.float64).to(dtype)
    return x.to(device), w.to(device), s0.to(device)


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,C,W", [(2, 11, 37, 4), (1, 70, 300, 4), (3, 2, 5, 4), (2, 9, 16, 2)])
@pytest.mark.parametrize("with_state", [False, True])
def test_short_conv_matches_reference(B, T, C, W, dtype, with_state, parity_device):
    x, w, s0 = make(B, T, C, W, dtype, device=parity_device)
    inputs = {"x": x, "weight": w, "initial_state": s0 if with_state else None}
    j = assert_parity("conv.short_conv", inputs, dtype=name(dtype))
    assert j.outputs["final_state"].ratio == 0.0, "final state must be the exact last W-1 inputs"
    y, f = j.values["y"], j.values["final_state"]
    assert y.dtype == dtype and f.dtype == dtype and f.shape == (B, C, W - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_equals_whole_bitwise(dtype, parity_device):
    B, T, C, W = 2, 23, 37, 4
    x, w, s0 = make(B, T, C, W, dtype, seed=1, device=parity_device)
    y, f = conv.short_conv(x, w, initial_state=s0)
    for cuts in ([1], [2], [3], [7, 8], [1, 2, 3, 20]):  # pieces shorter than W-1 too
        ys, st = [], s0
        for a, b in zip([0] + cuts, cuts + [T]):
            yy, st = conv.short_conv(x[:, a:b], w, initial_state=st)
            ys.append(yy)
        assert torch.equal(bits(torch.cat(ys, 1)), bits(y)), f"chunked prefill at {cuts} != whole"
        assert torch.equal(bits(st), bits(f))
    # no initial state == zero initial state
    y0, f0 = conv.short_conv(x, w)
    yz, fz = conv.short_conv(x, w, initial_state=torch.zeros_like(s0))
    assert torch.equal(bits(y0), bits(yz)) and torch.equal(bits(f0), bits(fz))


@pytest.mark.parametrize("dtype,W", [(d, 4) for d in DTYPES] + [(torch.float32, W) for W in (2, 3, 6)],
                         ids=str)
def test_decode_steps_equal_prefill_bitwise(dtype, W, parity_device):
    """The step's tap loop and state shift at the model's W = 4 and at W = 2, 3, 6."""
    B, T, C = 2, 9, 37
    x, w, s0 = make(B, T, C, W, dtype, seed=2, device=parity_device)
    y, f = conv.short_conv(x, w, initial_state=s0)
    st, ys = s0, []
    for t in range(T):
        yy, st_new = conv.short_conv_step(x[:, t], w, st)
        assert st_new.data_ptr() != st.data_ptr(), "short_conv_step must not modify its input state"
        ys.append(yy)
        st = st_new
    assert torch.equal(bits(torch.stack(ys, 1)), bits(y))
    assert torch.equal(bits(st), bits(f))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_state_pool_in_place_touches_only_its_slots(dtype, parity_device):
    B, T, C, W, slots = 3, 5, 37, 4, 7
    x, w, s0 = make(B, T, C, W, dtype, seed=3, device=parity_device)
    g = torch.Generator().manual_seed(9)
    pool = torch.randn(slots, C, W - 1, generator=g).to(dtype=dtype, device=parity_device)
    slot_ids = torch.tensor([5, 0, 3], dtype=torch.int32, device=parity_device)
    pool[slot_ids.long()] = s0
    before = pool.clone()
    y, f = conv.short_conv(x, w, initial_state=s0)
    ys = [conv.short_conv_step_(x[:, t], w, pool, slot_ids) for t in range(T)]
    assert torch.equal(bits(torch.stack(ys, 1)), bits(y))
    assert torch.equal(bits(pool[slot_ids.long()]), bits(f))
    untouched = [i for i in range(slots) if i not in slot_ids.tolist()]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched])), "untouched slots changed"
    # a padding row (slot -1) writes nothing and outputs 0
    snap = pool.clone()
    yp = conv.short_conv_step_(x[:, 0], w, pool, torch.tensor([-1, 0, -1], device=parity_device))
    assert not yp[0].any() and not yp[2].any()
    changed = (bits(pool) != bits(snap)).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [0]


def test_checkpoint_weight_layout_and_fp32_state_for_bf16(parity_device):
    x, w, s0 = make(2, 6, 16, 4, torch.bfloat16, seed=4, device=parity_device)
    y, f = conv.short_conv(x, w, initial_state=s0)
    y2, f2 = conv.short_conv(x, w[:, None, :], initial_state=s0.float())  # [C,1,W], fp32 state
    assert torch.equal(bits(y), bits(y2)) and f2.dtype == torch.float32
    assert torch.equal(f2, f.float())


def test_errors_name_the_argument(parity_device):
    x, w, s0 = make(2, 6, 16, 4, torch.float32, device=parity_device)
    with pytest.raises(ValueError, match="initial_state"):
        conv.short_conv(x, w, initial_state=s0[:, :, :2])
    with pytest.raises(ValueError, match="x"):
        conv.short_conv(x[..., :15], w)
    with pytest.raises(ValueError, match="state"):
        conv.short_conv_step(x[:, 0], w, s0[:1])
    with pytest.raises(ValueError, match="slot_ids"):
        conv.short_conv_step_(x[:, 0], w, s0, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="initial_state"):
        conv.short_conv(x, w, initial_state=s0.bfloat16())


def test_run_to_run_bitwise_and_counted(parity_device):
    x, w, s0 = make(2, 40, 64, 4, torch.bfloat16, seed=5, device=parity_device)
    c0 = _counters.snapshot()
    a, fa = conv.short_conv(x, w, initial_state=s0)
    b, fb = conv.short_conv(x, w, initial_state=s0)
    conv.short_conv_step(x[:, 0], w, s0)
    assert torch.equal(bits(a), bits(b)) and torch.equal(bits(fa), bits(fb))
    d = _counters.snapshot() - c0
    assert d["conv.short_conv"] == 2 and d["conv.short_conv_step"] == 1


@pytest.mark.parity_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_model_shapes(dtype, parity_device):
    B, T, C, W = 2, 1000, 4096, 4
    x, w, s0 = make(B, T, C, W, dtype, seed=7, device=parity_device)
    assert_parity("conv.short_conv", {"x": x, "weight": w, "initial_state": s0}, dtype=name(dtype), device=parity_device)
    y, f = conv.short_conv(x, w, initial_state=s0)
    y1, f1 = conv.short_conv(x[:, :500], w, initial_state=s0)
    y2, f2 = conv.short_conv(x[:, 500:], w, initial_state=f1)
    assert torch.equal(bits(torch.cat([y1, y2], 1)), bits(y)) and torch.equal(bits(f2), bits(f))
    pool = torch.randn(64, C, W - 1, device=parity_device).to(dtype)
    ids = torch.tensor([7, 3], device=parity_device)
    pool[ids] = s0
    ys = [conv.short_conv_step_(x[:, t], w, pool, ids) for t in range(4)]
    assert torch.equal(bits(torch.stack(ys, 1)), bits(y[:, :4]))
