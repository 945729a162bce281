"""Certification of the float64 reference against 50-digit mpmath.

Elementwise functions over their whole range (linear and log-spaced arguments, around the softplus
threshold, |x| up to 700 where sigmoid's tail is still a normal float64) to a few ulp of relative
error; norms at tiny shapes; and the KDA recurrence (both float64 forms) against a 50-digit
recurrence written here independently from spec b.8.
"""
import mpmath
import numpy as np
import pytest

from reference import kda
from reference.elementwise import sigmoid, silu, softplus
from reference.norm import gated_rms_norm, l2norm, rms_norm

mpmath.mp.dps = 50
ULP = 2.0 ** -52  # relative spacing of float64 at 1


def mp_sigmoid(x):
    return 1 / (1 + mpmath.exp(-x))


def mp_silu(x):
    return x * mp_sigmoid(x)


def mp_softplus(x, threshold=20.0):
    return x if x > threshold else mpmath.log1p(mpmath.exp(x))


def arguments():
    mags = np.concatenate([np.logspace(-300, 2.845, 400), np.linspace(0, 700, 701)[1:]])
    near = 20.0 + np.array([-1e-9, -1e-14, 0.0, 1e-14, 1e-9, 0.5, -0.5])  # softplus threshold
    return np.unique(np.concatenate([-mags, [0.0], mags, near, -near]))


def max_rel_err_ulp(fn, mp_fn, xs):
    worst = 0.0
    for x, y in zip(xs, fn(xs)):
        exact = mp_fn(mpmath.mpf(float(x)))  # float -> mpf is exact
        if exact == 0:
            assert y == 0
            continue
        worst = max(worst, float(abs((mpmath.mpf(float(y)) - exact) / exact)) / ULP)
    return worst


@pytest.mark.parametrize("fn, mp_fn, ulps", [(sigmoid, mp_sigmoid, 3), (silu, mp_silu, 3),
                                             (softplus, mp_softplus, 3)])
def test_elementwise_within_a_few_ulp_over_the_whole_range(fn, mp_fn, ulps):
    assert max_rel_err_ulp(fn, mp_fn, arguments()) <= ulps


def test_softplus_without_threshold_is_the_exact_function():
    xs = np.concatenate([np.linspace(-700, 700, 281), [19.999, 20.0, 20.001, 35.0, 36.0]])
    err = max_rel_err_ulp(lambda x: softplus(x, threshold=np.inf),
                          lambda x: mpmath.log1p(mpmath.exp(x)), xs)
    assert err <= 3


def mp_rms(row, eps):
    return 1 / mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(x)) ** 2 for x in row) / len(row) + eps)


def mp_array(a):
    return [mpmath.mpf(float(x)) for x in np.ravel(a)]


def assert_close_rel(got, exact, tol):
    for y, e in zip(np.ravel(got), exact):
        assert abs(mpmath.mpf(float(y)) - e) <= tol * abs(e), (float(y), e)


def test_norms_against_mpmath():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7)) * np.array([[1e-3], [1.0], [1e3]])
    gate = rng.standard_normal((3, 7)) * 5
    w = rng.standard_normal(7)
    eps = 1e-5
    exact_rms, exact_gated, exact_l2 = [], [], []
    for r in range(3):
        inv = mp_rms(x[r], eps)
        inv_l2 = 1 / mpmath.sqrt(mpmath.fsum(v ** 2 for v in mp_array(x[r])) + mpmath.mpf(1e-6))
        for d in range(7):
            xv, wv = mpmath.mpf(float(x[r, d])), mpmath.mpf(float(w[d]))
            exact_rms.append(xv * inv * wv)
            exact_gated.append(xv * inv * wv * mp_sigmoid(mpmath.mpf(float(gate[r, d]))))
            exact_l2.append(xv * inv_l2)
    assert_close_rel(rms_norm(x, w, eps=eps), exact_rms, 8 * ULP)
    assert_close_rel(gated_rms_norm(x, gate, w, eps=eps), exact_gated, 10 * ULP)
    assert_close_rel(l2norm(x), exact_l2, 8 * ULP)


def mp_kda(q, k, v, g, beta, S0, scale):
    """Spec b.8 in 50 digits, for B = 1, one value head per qk head; plain nested lists."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    f = lambda a: mpmath.mpf(float(a))  # noqa: E731
    o = np.empty((T, H, V), dtype=object)
    S_out = []
    for h in range(H):
        S = [[f(S0[0, h, i, j]) for j in range(V)] for i in range(K)]
        for t in range(T):
            for i in range(K):  # S~ = diag(exp(g)) S
                decay = mpmath.exp(f(g[0, t, h, i]))
                S[i] = [decay * s for s in S[i]]
            kt = [f(k[0, t, h, i]) for i in range(K)]
            e = [f(beta[0, t, h]) * (f(v[0, t, h, j]) - mpmath.fsum(S[i][j] * kt[i] for i in range(K)))
                 for j in range(V)]
            S = [[S[i][j] + kt[i] * e[j] for j in range(V)] for i in range(K)]
            for j in range(V):
                o[t, h, j] = scale * mpmath.fsum(S[i][j] * f(q[0, t, h, i]) for i in range(K))
        S_out.append(S)
    return o, S_out


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_kda_against_a_50_digit_recurrence(form):
    rng = np.random.default_rng(1)
    T, H, K, V = 5, 2, 3, 2
    q = l2norm(rng.standard_normal((1, T, H, K)))
    k = l2norm(rng.standard_normal((1, T, H, K)))
    v = rng.standard_normal((1, T, H, V))
    g = -np.exp(rng.uniform(-6, 2.5, (1, T, H, K)))  # decays from ~1 to e^-12 per step
    beta = rng.uniform(0.1, 1.0, (1, T, H))
    S0 = rng.standard_normal((1, H, K, V))
    scale = mpmath.mpf(K) ** -0.5
    o_mp, S_mp = mp_kda(q, k, v, g, beta, S0, scale)
    kw = {"chunk_size": 2} if form == "chunked" else {}  # chunk 2: several chunks and a ragged one
    o, S = getattr(kda, form)(q, k, v, g, beta, initial_state=S0, **kw)
    o_scale = max(abs(x) for x in o_mp.ravel())
    s_scale = max(abs(x) for S in S_mp for row in S for x in row)
    for (t, h, j), exact in np.ndenumerate(o_mp):
        assert abs(mpmath.mpf(float(o[0, t, h, j])) - exact) <= 1e-13 * o_scale
    for h in range(H):
        for i in range(K):
            for j in range(V):
                assert abs(mpmath.mpf(float(S[0, h, i, j])) - S_mp[h][i][j]) <= 1e-13 * s_scale


def test_kda_gate_against_mpmath():
    rng = np.random.default_rng(2)
    HV, K = 2, 3
    g_raw = rng.standard_normal((1, 4, HV, K)) * 15  # both sides of the softplus threshold
    A_log, dt_bias = rng.uniform(0, np.log(16), HV), rng.standard_normal(HV * K)
    g = kda.gate(g_raw, A_log, dt_bias)
    for (t, h, d), y in np.ndenumerate(g[0]):
        x = mpmath.mpf(float(g_raw[0, t, h, d])) + mpmath.mpf(float(dt_bias[h * K + d]))
        exact = -mpmath.exp(mpmath.mpf(float(A_log[h]))) * mp_softplus(x)
        # the float64 sum g_raw + dt_bias is rounded once, and softplus amplifies that relative
        # error by its condition number x sigmoid(x) / softplus(x) <= max(1, |x|)
        tol = (max(1.0, abs(float(x))) + 4) * ULP
        assert abs(mpmath.mpf(float(y)) - exact) <= tol * abs(exact), (t, h, d)
