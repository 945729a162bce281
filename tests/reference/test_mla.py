"""MLA reference: the naive (expanded) and absorbed forms agree, decode matches prefill, and the
weight layout / causality / scale conventions hold against a loop written from the spec.

Error measure: rel_err = max|a - b| / max|b| (norm-relative)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import mla

TOL = 1e-12


def rel_err(a, b):
    """max|a - b| / max|b| (norm-relative)."""
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def make_inputs(seed, B, T, S, N, P, R, Vh, L):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, P + R))
    latent = rng.standard_normal((B, S, L))
    k_pe = rng.standard_normal((B, S, R))
    w_kvb = rng.standard_normal((N * (P + Vh), L)) / np.sqrt(L)
    return q, latent, k_pe, w_kvb


def loop_reference(q, latent, k_pe, w_kvb, P, Vh, scale):
    """Straight from spec b.11, one (b, t, head) at a time."""
    B, T, N, _ = q.shape
    S = latent.shape[1]
    o = np.zeros((B, T, N, Vh))
    for b in range(B):
        for t in range(T):
            pos = S - T + t
            for n in range(N):
                rows = w_kvb[n * (P + Vh) : (n + 1) * (P + Vh)]
                w_uk, w_uv = rows[:P], rows[P:]
                s = np.array([scale * (q[b, t, n, :P] @ (w_uk @ latent[b, j])
                                       + q[b, t, n, P:] @ k_pe[b, j]) for j in range(pos + 1)])
                p = np.exp(s - s.max())
                p /= p.sum()
                o[b, t, n] = sum(p[j] * (w_uv @ latent[b, j]) for j in range(pos + 1))
    return o


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(1, 2), S=st.integers(1, 12),
       T_frac=st.floats(0, 1), N=st.integers(1, 3), P=st.integers(1, 5), R=st.integers(1, 4),
       Vh=st.integers(1, 5), L=st.integers(1, 8))
def test_naive_equals_absorbed(seed, B, S, T_frac, N, P, R, Vh, L):
    T = max(1, round(T_frac * S))
    args = make_inputs(seed, B, T, S, N, P, R, Vh, L)
    o_n, o_a = mla.naive(*args), mla.absorbed(*args)
    assert o_n.shape == (B, T, N, Vh)
    assert rel_err(o_a, o_n) < TOL


def test_naive_matches_the_spec_loop():
    P, R, Vh = 3, 2, 4
    args = make_inputs(1, 2, 3, 7, 3, P, R, Vh, 5)
    expect = loop_reference(*args, P, Vh, (P + R) ** -0.5)
    assert rel_err(mla.naive(*args), expect) < 1e-13
    assert rel_err(mla.absorbed(*args, scale=0.3), loop_reference(*args, P, Vh, 0.3)) < 1e-13


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_decode_step_equals_the_last_row_of_prefill(form):
    run = getattr(mla, form)
    q, latent, k_pe, w_kvb = make_inputs(2, 2, 9, 9, 2, 4, 2, 3, 6)
    prefill = run(q, latent, k_pe, w_kvb)
    decode = run(q[:, -1:], latent, k_pe, w_kvb)  # T = 1 over S = 9 cached positions
    assert rel_err(decode[:, 0], prefill[:, -1]) < 1e-14
    chunk = run(q[:, 5:], latent, k_pe, w_kvb)  # chunked prefill: the last 4 over 9
    assert rel_err(chunk, prefill[:, 5:]) < 1e-14


def test_causal_future_positions_do_not_matter():
    q, latent, k_pe, w_kvb = make_inputs(3, 1, 6, 6, 2, 3, 2, 3, 4)
    o = mla.naive(q, latent, k_pe, w_kvb)
    latent2, k_pe2 = latent.copy(), k_pe.copy()
    latent2[:, 4:] += 100.0
    k_pe2[:, 4:] -= 50.0
    o2 = mla.naive(q, latent2, k_pe2, w_kvb)
    np.testing.assert_allclose(o2[:, :4], o[:, :4], rtol=1e-14, atol=0)
    assert not np.allclose(o2[:, 4:], o[:, 4:])


def test_single_position_returns_its_value():
    q, latent, k_pe, w_kvb = make_inputs(4, 1, 1, 1, 2, 3, 2, 4, 5)
    w = w_kvb.reshape(2, 7, 5)
    expect = np.einsum("nvl,l->nv", w[:, 3:], latent[0, 0])
    np.testing.assert_allclose(mla.absorbed(q, latent, k_pe, w_kvb)[0, 0], expect, rtol=1e-14)


def test_softmax_is_stable_for_huge_scores():
    q, latent, k_pe, w_kvb = make_inputs(5, 1, 4, 4, 2, 3, 2, 3, 4)
    with np.errstate(over="raise", invalid="raise"):
        o_n = mla.naive(q * 1e4, latent, k_pe, w_kvb)
        o_a = mla.absorbed(q * 1e4, latent, k_pe, w_kvb)
    assert np.all(np.isfinite(o_n)) and rel_err(o_a, o_n) < TOL


def test_shape_errors_name_the_argument():
    q, latent, k_pe, w_kvb = make_inputs(6, 1, 2, 4, 2, 3, 2, 3, 4)
    with pytest.raises(ValueError, match=r"q: expected \[B,T,N,P\+R\]"):
        mla.naive(q[0], latent, k_pe, w_kvb)
    with pytest.raises(ValueError, match=r"latent: expected \[B,S,L\]"):
        mla.naive(q, latent[:, :1], k_pe, w_kvb)  # S < T
    with pytest.raises(ValueError, match=r"k_pe: expected \[B,S,R\]"):
        mla.absorbed(q, latent, k_pe[:, :3], w_kvb)
    with pytest.raises(ValueError, match=r"w_kvb: expected \[N\*\(P\+Vh\), L\]"):
        mla.absorbed(q, latent, k_pe, w_kvb[:-1])


def test_absorbed_over_ragged_lengths_is_each_sequence_alone():
    # padding rows hold large values: were any key past a sequence's length seen, it would show
    rng = np.random.default_rng(3)
    B, N, P, R, L, Vh, S = 3, 4, 8, 4, 16, 8, 9
    w = rng.standard_normal((N * (P + Vh), L))
    lengths = [5, 1, 9]
    lat, pe = rng.standard_normal((B, S, L)), rng.standard_normal((B, S, R))
    for b, n in enumerate(lengths):
        lat[b, n:], pe[b, n:] = 1e3, -1e3
    q = rng.standard_normal((B, 1, N, P + R))
    o = mla.absorbed(q, lat, pe, w, lengths=lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(o[b], mla.absorbed(q[b:b + 1], lat[b:b + 1, :n], pe[b:b + 1, :n], w)[0],
                                   rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match=r"lengths: expected 3 ints in \[T, S\] = \[1, 9\]"):
        mla.absorbed(q, lat, pe, w, lengths=[5, 0, 9])
