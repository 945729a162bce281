"""The router replayed on the engine's input: its noise bound derived from the arithmetic, flips
judged against it, and the engine's scores and selection held to it."""
import numpy as np
import torch

from parity.bounds.core import UNIT_ROUNDOFF
from parity.diff.router import judge_router, score_noise

U, UA = UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float32"]
RNG = np.random.default_rng(0)
D, E = 64, 8
W = RNG.normal(0, 0.2, (E, D))
X = RNG.normal(0, 1.0, (1, D))


def _judge(s, eps, ref_ids, opt_ids, *, bias=None, opt_scores=None, opt_sel=None, **kw):
    bias = np.zeros(E) if bias is None else bias
    return judge_router(1, 7, s=s, eps=eps, bias=bias, ref_ids=np.array(ref_ids), opt_ids=np.array(opt_ids),
                        opt_scores=opt_scores, opt_sel=opt_sel, ua=UA, **kw)


def test_the_noise_bound_covers_the_bf16_rounding_of_the_router_input():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    xb = torch.tensor(X).bfloat16().float().numpy().astype(np.float64)   # what a bf16 engine holds
    s_engine = 1 / (1 + np.exp(-(xb @ W.T)))
    assert np.all(np.abs(s_engine - s) <= eps) and np.all(eps < 0.05)


def test_identical_decisions_are_not_flips_and_sit_inside_their_bound():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    top = np.argsort(-s[0])[:2][None]
    j = _judge(s, eps, top, top, opt_scores=torch.tensor(s, dtype=torch.float32))
    assert j.flips == [] and j.units[0] < 1


def test_a_flip_between_two_experts_closer_than_their_noise_is_within_noise():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    order = np.argsort(-s[0])
    a, b = order[1], order[2]
    bias = np.zeros(E)
    bias[b] = s[0, a] - s[0, b] - 0.5 * (eps[0, a] + eps[0, b])  # b trails a by half the noise
    (f,) = _judge(s, eps, [[order[0], a]], [[order[0], b]], bias=bias).flips
    assert (f.layer, f.position, f.swapped_out, f.swapped_in) == (1, 7, [a], [b]) and f.within_noise


def test_a_flip_far_beyond_the_noise_is_a_router_bug():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    order = np.argsort(-s[0])
    j = _judge(s, eps, [[order[0], order[1]]], [[order[0], order[-1]]])
    (f,) = j.flips
    assert not f.within_noise and j.units[0] > 1 and j.what[0] == "flip"


def test_a_bias_held_in_bf16_or_dropped_is_past_the_selection_bound():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    bias = RNG.normal(0, 3.0, E)
    top = np.argsort(-(s[0] + bias))[:2][None]
    scores = torch.tensor(s, dtype=torch.float32)
    exact = _judge(s, eps, top, top, bias=bias, opt_scores=scores, opt_sel=scores + torch.tensor(bias, dtype=torch.float32))
    assert exact.units[0] < 1
    b16 = torch.tensor(bias, dtype=torch.float32).bfloat16().float()
    held = _judge(s, eps, top, top, bias=bias, opt_scores=scores, opt_sel=scores + b16)
    assert held.units[0] > 1 and held.what[0] == "selection"
    dropped = _judge(s, eps, top, top, bias=bias, opt_scores=scores, opt_sel=scores.clone())
    assert dropped.units[0] > 1


def test_scores_off_by_more_than_their_noise_are_past_the_bound():
    s, eps, _ = score_noise(X, W, u=U, e_mid=U, ua=UA)
    top = np.argsort(-s[0])[:2][None]
    raw = torch.tensor(X @ W.T, dtype=torch.float32)   # logits traced as if they were scores
    j = _judge(s, eps, top, top, opt_scores=raw)
    assert j.units[0] > 1 and j.what[0] == "scores"


def test_grouped_routing_reports_the_group_margin():
    # 2 groups of 4, keep 1 group, top-2: the reference keeps group 0, the engine group 1
    s = np.array([[0.60, 0.50, 0.1, 0.1, 0.59, 0.505, 0.1, 0.1]])
    eps = np.full_like(s, 0.01)
    (f,) = _judge(s, eps, [[0, 1]], [[4, 5]], num_groups=2, topk_groups=1).flips
    assert f.grouped and np.isclose(f.margin, 1.10 - 1.095) and f.within_noise
