"""KDA reference: the chunked form against the recurrence, and the conventions of both.

Error measure: ``rel_err(a, b) = max|a - b| / max|b|``, the worst absolute difference relative to
the largest reference magnitude of the tensor (norm-relative, so tiny entries of a strongly
decayed output do not inflate it). Both forms are float64; 1e-12 leaves ~1000x headroom over the
observed ~1e-15.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import kda
from reference.elementwise import sigmoid
from reference.norm import l2norm

TOL = 1e-12


def rel_err(a, b):
    """max|a - b| / max|b| (norm-relative); 0 when both are zero."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.max(np.abs(b), initial=0.0)
    diff = np.max(np.abs(a - b), initial=0.0)
    return diff if scale == 0 else diff / scale


def make_inputs(seed, B, T, H, HV, K, V, *, max_decay=1.0, with_state=True):
    """Normalized q, k; beta in (0, 1); per-channel log-decays log-uniform in [-max_decay, -1e-4]."""
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((B, T, H, K)))
    k = l2norm(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, HV, V))
    g = -np.exp(rng.uniform(np.log(1e-4), np.log(max_decay), (B, T, HV, K)))
    beta = rng.uniform(0.05, 1.0, (B, T, HV))
    S0 = rng.standard_normal((B, HV, K, V)) if with_state else None
    return q, k, v, g, beta, S0


def assert_forms_agree(q, k, v, g, beta, S0, chunk_size, **kw):
    o_r, s_r = kda.recurrent(q, k, v, g, beta, initial_state=S0, **kw)
    o_c, s_c = kda.chunked(q, k, v, g, beta, initial_state=S0, chunk_size=chunk_size, **kw)
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(s_c))
    assert rel_err(o_c, o_r) < TOL, rel_err(o_c, o_r)
    assert rel_err(s_c, s_r) < TOL, rel_err(s_c, s_r)
    return o_r, s_r


@st.composite
def kda_cases(draw):
    H = draw(st.integers(1, 2))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        B=draw(st.integers(1, 2)),
        T=draw(st.one_of(st.just(1), st.integers(1, 140))),
        H=H,
        HV=H * draw(st.sampled_from([1, 2, 3])),
        K=draw(st.integers(1, 9)),
        V=draw(st.integers(1, 9)),
        max_decay=draw(st.sampled_from([1e-3, 0.1, 1.0, 12.0])),
        with_state=draw(st.booleans()),
    )


@settings(max_examples=25, deadline=None)
@given(case=kda_cases(), chunk_size=st.sampled_from([16, 32, 64]))
def test_chunked_matches_recurrent_on_drawn_shapes(case, chunk_size):
    assert_forms_agree(*make_inputs(**case), chunk_size)


@pytest.mark.parametrize("T, chunk_size", [(1, 64), (63, 64), (64, 64), (65, 64), (100, 16),
                                           (97, 32), (200, 64)])
def test_chunked_matches_recurrent_at_chunk_edges(T, chunk_size):
    # K != V and GVA (HV = 2 H) in every case, B > 1, an initial state
    assert_forms_agree(*make_inputs(T, 2, T, 2, 4, 5, 3, max_decay=12.0), chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_strong_decays_give_finite_outputs_equal_to_the_recurrence(chunk_size):
    # cumulative gates far beyond -709 inside one chunk (60 to 120 per step in half the
    # channels, mild in the others), so exp(G_j - G_i) for j > i would overflow if it were formed
    q, k, v, _, beta, S0 = make_inputs(1, 2, 150, 2, 2, 6, 4)
    rng = np.random.default_rng(2)
    strong = rng.uniform(60.0, 120.0, (2, 150, 2, 6))
    g = -np.where(rng.random((2, 150, 2, 6)) < 0.5, strong, 1e-3)
    g[:, 64:128] = -1e-3  # mild chunks in between: both evaluation paths in one sequence
    assert np.min(np.cumsum(g[:, :chunk_size], axis=1)) < -1000
    with np.errstate(over="raise", invalid="raise"):
        assert_forms_agree(q, k, v, g, beta, S0, chunk_size)


def test_both_intra_chunk_evaluations_agree():
    # factored exp(G_i) exp(-G_j) (used for moderate chunks) vs the masked pairwise difference
    q, k, _, g, _, _ = make_inputs(3, 1, 64, 2, 2, 7, 3, max_decay=5.0)
    q, k, g = (np.moveaxis(x, 1, 2) for x in (q, k, g))
    G = np.cumsum(g, axis=-2)
    assert np.max(np.abs(G)) <= kda._FACTORED_RANGE_MAX
    Aqk, Akk = kda._pairwise(q, k, G)
    k_inv_t = np.swapaxes(k * np.exp(-G), -1, -2)
    assert rel_err(np.tril((q * np.exp(G)) @ k_inv_t), Aqk) < 1e-14
    assert rel_err(np.tril((k * np.exp(G)) @ k_inv_t), Akk) < 1e-14


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_cu_seqlens_equals_running_each_sequence_alone(form):
    cu = np.array([0, 5, 5, 70, 71, 150])  # an empty sequence, a one-token one, a ragged one
    q, k, v, g, beta, _ = make_inputs(4, 1, 150, 2, 4, 5, 3, max_decay=3.0)
    S0 = np.random.default_rng(5).standard_normal((5, 4, 5, 3))
    run = getattr(kda, form)
    kw = {"chunk_size": 32} if form == "chunked" else {}
    o, s = run(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, **kw)
    assert s.shape == (5, 4, 5, 3)
    for n in range(5):
        a, b = cu[n], cu[n + 1]
        o_n, s_n = run(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                       initial_state=S0[n : n + 1], **kw)
        assert rel_err(o[:, a:b], o_n) <= 1e-14  # 0 for the empty one
        assert rel_err(s[n : n + 1], s_n) <= 1e-14
    np.testing.assert_array_equal(s[1], S0[1])  # the empty sequence keeps its state
    o_r, s_r = kda.recurrent(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    assert rel_err(o, o_r) < TOL and rel_err(s, s_r) < TOL


@pytest.mark.parametrize("T1", [1, 30, 64, 65, 100])
def test_split_prefill_with_carried_state_equals_one_prefill(T1):
    q, k, v, g, beta, S0 = make_inputs(6, 2, 130, 1, 2, 4, 6, max_decay=2.0)
    o, s = kda.chunked(q, k, v, g, beta, initial_state=S0)
    part = lambda x, sl: x[:, sl]  # noqa: E731
    o1, s1 = kda.chunked(*(part(x, slice(0, T1)) for x in (q, k, v, g, beta)), initial_state=S0)
    o2, s2 = kda.chunked(*(part(x, slice(T1, None)) for x in (q, k, v, g, beta)), initial_state=s1)
    assert rel_err(np.concatenate([o1, o2], axis=1), o) < TOL
    assert rel_err(s2, s) < TOL


def test_one_token_from_zero_state_by_hand():
    # S = k (beta v)^T, o = scale (q . k) beta v
    q, k, v, g, beta, _ = make_inputs(7, 1, 1, 1, 1, 4, 3, with_state=False)
    o, s = kda.recurrent(q, k, v, g, beta)
    b = beta[0, 0, 0]
    np.testing.assert_allclose(s[0, 0], np.outer(k[0, 0, 0], b * v[0, 0, 0]), rtol=1e-15)
    expect = 4 ** -0.5 * np.dot(q[0, 0, 0], k[0, 0, 0]) * b * v[0, 0, 0]
    np.testing.assert_allclose(o[0, 0, 0], expect, rtol=1e-14)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_state_is_k_first(form):
    # k = 0 and g = 0: the state is untouched and o = scale * S^T q reads it as [K, V]
    K, V = 5, 3
    q, _, v, _, beta, S0 = make_inputs(8, 1, 3, 1, 1, K, V)
    zeros = np.zeros((1, 3, 1, K))
    o, s = getattr(kda, form)(q, zeros, v, zeros, beta, initial_state=S0, scale=0.5)
    np.testing.assert_array_equal(s, S0)
    np.testing.assert_allclose(o[0, :, 0], 0.5 * q[0, :, 0] @ S0[0, 0], rtol=1e-14)
    with pytest.raises(ValueError, match=r"initial_state: expected \[B,HV,K,V\]"):
        getattr(kda, form)(q, zeros, v, zeros, beta, initial_state=S0.swapaxes(-1, -2))


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_gva_value_head_reads_qk_head_hv_div_group(form):
    q, k, v, g, beta, S0 = make_inputs(9, 2, 40, 2, 6, 4, 3)  # 3 value heads per qk head
    run = getattr(kda, form)
    o, s = run(q, k, v, g, beta, initial_state=S0)
    o_x, s_x = run(np.repeat(q, 3, axis=2), np.repeat(k, 3, axis=2), v, g, beta, initial_state=S0)
    np.testing.assert_array_equal(o, o_x)
    np.testing.assert_array_equal(s, s_x)


def test_default_scale_is_k_to_the_minus_half_and_inputs_are_untouched():
    args = make_inputs(10, 1, 20, 1, 1, 9, 2)
    copies = [a.copy() for a in args]
    o, _ = kda.chunked(*args[:5], initial_state=args[5])
    o_s, _ = kda.chunked(*args[:5], initial_state=args[5], scale=9 ** -0.5)
    np.testing.assert_array_equal(o, o_s)
    kda.recurrent(*args[:5], initial_state=args[5])
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


def test_gate_is_minus_exp_a_times_softplus_with_flat_dt_bias():
    rng = np.random.default_rng(11)
    HV, K = 3, 4
    g_raw = rng.standard_normal((2, 5, HV, K)) * 10
    A_log = rng.standard_normal(HV)
    dt_bias = rng.standard_normal(HV * K)
    g = kda.gate(g_raw, A_log, dt_bias)
    hv, d = 2, 1
    x = g_raw[1, 3, hv, d] + dt_bias[hv * K + d]
    sp = x if x > 20 else np.log1p(np.exp(x))
    np.testing.assert_allclose(g[1, 3, hv, d], -np.exp(A_log[hv]) * sp, rtol=1e-15)
    assert np.all(g <= 0)
    np.testing.assert_array_equal(kda.gate(g_raw, A_log.reshape(1, 1, HV, 1), dt_bias), g)
    with pytest.raises(ValueError, match=r"A_log: expected \[HV\]"):
        kda.gate(g_raw, A_log[:2], dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias: expected \[HV\*K\]"):
        kda.gate(g_raw, A_log, dt_bias.reshape(HV, K))


def test_fused_forms_are_the_composition():
    rng = np.random.default_rng(12)
    B, T, H, HV, K, V = 1, 50, 2, 4, 6, 5
    q, k = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K))
    v, g_raw = rng.standard_normal((B, T, HV, V)), rng.standard_normal((B, T, HV, K))
    b_logits, A_log, dt_bias = rng.standard_normal((B, T, HV)), rng.standard_normal(HV), \
        rng.standard_normal(HV * K)
    S0 = rng.standard_normal((B, HV, K, V))
    o, s = kda.fused_recurrent(q, k, v, g_raw, b_logits, A_log, dt_bias, initial_state=S0)
    o_e, s_e = kda.recurrent(l2norm(q), l2norm(k), v, kda.gate(g_raw, A_log, dt_bias),
                             sigmoid(b_logits), initial_state=S0)
    np.testing.assert_array_equal(o, o_e)
    np.testing.assert_array_equal(s, s_e)
    o_c, s_c = kda.fused_chunked(q, k, v, g_raw, b_logits, A_log, dt_bias, initial_state=S0,
                                 chunk_size=16)
    assert rel_err(o_c, o) < TOL and rel_err(s_c, s) < TOL


@pytest.mark.parametrize("bad, message", [
    (dict(q=np.zeros((1, 4, 2))), r"q: expected \[B,T,H,K\]"),
    (dict(k=np.zeros((1, 4, 2, 4))), r"k: expected \[B,T,H,K\]"),
    (dict(v=np.zeros((1, 4, 3, 5))), r"v: expected \[B,T,HV,V\]"),
    (dict(g=np.zeros((1, 4, 2, 5))), r"g: expected \[B,T,HV,K\]"),
    (dict(beta=np.zeros((1, 4, 1))), r"beta: expected \[B,T,HV\]"),
])
def test_shape_errors_name_the_argument(bad, message):
    args = dict(q=np.zeros((1, 4, 2, 3)), k=np.zeros((1, 4, 2, 3)), v=np.zeros((1, 4, 2, 5)),
                g=np.zeros((1, 4, 2, 3)), beta=np.zeros((1, 4, 2)))
    args.update(bad)
    for run in (kda.recurrent, kda.chunked):
        with pytest.raises(ValueError, match=message):
            run(**args)


def test_cu_seqlens_errors():
    q, k, v, g, beta, _ = make_inputs(13, 2, 10, 1, 1, 3, 3, with_state=False)
    with pytest.raises(ValueError, match="cu_seqlens: requires B == 1"):
        kda.chunked(q, k, v, g, beta, cu_seqlens=np.array([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens: expected"):
        kda.chunked(*(x[:1] for x in (q, k, v, g, beta)), cu_seqlens=np.array([0, 4, 9]))
    with pytest.raises(ValueError, match=r"initial_state: expected \[N,HV,K,V\]"):
        kda.chunked(*(x[:1] for x in (q, k, v, g, beta)), cu_seqlens=np.array([0, 4, 10]),
                    initial_state=np.zeros((1, 1, 3, 3)))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunked(q, k, v, g, beta, chunk_size=0)


@pytest.mark.parametrize("T", [200, 256])
@pytest.mark.parametrize("chunks_per_block", [1, 2, 3, 100])
def test_blocks_of_chunks_change_no_result_beyond_rounding(monkeypatch, T, chunks_per_block):
    # the state-free work of several chunks at once (blocks of 1, 2, 3 or every chunk; a ragged
    # final chunk of 8 tokens at T = 200) against the recurrence, and against the default blocks (`one`)
    B, HV, K, V, c = 2, 4, 5, 3, 64
    args = make_inputs(T + chunks_per_block, B, T, 2, HV, K, V, max_decay=12.0)
    one, _ = kda.chunked(*args[:5], initial_state=args[5], chunk_size=c)
    for budget in ("CHUNK_BLOCK_BYTES", "CPU_CHUNK_BLOCK_BYTES"):
        monkeypatch.setattr(kda, budget, chunks_per_block * B * HV * c * c * 8)
    calls = []
    monkeypatch.setattr(kda, "_chunks", lambda *a, _f=kda._chunks: calls.append(a[-1]) or _f(*a))
    o_r, _ = assert_forms_agree(*args, c)
    o_b, _ = kda.chunked(*args[:5], initial_state=args[5], chunk_size=c)
    assert rel_err(o_b, one) < 1e-14
    whole, n = T // c, min(chunks_per_block, T // c)
    per_run = [n] * (whole // n) + [whole % n] * (whole % n > 0) + [1] * (T % c > 0)  # the tail alone
    assert calls == per_run * 2
