"""MoE reference: router logits against a plain matmul, hand-checked router cases (bias, combine variants, groups, ties, order),
SwiGLU by hand, and the sparse expert dispatch against a dense loop."""
import numpy as np
import pytest

from reference.elementwise import sigmoid, silu
from reference.moe import experts, router, router_logits, swiglu


def logit(p):
    return np.log(p) - np.log1p(-p)


def test_bias_changes_selection_but_not_the_unbiased_weights():
    scores = np.array([[0.9, 0.8, 0.3, 0.2]])
    bias = np.array([0.0, 0.0, 0.6, 0.0])  # selection 0.9, 0.8, 0.9, 0.2: tie 0 vs 2 -> 0 first
    w, ids = router(logit(scores), bias, top_k=2, renormalize=False)
    np.testing.assert_array_equal(ids, [[0, 2]])
    np.testing.assert_allclose(w, [[0.9, 0.3]], rtol=1e-15)
    w, ids = router(logit(scores), np.zeros(4), top_k=2, renormalize=False)
    np.testing.assert_array_equal(ids, [[0, 1]])


def test_biased_combine_uses_score_plus_bias():
    scores = np.array([[0.9, 0.8, 0.3, 0.2]])
    bias = np.array([0.0, 0.0, 0.7, 0.0])  # selection 0.9, 0.8, 1.0, 0.2
    w, ids = router(logit(scores), bias, top_k=2, renormalize=False, combine="biased")
    np.testing.assert_array_equal(ids, [[2, 0]])  # descending selection
    np.testing.assert_allclose(w, [[1.0, 0.9]], rtol=1e-15)
    w, _ = router(logit(scores), bias, top_k=2, combine="biased", scaling=2.0)
    np.testing.assert_allclose(w, [[2 * 1.0 / 1.9, 2 * 0.9 / 1.9]], rtol=1e-15)


def test_renormalize_and_scaling():
    scores = np.array([[0.5, 0.2, 0.1, 0.4]])
    w, ids = router(logit(scores), np.zeros(4), top_k=3, scaling=2.5)
    np.testing.assert_array_equal(ids, [[0, 3, 1]])
    np.testing.assert_allclose(w, [[2.5 * 0.5 / 1.1, 2.5 * 0.4 / 1.1, 2.5 * 0.2 / 1.1]], rtol=1e-15)
    w, ids = router(logit(scores), np.zeros(4), top_k=1, scaling=2.5)  # top_k = 1: no renorm
    np.testing.assert_allclose(w, [[2.5 * 0.5]], rtol=1e-15)


def test_grouped_selection_keeps_the_groups_with_the_best_top2_sum():
    # 3 groups of 3. Group sums of top-2: g0 0.95+0.10=1.05, g1 0.7+0.6=1.3, g2 0.65+0.62=1.27
    scores = np.array([[0.95, 0.10, 0.05, 0.70, 0.60, 0.01, 0.65, 0.62, 0.02]])
    w, ids = router(logit(scores), np.zeros(9), top_k=3, num_groups=3, topk_groups=2,
                    renormalize=False)
    # expert 0 has the best single score but its group is dropped
    np.testing.assert_array_equal(ids, [[3, 6, 7]])
    np.testing.assert_allclose(w, [[0.70, 0.65, 0.62]], rtol=1e-15)
    _, ids = router(logit(scores), np.zeros(9), top_k=3, num_groups=3, topk_groups=3)
    np.testing.assert_array_equal(ids, [[0, 3, 6]])
    # bias enters the group score too: lift group 0's second expert
    bias = np.array([0, 0.5, 0, 0, 0, 0, 0, 0, 0])
    _, ids = router(logit(scores), bias, top_k=2, num_groups=3, topk_groups=1)
    np.testing.assert_array_equal(ids, [[0, 1]])


def test_ties_go_to_the_lower_expert_index_for_experts_and_groups():
    logits = np.zeros((1, 8))  # every score 0.5
    _, ids = router(logits, np.zeros(8), top_k=3)
    np.testing.assert_array_equal(ids, [[0, 1, 2]])
    _, ids = router(logits, np.zeros(8), top_k=2, num_groups=4, topk_groups=2)
    np.testing.assert_array_equal(ids, [[0, 1]])
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.1])
    _, ids = router(logits, bias, top_k=4, num_groups=4, topk_groups=2)  # groups 2 and 3 tie
    np.testing.assert_array_equal(ids, [[5, 7, 4, 6]])


def test_rows_are_independent_tokens():
    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal((5, 16)), rng.standard_normal(16) * 0.1
    w, ids = router(logits, bias, top_k=4, num_groups=4, topk_groups=2, scaling=2.446)
    for t in range(5):
        w1, ids1 = router(logits[t : t + 1], bias, top_k=4, num_groups=4, topk_groups=2,
                          scaling=2.446)
        np.testing.assert_array_equal(ids[t], ids1[0])
        np.testing.assert_array_equal(w[t], w1[0])
    sel = sigmoid(logits) + bias
    assert np.all(np.diff(np.take_along_axis(sel, ids, axis=1), axis=1) <= 0)
    np.testing.assert_allclose(w.sum(axis=1), 2.446, rtol=1e-15)


def test_router_argument_errors():
    with pytest.raises(ValueError, match="combine: expected one of"):
        router(np.zeros((1, 4)), np.zeros(4), top_k=2, combine="bias")
    with pytest.raises(ValueError, match=r"bias: expected \[E\]"):
        router(np.zeros((1, 4)), np.zeros(3), top_k=2)
    with pytest.raises(ValueError, match="num_groups"):
        router(np.zeros((1, 6)), np.zeros(6), top_k=2, num_groups=4)
    with pytest.raises(ValueError, match="top_k"):
        router(np.zeros((1, 8)), np.zeros(8), top_k=5, num_groups=4, topk_groups=2)


def test_router_logits_is_x_times_weight_transposed():
    r = np.random.default_rng(0)
    x, w = r.standard_normal((5, 12)), r.standard_normal((7, 12))
    out = router_logits(x.astype(np.float32), w)   # any float input is widened to float64
    assert out.shape == (5, 7) and out.dtype == np.float64
    want = np.einsum("td,ed->te", x.astype(np.float32).astype(np.float64), w)
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=0)
    assert router_logits(np.zeros((0, 12)), w).shape == (0, 7)


def test_router_logits_errors_are_one_line():
    w = np.zeros((4, 6))
    for x, wt in ((np.zeros(6), w), (np.zeros((2, 5)), w), (np.zeros((2, 6)), np.zeros(6))):
        with pytest.raises(ValueError, match=r"router_logits: expected x \[T,D\] and weight \[E,D\]") as e:
            router_logits(x, wt)
        assert "\n" not in str(e.value)


def test_swiglu_by_hand():
    x = np.array([[1.0, 2.0]])
    w_gate = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w_up = np.array([[2.0, 0.0], [0.0, 3.0], [1.0, -1.0]])
    w_down = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, -1.0]])
    h = silu(np.array([1.0, 2.0, 3.0])) * np.array([2.0, 6.0, -1.0])
    np.testing.assert_allclose(swiglu(x, w_gate, w_up, w_down)[0], [h.sum(), h[1] - h[2]],
                               rtol=1e-15)


class LazyExperts:
    """A sequence that 'loads' one expert per access and records which were asked for."""

    def __init__(self, stacked):
        self.stacked, self.loaded = stacked, []

    def __getitem__(self, e):
        self.loaded.append(e)
        return self.stacked[e]


def test_experts_equal_a_dense_loop_and_load_only_routed_experts():
    rng = np.random.default_rng(1)
    T, D, F, E, k_e = 6, 4, 5, 8, 2
    x = rng.standard_normal((T, D))
    w1, w3 = rng.standard_normal((E, F, D)), rng.standard_normal((E, F, D))
    w2 = rng.standard_normal((E, D, F))
    weights, ids = router(rng.standard_normal((T, E)), np.zeros(E), top_k=k_e)
    dense = np.zeros((T, D))
    for t in range(T):
        for j in range(k_e):
            e = ids[t, j]
            dense[t] += weights[t, j] * swiglu(x[t : t + 1], w1[e], w3[e], w2[e])[0]
    lazy = [LazyExperts(w) for w in (w1, w2, w3)]
    y = experts(x, weights, ids, *lazy)
    np.testing.assert_allclose(y, dense, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(experts(x, weights, ids, w1, w2, w3), y, rtol=0, atol=0)
    routed = sorted(set(ids.ravel().tolist()))
    for lz in lazy:
        assert sorted(lz.loaded) == routed  # each routed expert once, no others


class GatheringExperts(LazyExperts):
    """A lazy sequence that also gathers several experts at once (``Weights``' experts do)."""

    def __init__(self, stacked):
        super().__init__(stacked)
        self.gathers = []

    def gather_experts(self, experts_):
        self.gathers.append(list(experts_))
        return self.stacked[np.asarray(experts_)]


@pytest.mark.parametrize("group", [1, 3, 64])
def test_grouped_experts_are_the_one_at_a_time_loop_batched(group):
    # skewed routing (expert 0 takes most tokens): groups pad their tokens to unequal counts
    rng = np.random.default_rng(2)
    T, D, F, E, k_e = 29, 8, 12, 10, 3
    x = rng.standard_normal((T, D))
    w1, w3, w2 = (rng.standard_normal(s) for s in ((E, F, D), (E, F, D), (E, D, F)))
    logits = rng.standard_normal((T, E)) + np.where(np.arange(E) == 0, 4.0, 0.0)
    weights, ids = router(logits, np.zeros(E), top_k=k_e)
    want = experts(x, weights, ids, w1, w2, w3)
    lazy = [GatheringExperts(w) for w in (w1, w2, w3)]
    got = experts(x, weights, ids, *lazy, group=group)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14 * np.abs(want).max())
    routed = sorted(set(ids.ravel().tolist()))
    for lz in lazy:  # every routed expert gathered once, in groups of at most `group`
        assert sorted(sum(lz.gathers, [])) == routed and not lz.loaded
        assert max(map(len, lz.gathers)) <= group
    np.testing.assert_allclose(experts(x, weights, ids, w1, w2, w3, group=group), got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="group: expected a positive number"):
        experts(x, weights, ids, w1, w2, w3, group=0)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("group", [1, 3, 64])
def test_one_token_takes_the_grouped_products_by_device_ids_bit_for_bit(library, group):
    # a decode step's token: its experts gathered by device ids (no host lists) must give the
    # bits of the host-grouped path, which one token always reaches with every count 1
    from reference import moe
    from reference.executor import get_executor, to_numpy

    xp = get_executor("cpu", library).xp
    rng = np.random.default_rng(5)
    D, F, E, k_e = 8, 12, 10, 7
    x = xp.asarray(rng.standard_normal((1, D)))
    w1, w3, w2 = (xp.asarray(rng.standard_normal(s)) for s in ((E, F, D), (E, F, D), (E, D, F)))
    _, ids = router(xp.asarray(rng.standard_normal((1, E))), xp.zeros(E, dtype=xp.float64), top_k=k_e)
    flat = xp.reshape(ids, (-1,))
    y, where = moe._grouped(x, to_numpy(flat), k_e, w1, w2, w3, group)
    want = to_numpy(xp.take(y, where, axis=0))  # pair (0, slot)'s output, slot order
    order = xp.argsort(flat, stable=True)
    lazy = [GatheringExperts(to_numpy(w)) for w in (w1, w2, w3)]
    for ws in ((w1, w2, w3), lazy if library == "numpy" else (w1, w2, w3)):
        got = moe._one_token(x, xp.take(flat, order), *ws, group)
        np.testing.assert_array_equal(to_numpy(xp.take(got, xp.argsort(order, stable=True), axis=0)), want)
    if library == "numpy":  # the lazy experts are gathered in ascending groups of at most `group`
        assert [e for g in lazy[0].gathers for e in g] == sorted(to_numpy(flat).tolist())
        assert max(map(len, lazy[0].gathers)) <= group
