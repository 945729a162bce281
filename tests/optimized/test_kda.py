"""optimized.kda (gate, recurrent, chunked and their fused forms): values judged through the
registry (``parity.testing.assert_parity``: the KDA records' bounds, docs/error-bounds.md), on
inputs built by the records' case builders (parity/ops/kda/inputs.py) at the shapes that reach the
kernels' paths: T = 1, ragged and exact chunk ends, GVA, K != V, K = 96 (two gate-kernel channel
programs), chunk sizes 16 and 32, varlen with an empty sequence, strong decays, bf16 gate inputs.
What only a kernel test can say stays here: the chunk pipeline's stages, unwritten memory, bytes
(run to run, split prefill at a chunk boundary) and argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from optimized import _counters, kda
from parity import ops
from parity.bounds.core import precision_for
from parity.certify.candidate import of
from parity.certify.check import tensors
from parity.metrics import compare
from parity.ops.kda import emulate as emu
from parity.ops.kda.args import CORE, FUSED
from parity.ops.kda.inputs import core_case
from parity.ops.kda.stages import STAGES, chunk_stage
from parity.platform import store_rounding
from parity.registry import Case
from parity.testing import assert_parity


def inputs(op, case, dtype):
    """The case's tensors for ``op`` at ``dtype`` (rounded by the record's input policy)."""
    return tensors(ops.get(f"kda.{op}"), case, dtype)


def run(op, d, **kw):
    names = CORE if op in ("recurrent", "chunked") else FUSED
    return getattr(kda, op)(*(d[n] for n in names), initial_state=d["initial_state"], **kw)


def case(B, T, H, HV, K, V, seed, *, op="chunked", **kw):
    """core_case for ``op`` (chunk size 64 for the chunked forms unless given)."""
    chunked = op.endswith("chunked")
    return core_case(B, T, H, HV, K, V, seed, fused=op.startswith("fused"),
                     chunk=kw.pop("chunk", 64) if chunked else None, **kw)


# ------------------------------------------------------------------------------------------------
# gate


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_gate(dtype):
    """Past softplus's threshold (20), very negative and large arguments; float32 out (float64 for
    fp64); a checkpoint-shaped A_log [1, 1, HV, 1] gives the same bits."""
    r = np.random.default_rng(3)
    B, T, HV, K = 2, 37, 3, 24
    g_raw = r.standard_normal((B, T, HV, K)) * 8
    g_raw.reshape(-1)[:8] = [20.0, 21.0, 19.5, -30.0, -80.0, 0.0, 60.0, -3.0]
    x = {"g_raw": g_raw, "A_log": np.log(1 + 15 * r.random(HV)), "dt_bias": r.standard_normal(HV * K)}
    _counters.reset()
    g = assert_parity("kda.gate", x, dtype=dtype).values["g"]
    assert _counters.snapshot()["kda.gate"] == 1
    assert g.dtype == (torch.float64 if dtype == "float64" else torch.float32) and g.shape == (B, T, HV, K)
    assert bool((g <= 0).all())
    t = tensors(ops.get("kda.gate"), Case(x), dtype)
    assert torch.equal(kda.gate(t["g_raw"], t["A_log"].view(1, 1, HV, 1), t["dt_bias"]), g)


# ------------------------------------------------------------------------------------------------
# recurrent / chunked against the reference


CASES = [  # (B, T, H, HV, K, V, initial state)
    pytest.param(2, 65, 1, 2, 32, 64, True, id="B2-T65-gva-K32V64-h0"),
    pytest.param(1, 1, 2, 2, 16, 32, True, id="T1"),
    pytest.param(1, 15, 1, 1, 32, 16, False, id="T15"),
    pytest.param(1, 63, 1, 1, 16, 32, False, id="T63"),
    pytest.param(1, 64, 1, 2, 32, 16, True, id="T64-gva"),
    pytest.param(1, 130, 1, 1, 64, 32, True, id="T130-K64V32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,h0", CASES)
def test_chunked_fp32(B, T, H, HV, K, V, h0):
    assert_parity("kda.chunked", case(B, T, H, HV, K, V, seed=T, has_state=h0), dtype="float32")


# This input reached 1.14x the bf16 bound while the model took the chunk's query-key and key-key
# matrices as values stored at u: the kernel forms them from bf16 tl.dot operands, which err relative
# to sum |q||k| (docs/error-bounds.md, "KDA recurrent and chunked"). Now 0.22 (seeds 1-8: 0.18-0.25,
# CPU interpreter).
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_chunked_dtypes(dtype):
    j = assert_parity("kda.chunked", case(2, 65, 1, 2, 32, 64, seed=1), dtype=dtype)
    o, s = j.values["o"], j.values["final_state"]
    assert o.dtype == getattr(torch, dtype) and s.dtype == (torch.float64 if dtype == "float64" else torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("T", [1, 15, 65])
def test_recurrent(dtype, T):
    assert_parity("kda.recurrent", case(2, T, 1, 2, 32, 16, seed=10 + T, op="recurrent"), dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["fused_chunked", "fused_recurrent"])
def test_fused(op, dtype):
    """Raw q/k, g_raw, beta logits: l2norm, the gate and the sigmoid fused in the kernel."""
    assert_parity(f"kda.{op}", case(1, 70, 2, 4, 32, 32, seed=5, op=op), dtype=dtype)


@pytest.mark.parametrize("op", ["fused_chunked", "fused_recurrent"])
def test_fused_fp64(op):
    assert_parity(f"kda.{op}", case(1, 33, 1, 1, 16, 16, seed=6, op=op), dtype="float64")


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes(chunk_size):
    assert_parity("kda.chunked", case(1, 50, 1, 1, 16, 16, seed=chunk_size, chunk=chunk_size), dtype="float32")


def test_varlen():
    """cu_seqlens with an empty and a ragged sequence, per-sequence initial states; chunked and
    recurrent, fused and not (chunks restart at every sequence start); a plain list works too;
    the empty sequence passes its initial state through unchanged."""
    cu = [0, 5, 5, 70, 130]
    for op in ("chunked", "recurrent", "fused_chunked"):
        c = case(1, 130, 1, 2, 32, 32, seed=7, op=op, cu_seqlens=cu)
        s = assert_parity(f"kda.{op}", c, dtype="float32").values["final_state"]
        assert s.shape == (4, 2, 32, 32)

    def as_list(*args, cu_seqlens, **kw):
        return kda.fused_recurrent(*args, cu_seqlens=cu_seqlens.tolist(), **kw)

    c = case(1, 130, 1, 2, 32, 32, seed=7, op="fused_recurrent", cu_seqlens=cu)
    s = assert_parity("kda.fused_recurrent", c, dtype="float32", candidate=of(as_list, triton=True)).values["final_state"]
    assert torch.equal(s[1], torch.tensor(c.arrays["initial_state"][1], dtype=torch.float32, device=s.device))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["fused_chunked", "fused_recurrent"])
def test_strong_decay(op, dtype):
    """Decays of ~5 .. 130 per token (prefix sums to thousands within a chunk, pairwise differences
    far past exp's range): finite outputs within the bound."""
    assert_parity(f"kda.{op}", case(1, 80, 1, 2, 32, 32, seed=8, op=op, strength="strong"), dtype=dtype)


def _chunks_of_both_forms(T, **kw):
    """A fused softplus case at chunk 16 (K = 128, the production tiles) whose chunks decay mildly
    (e^-0.05 to e^-1 a token: their blocks are formed through their first row), but for head 0's
    tokens 16-19, whose gate (raw 400 on 8 channels) decays past e^-75 (the four levels)."""
    c = case(1, T, 2, 2, 128, 32, 12, op="fused_chunked", chunk=16, strength="moderate", **kw)
    c.arrays["g_raw"][0, 16:20, 0, :8] = 400.0
    return c


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_one_kernel_prepare_at_chunk_16_takes_the_softplus_gate(dtype):
    """Chunk 16 under the fused softplus gate runs kernels 1-3 as one (``_prepare16_kernel``), each
    chunk's block in the form its decay allows (the slow chunks' through the levels in a second
    launch): within the bound, varlen, an initial state."""
    assert assert_parity("kda.fused_chunked", _chunks_of_both_forms(45, varlen=True), dtype=dtype,
                         candidate=of(kda.fused_chunked, triton=True)).ratio < 1


def test_the_softplus_prepare_forms_each_block_as_its_chunks_decay_allows(parity_device):
    """The softplus gate's prepare16 kernel with ``bounded_diag=False`` forms every block through
    the four levels of reference rows, on the interpreter the three kernels' bits
    (``prepare16=False``, at the same ``inverse_levels``; on an H100 the kernel's G differs from
    the gate kernel's in the last bits); with ``bounded_diag`` a chunk whose G_last falls below -75
    in some channel keeps the levels' bits (its second launch), and the others, formed through
    their first row, differ. In bf16, where the MMA fixes each dot's order of sums."""
    from optimized.kda import chunk as chunk_mod
    d = {n: None if t is None else t.to(parity_device)
         for n, t in inputs("fused_chunked", _chunks_of_both_forms(64), "bfloat16").items()}

    def run16(**launch):
        st = {}
        o, s = chunk_mod._pipeline("kda.fused_chunked", *(d[n] for n in FUSED), None, d["initial_state"], 16,
                                   None, fused=True, stages=st, launch=kda.ChunkLaunch(**launch))
        return (o, s), st

    (three, _), (levels, lv), (default, df) = (run16(prepare16=False, inverse_levels=1),
                                              run16(bounded_diag=False), run16())
    if parity_device == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(three, levels))
    G_last = lv["G"][0, 15::16].amin(-1)                      # [chunks, HV]: each chunk's lowest G_last
    Aq = [x["Aq"][0].unflatten(0, (-1, 16)) for x in (lv, df)]  # [chunks, 16, HV, 16]
    same = (Aq[0] == Aq[1]).all(-1).all(1)                    # [chunks, HV]
    slow = G_last < -chunk_mod.FIRST_ROW_SPAN.value
    assert slow.sum() == 1 and bool(slow[1, 0])
    assert bool(same[slow].all()) and not bool(same[~slow].any())


def test_bf16_gate_and_beta_inputs():
    """g and beta given in bf16 (the kernels widen any float dtype on load)."""
    c = case(1, 40, 1, 1, 16, 16, seed=9, has_state=False)
    for n in ("g", "beta"):  # values a bf16 tensor holds exactly
        c.arrays[n] = torch.tensor(c.arrays[n]).bfloat16().double().numpy()

    def bf16_gate(q, k, v, g, beta, **kw):
        return kda.chunked(q, k, v, g.bfloat16(), beta.bfloat16(), **kw)

    assert_parity("kda.chunked", c, dtype="bfloat16", candidate=of(bf16_gate, triton=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunk_stages(dtype, parity_device):
    """Each stored intermediate of the chunk pipeline against its float64 value (parity.emulate's
    chunked form at float64) within parity.ops.kda.stages' bracket: localizes a wrong kernel
    (G -> gate kernel; Aq, kg, qg -> blocks kernel; w, u -> WY kernel; h, v_new -> state kernel)."""
    from optimized.kda import chunk as chunk_mod
    T, BT = 100, 64
    c = case(2, T, 1, 2, 32, 32, seed=14, chunk=BT)
    d = inputs("chunked", c, dtype)
    st = {}
    chunk_mod._pipeline("kda.chunked", d["q"], d["k"], d["v"], d["g"], d["beta"], None, None, None,
                        d["initial_state"], BT, None, fused=False, stages=st)
    ref = {}
    emu.chunked(*(d[n].double().cpu() for n in CORE), initial_state=d["initial_state"].double().cpu(),
                chunk_size=BT, stages=ref)
    p = precision_for(dtype, rounding=store_rounding(dtype, parity_device))
    ratios = {}
    for name in STAGES:
        r = ref[name].numpy()
        got = compare(f"stage {name} ({dtype})", r, st[name], chunk_stage(name, r, ref["G"].numpy(), p,
                                                                       T=T, K=32, chunk=BT))
        assert got.passed, got.report()
        ratios[name] = got.ratio
    print(f"chunk stages {dtype}: err/bound " + ", ".join(f"{n} {x:.3g}" for n, x in ratios.items()))


# ------------------------------------------------------------------------------------------------
# bytes: determinism and split invariance


def test_run_to_run_bitwise():
    d = inputs("fused_chunked", case(1, 70, 1, 2, 32, 32, seed=11, op="fused_chunked"), "bfloat16")
    for op in ("fused_chunked", "fused_recurrent"):
        a, b = run(op, d), run(op, d)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), op


def test_gate_channel_blocks():
    """K = 96 > 64: the gate kernel runs two channel programs per (chunk, head), the second one
    partly masked, and only the first writes beta (the real K = 128 takes two full ones)."""
    assert_parity("kda.fused_chunked", case(1, 70, 1, 2, 96, 16, seed=22, op="fused_chunked"), dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_kernel_reads_unwritten_memory(dtype, monkeypatch):
    """Every buffer the chunk pipeline allocates starts as NaN: the output and state keep their bits,
    so no kernel reads an element no kernel wrote (the blocks right of Akk's and Aqk's diagonal, rows
    past a sequence end), ragged and varlen."""
    cu = [0, 5, 5, 70, 130]
    d = inputs("fused_chunked", case(1, 130, 1, 2, 32, 32, seed=21, op="fused_chunked", cu_seqlens=cu), dtype)
    one = d | {"initial_state": d["initial_state"][:1]}
    clean = [run("fused_chunked", d, cu_seqlens=cu), run("fused_chunked", one)]
    empty = torch.empty

    def poisoned(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    dirty = [run("fused_chunked", d, cu_seqlens=cu), run("fused_chunked", one)]
    for (o, s), (o2, s2) in zip(clean, dirty):
        assert torch.equal(o, o2) and torch.equal(s, s2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_output_in_the_state_pass_keeps_the_bits(dtype):
    """The state pass with the output fused into it (the default) and the separate state and output
    kernels (``fused_output=False``) round the same values: bitwise equal, varlen with an empty and
    a ragged sequence and an initial state, at 64 V columns per program (the interpreter's default:
    one SM), 32 and 16 (V = 48: a partly masked block)."""
    from dataclasses import replace
    cu = [0, 5, 5, 70, 130]
    d = inputs("fused_chunked", case(1, 130, 1, 2, 32, 48, seed=23, op="fused_chunked", cu_seqlens=cu), dtype)
    fused = run("fused_chunked", d, cu_seqlens=cu)
    split = run("fused_chunked", d, cu_seqlens=cu, launch=replace(kda.ChunkLaunch(), fused_output=False))
    for bv in (16, 32):
        narrow = run("fused_chunked", d, cu_seqlens=cu, launch=replace(kda.ChunkLaunch(), fused_block_v=bv))
        assert torch.equal(fused[0], narrow[0]) and torch.equal(fused[1], narrow[1]), bv
    assert torch.equal(fused[0], split[0]) and torch.equal(fused[1], split[1])


def _state_lost_at(cut):
    """fused_chunked in two calls whose second starts from zeros, not the first's state: a pass that
    drops its state at a chunk boundary."""
    def lost(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, initial_state=None, **kw):
        head = [x[:, :cut] for x in (q, k, v, g_raw, beta_logits)]
        tail = [x[:, cut:] for x in (q, k, v, g_raw, beta_logits)]
        o1, _ = kda.fused_chunked(*head, A_log, dt_bias, initial_state=initial_state, **kw)
        o2, s2 = kda.fused_chunked(*tail, A_log, dt_bias, **kw)
        return torch.cat([o1, o2], 1), s2
    return lost


@pytest.mark.parametrize("dtype,T,strength,lower_bound", [
    ("bfloat16", 32, "slow", None), ("bfloat16", 32, "mixed", -5.0), ("bfloat16", 48, "mixed", None),
    ("bfloat16", 100, "slow", -5.0), ("float32", 48, "slow", -5.0)])
def test_a_state_lost_at_a_chunk_boundary_is_caught(dtype, T, strength, lower_bound):
    """The state dropped after the first 16-token chunk: past the bound in bf16 too (the chunk
    storage terms are worst-case bounds, not scaled by LAMBDA; docs/error-bounds.md), as in float32."""
    c = case(1, T, 1, 2, 32, 32, seed=3, op="fused_chunked", chunk=16, strength=strength, lower_bound=lower_bound)
    name = "kda.fused_chunked" + ("" if lower_bound is None else "+lower_bound")
    with pytest.raises(AssertionError, match="not within its bound"):
        assert_parity(name, c, dtype=dtype, candidate=of(_state_lost_at(16), triton=True))


def test_split_prefill():
    """Prefill in two calls carrying the state: bitwise equal to one call when the split is at a
    chunk boundary (chunked) or anywhere (recurrent: the state stays fp32 either way); at an
    unaligned chunked split each call is within its bound, the second from the first's state."""
    T = 96
    c = case(1, T, 1, 2, 32, 32, seed=12, op="fused_chunked")
    d = inputs("fused_chunked", c, "float32")

    def part(sl, h0):
        e = dict(d)
        for n in ("q", "k", "v", "g_raw", "beta_logits"):
            e[n] = d[n][:, sl]
        e["initial_state"] = h0
        return e

    for op, split in (("fused_chunked", 64), ("fused_recurrent", 37)):
        o, s = run(op, d)
        o1, s1 = run(op, part(slice(0, split), d["initial_state"]))
        o2, s2 = run(op, part(slice(split, T), s1))
        assert torch.equal(torch.cat([o1, o2], 1), o) and torch.equal(s2, s), f"{op} split at {split}"
    h0 = d["initial_state"]
    for sl in (slice(0, 40), slice(40, T)):
        x = {n: t[:, sl] for n, t in part(sl, h0).items() if n in ("q", "k", "v", "g_raw", "beta_logits")}
        x.update(A_log=d["A_log"], dt_bias=d["dt_bias"], initial_state=h0)
        h0 = assert_parity("kda.fused_chunked", x, kwargs={"chunk_size": 64}, dtype="float32").values["final_state"]


def test_argument_errors():
    d = inputs("chunked", case(1, 8, 1, 2, 16, 16, seed=0), "float32")
    f = inputs("fused_recurrent", case(1, 8, 1, 2, 16, 16, seed=0, op="fused_recurrent"), "float32")
    with pytest.raises(ValueError, match="v:"):
        kda.chunked(d["q"], d["k"], d["v"][:, :4], d["g"], d["beta"])
    with pytest.raises(ValueError, match="beta"):
        kda.recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"][..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], chunk_size=48)
    with pytest.raises(ValueError, match=r"kda\.chunked: launch\.inverse_levels: expected None or 0 to 4, "
                                         r"got 5"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], launch=kda.ChunkLaunch(inverse_levels=5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="dt_bias"):
        kda.fused_recurrent(f["q"], f["k"], f["v"], f["g_raw"], f["beta_logits"], f["A_log"], f["dt_bias"][:5])
    with pytest.raises(TypeError, match="dtype"):
        kda.recurrent(d["q"], d["k"], d["v"].double(), d["g"], d["beta"])
