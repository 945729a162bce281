"""optimized.kda under the bounded gate ``b sigmoid(exp(A_log) (g_raw + dt_bias))``: the gate kernel,
the fused chunked pipeline, the fused recurrence and the decode step take ``lower_bound`` (the
constexpr ``GATE = 1``; ``HAS_A`` False without A_log); values judged through the ``+lower_bound``
records (parity.testing.assert_parity) at float64 (the arithmetic exact but for ordering) and bf16;
the argument errors name the op; the optimized model reads the gate from the config. The softplus
kernels' bits are tests/optimized/test_kda.py's. About 30 s on 2 cores under the interpreter."""
import functools
import importlib

import numpy as np
import pytest
import torch

import optimized
import reference
from kimi.config import PRESETS
from kimi.synthetic import SyntheticSource
from optimized import kda
from parity import ops
from parity.certify.check import tensors
from parity.ops.kda.args import FUSED
from parity.ops.kda.inputs import core_case, decode_case, gate_case
from parity.testing import assert_parity


@pytest.mark.parametrize("has_A", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_gate_kernel_computes_the_bounded_gate(dtype, has_A):
    c = gate_case(2, 9, 3, 40, 4, lower_bound=-4.0, has_A=has_A)   # K = 40: a masked channel block
    j = assert_parity("kda.gate+lower_bound", c, dtype=dtype)
    assert j.ratio < 1


@pytest.mark.parametrize("op, has_A", [("fused_chunked", False), ("fused_recurrent", True)])
def test_the_fused_kernels_compute_the_bounded_gate(op, has_A):
    c = core_case(2, 37, 2, 4, 32, 16, 11, chunk=32 if op == "fused_chunked" else None, fused=True,
                  lower_bound=-5.0, has_A=has_A, hostile="bound")
    for dtype in ("float64", "bfloat16"):
        j = assert_parity(f"kda.{op}+lower_bound", c, dtype=dtype)
        assert j.ratio < 1


@pytest.mark.parametrize("has_A, varlen", [(True, False), (False, True)])
def test_the_one_kernel_prepare_at_chunk_16_computes_the_bounded_gate(has_A, varlen):
    # chunk 16 under the fused bounded gate runs kernels 1-3 as one (_prepare16_kernel): the gate at
    # its bound (exp(G_r0 - G_j) up to e^75 in the diagonal blocks), the production K = 128 tiles
    c = core_case(1, 45, 2, 2, 128, 32, 12, chunk=16, fused=True, lower_bound=-5.0, has_A=has_A,
                  hostile="bound", varlen=varlen)
    for dtype in ("float64", "bfloat16"):
        j = assert_parity("kda.fused_chunked+lower_bound", c, dtype=dtype)
        assert j.ratio < 1


@pytest.mark.parametrize("levels", [0, 1, 2, 4])
def test_every_form_of_the_diagonal_blocks_inverse_is_within_the_bound(levels):
    # the 16-row diagonal blocks' inverse, substituted in blocks of 16 >> levels rows and merged
    # (ChunkLaunch.inverse_levels): in the prepare16 kernel (chunk 16) on keys that make the inverse
    # large, and in the blocks kernel (chunk 64) with gates at the bound; float64 has no slack for a
    # wrong merge
    run = functools.partial(kda.fused_chunked, launch=kda.ChunkLaunch(inverse_levels=levels))
    for chunk, hostile in ((16, "neumann"), (64, "bound")):
        c = core_case(1, 45, 2, 2, 128, 32, 12, chunk=chunk, fused=True, lower_bound=-5.0, hostile=hostile,
                      run=32)
        for dtype in ("float64", "bfloat16"):
            assert assert_parity("kda.fused_chunked+lower_bound", c, dtype=dtype, candidate=run).ratio < 1


def _poisoned(alloc, *args, **kw):
    t = alloc(*args, **kw)
    return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w_and_u_formed_in_the_state_pass_keep_the_bits(dtype, monkeypatch, parity_device):
    # at chunk 16 the state pass forms w = X kb and u = X (beta v) from the prepare kernel's inverse
    # rows (ChunkLaunch.wy_in_pass, the default) with the roundings of the stored w and u: bitwise
    # the stored form, varlen with an empty and a ragged sequence, an initial state, V = 48 (a
    # partly masked block) at 32 and 16 V columns and in the state and output kernels apart (the
    # gate's chunk rows read by each state pass), every buffer NaN-poisoned (no kernel reads an
    # element none wrote: the inverse rows past a sequence end)
    cu = [0, 5, 5, 70, 130]
    c = core_case(1, 130, 1, 2, 32, 48, 23, chunk=16, fused=True, lower_bound=-5.0, hostile="bound",
                  cu_seqlens=cu)
    d = {n: t.to(parity_device) for n, t in tensors(ops.get("kda.fused_chunked+lower_bound"), c, dtype).items()}
    run = functools.partial(kda.fused_chunked, *(d[n] for n in FUSED), initial_state=d["initial_state"],
                            cu_seqlens=torch.tensor(cu, device=parity_device), chunk_size=16, lower_bound=-5.0)
    stored = run(launch=kda.ChunkLaunch(wy_in_pass=False))
    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, functools.partial(_poisoned, getattr(torch, name)))
    for bv in (None, 32, 16):
        o, s = run(launch=kda.ChunkLaunch(fused_block_v=bv, state_transposed=False))
        assert torch.equal(o, stored[0]) and torch.equal(s, stored[1]), bv
    o, s = run(launch=kda.ChunkLaunch(fused_output=False))   # the state and output kernels apart
    assert torch.equal(o, stored[0]) and torch.equal(s, stored[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_transposed_state_pass_is_within_the_bound(dtype, monkeypatch, parity_device):
    # ChunkLaunch.state_transposed: the chunk-16 state pass on S^T (its own order of sums inside
    # each dot): within the bound, varlen with an empty and a ragged sequence, an initial state,
    # V = 48 at 64, 32 and 16 V columns, every buffer NaN-poisoned
    cu = [0, 5, 5, 70, 130]
    c = core_case(1, 130, 1, 2, 32, 48, 23, chunk=16, fused=True, lower_bound=-5.0, hostile="bound",
                  cu_seqlens=cu)
    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, functools.partial(_poisoned, getattr(torch, name)))
    for bv in (None, 32, 16):
        run = functools.partial(kda.fused_chunked, launch=kda.ChunkLaunch(state_transposed=True, fused_block_v=bv))
        assert assert_parity("kda.fused_chunked+lower_bound", c, dtype=dtype, device=parity_device,
                             candidate=run).ratio < 1


def _production_call(B, T, cu, device, g_raw=None):
    """``fused_chunked`` at chunk 16 on bf16 inputs at the production tiles (K = V = 128), with an
    initial state, hostile inputs held at the bound, varlen where ``cu`` is given; ``g_raw`` in
    place of the case's, a function of it (None: the case's). Returns ``run(launch=...)``."""
    c = core_case(B, T, 2, 4, 128, 128, 37, chunk=16, fused=True, lower_bound=-5.0, has_A=True,
                  hostile="bound", cu_seqlens=cu)
    d = {n: None if t is None else t.to(device)
         for n, t in tensors(ops.get("kda.fused_chunked+lower_bound"), c, "bfloat16").items()}
    if g_raw is not None:
        d["g_raw"] = g_raw(d["g_raw"])
    run = functools.partial(kda.fused_chunked, *(d[n] for n in FUSED), initial_state=d["initial_state"],
                            chunk_size=16, lower_bound=-5.0,
                            cu_seqlens=None if cu is None else torch.tensor(cu, device=device))
    return run


@pytest.mark.parametrize("B, T, cu", [(1, 300, [0, 37, 37, 200, 300]), (2, 160, None)])
def test_the_transposed_state_pass_gives_the_default_bits_in_bf16(B, T, cu, parity_device):
    # where the pass is chosen per grid (ChunkLaunch.state_transposed None: 16-bit runs on a GPU),
    # the transposed form runs in place of the certified one, so it must give its bits, o and the
    # fp32 state, at the production tiles (K = V = 128, 64 V columns), with an initial state, varlen
    # with an empty and a ragged sequence, on hostile inputs and with every step held at the bound
    for g_raw in (None, lambda g: torch.full_like(g, 40.0)):
        run = _production_call(B, T, cu, parity_device, g_raw)
        default = run(launch=kda.ChunkLaunch(fused_block_v=64, state_transposed=False))
        transposed = run(launch=kda.ChunkLaunch(fused_block_v=64, state_transposed=True))
        assert torch.isfinite(default[0]).all()
        assert torch.equal(transposed[0], default[0]) and torch.equal(transposed[1], default[1])


@pytest.mark.parametrize("B, T, cu", [(1, 300, [0, 37, 37, 200, 300]), (3, 50, None)])
def test_the_prepare_kernel_in_heads_first_order_gives_the_default_bits(B, T, cu, parity_device):
    # ChunkLaunch.prepare_heads_first only reorders the prepare kernel's programs (one chunk's
    # heads adjacent): every program, and so every bit, is the default's; B = 3 checks that each
    # batch row gets its own programs, varlen that padding entries of the chunk plan still return
    run = _production_call(B, T, cu, parity_device)
    default = run(launch=kda.ChunkLaunch(prepare_heads_first=False))
    heads_first = run(launch=kda.ChunkLaunch(prepare_heads_first=True))
    assert torch.isfinite(default[0]).all()
    assert torch.equal(heads_first[0], default[0]) and torch.equal(heads_first[1], default[1])


def test_the_prepare_kernel_runs_heads_first_from_96_value_heads():
    from optimized.kda import chunk as kchunk

    plan = lambda hv: kchunk._plan("kda", (1, 4096, hv, hv, 128, 128), 16, torch.bfloat16, None, "cpu")  # noqa: E731
    assert kchunk.HEADS_FIRST_MIN_HV == 96
    assert kchunk._prepare_heads_first(plan(96)) and kchunk._prepare_heads_first(plan(128))
    assert not kchunk._prepare_heads_first(plan(64)) and not kchunk._prepare_heads_first(plan(32))


def test_the_transposed_pass_is_chosen_for_16_bit_runs_at_64_columns_outside_its_one_losing_window():
    kchunk = importlib.import_module("optimized.kda.chunk")
    plan = lambda B, H, V=128: kchunk._plan("kda", (B, 4096, H, H, 128, V), 16, torch.bfloat16, None, "cpu")  # noqa: E731
    pick = lambda p, bv=64, dtype=torch.bfloat16, sms=132: kchunk._state_transposed(p, bv, dtype, sms)  # noqa: E731
    assert [pick(plan(B, 32)) for B in (3, 4, 6, 7, 8, 9, 12, 16)] == [True, True, True, False, False, True, True,
                                                                          True]   # 512 programs: 3-4 per SM
    assert pick(plan(1, 96)) and not pick(plan(4, 64))
    assert not pick(plan(1, 32), bv=32) and not pick(plan(3, 32), dtype=torch.float32)
    assert not pick(plan(3, 32), sms=None)   # not a GPU: the default pass


@pytest.mark.parity_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prepare_kernels_flushing_exp_keeps_the_bits_of_tl_exp(dtype, monkeypatch, parity_device):
    # at chunk 16 the prepare kernel's exps skip tl.exp's subnormal handling (exp_normal): every
    # exponent is in [-80, 75], so the results are normal and the bits tl.exp's; checked against
    # tl.exp, with mild raw gates and with raw gates that hold every step at the bound (G reaching
    # -80 at a chunk's last row), varlen with a ragged sequence. Inline PTX: GPU only.
    kchunk = importlib.import_module("optimized.kda.chunk")
    cu = [0, 37, 100, 160]
    c = core_case(1, 160, 2, 2, 128, 64, 29, chunk=16, fused=True, lower_bound=-5.0, has_A=True,
                  cu_seqlens=cu)
    d = {n: t.to(parity_device) for n, t in tensors(ops.get("kda.fused_chunked+lower_bound"), c, dtype).items()}
    for g_raw in (d["g_raw"], torch.full_like(d["g_raw"], 40.0)):
        run = lambda: kda.fused_chunked(*(g_raw if n == "g_raw" else d[n] for n in FUSED),  # noqa: E731
                                        initial_state=d["initial_state"], chunk_size=16, lower_bound=-5.0,
                                        cu_seqlens=torch.tensor(cu, device=parity_device))
        flushed = run()
        with monkeypatch.context() as m:
            m.setattr(kchunk, "_flush_exp", lambda acc: False)
            exact = run()
        assert torch.equal(flushed[0], exact[0]) and torch.equal(flushed[1], exact[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bound_exact_in_fp32_gives_the_bits_of_the_fp64_product(dtype, monkeypatch, parity_device):
    # b = -5 is exact in fp32, so b * sigmoid(z) is formed in fp32 (B_EXACT): one rounding, the one
    # the fp64 product rounded to fp32 gives; checked against B_EXACT forced off, in the gate kernel
    # and in the chunk-16 prepare kernel (the one that runs at production shapes), on random inputs
    # spanning the gate's range
    kgate, kchunk = (importlib.import_module(f"optimized.kda.{m}") for m in ("gate", "chunk"))
    c = core_case(2, 40, 2, 2, 128, 32, 13, chunk=16, fused=True, lower_bound=-5.0, has_A=True)
    d = tensors(ops.get("kda.fused_chunked+lower_bound"), c, "float32")
    q, k, v, g_raw, beta, A_log, dt_bias = (d[n].to(dtype).to(parity_device) if d[n].ndim > 1 else
                                            d[n].to(parity_device) for n in FUSED)
    g_raw = g_raw * 8   # raw gates from about -30 to 30: sigmoid from its tail to 1
    assert kgate.bound_exact(-5.0, torch.float32) and not kgate.bound_exact(-4.1, torch.float32)
    run = lambda: (kda.gate(g_raw, A_log, dt_bias, lower_bound=-5.0),  # noqa: E731
                   kda.fused_chunked(q, k, v, g_raw, beta, A_log, dt_bias, lower_bound=-5.0, chunk_size=16))
    exact = run()
    for module in (kgate, kchunk):
        monkeypatch.setattr(module, "bound_exact", lambda lower_bound, acc: False)
    fp64 = run()
    assert torch.equal(exact[0], fp64[0])
    for a, b in zip(exact[1], fp64[1]):
        assert torch.equal(a, b)


def test_the_decode_step_computes_the_bounded_gate_without_A_log_too():
    for has_A in (True, False):
        assert_parity("kda.fused_recurrent_decode+lower_bound",
                      decode_case(3, 1, 2, 32, 16, 5, lower_bound=-2.5, has_A=has_A), dtype="float32")


def test_bounded_and_softplus_differ_and_a_bad_bound_names_the_op():
    c = core_case(1, 20, 1, 1, 16, 16, 3, chunk=16, fused=True, lower_bound=-5.0)
    d = tensors(ops.get("kda.fused_chunked+lower_bound"), c, "float32")
    args = [d[n] for n in FUSED]
    o_b, _ = kda.fused_chunked(*args, chunk_size=16, lower_bound=-5.0)
    o_s, _ = kda.fused_chunked(*args, chunk_size=16)
    assert (o_b - o_s).abs().max() > 1e-3
    for op in (kda.fused_chunked, kda.fused_recurrent):
        with pytest.raises(ValueError, match=rf"kda\.{op.__name__}: lower_bound: expected a number in \[-5, 0\)"):
            op(*args, lower_bound=0.5)
        with pytest.raises(ValueError, match=rf"kda\.{op.__name__}: A_log: None is the bounded gate's form only"):
            op(*args[:5], None, args[6])
    with pytest.raises(ValueError, match="kda.gate: lower_bound"):
        kda.gate(d["g_raw"], d["A_log"], d["dt_bias"], lower_bound=-7)
    B = 2
    pool = torch.zeros(3, 1, 16, 16)
    with pytest.raises(ValueError, match="kda.fused_recurrent_decode: lower_bound"):
        kda.fused_recurrent_decode(args[0][:B, 0], args[1][:B, 0], args[2][:B, 0], args[3][:B, 0], args[4][:B, 0],
                                   args[5], args[6], pool, torch.tensor([0, 1]), lower_bound=True)


def test_the_optimized_model_runs_the_gate_its_checkpoint_names(parity_device):
    src = SyntheticSource(PRESETS["tiny-bounded"], 4)
    ids = np.array([7, 3, 11])
    model = optimized.load(src, device=parity_device, dtype="float32")
    assert model.variants["kda_gate"] == "lower_bound:-5"
    ref = reference.load(src).forward(ids)
    got = model.forward(torch.tensor(ids, device=parity_device)).double().cpu().numpy()
    assert np.max(np.abs(got - ref)) < 1e-4 * np.max(np.abs(ref))
    soft = optimized.load(src, device=parity_device, dtype="float32", kda_gate="softplus")
    assert soft.variants["kda_gate"] == "softplus"
    assert np.max(np.abs(soft.forward(torch.tensor(ids, device=parity_device)).double().cpu().numpy() - ref)) > 1e-2
