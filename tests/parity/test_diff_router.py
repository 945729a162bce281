"""Router flips: which experts swapped, the reference margin, and the noise bound it is judged by."""
import numpy as np
import torch

from parity.diff.router import NoiseHistory, router_flips


def _call(ref_scores, opt_scores, ref_ids, opt_ids, *, bias=None, history=None, **kw):
    ref_scores, opt_scores = np.atleast_2d(ref_scores), np.atleast_2d(opt_scores)
    bias = np.zeros(ref_scores.shape[-1]) if bias is None else np.asarray(bias)
    return router_flips(1, 7, ref_scores + bias, torch.tensor(opt_scores + bias, dtype=torch.float32),
                        ref_ids, opt_ids, ref_scores=ref_scores, opt_scores=torch.tensor(opt_scores),
                        history=history, **kw)


def _logit_noise(scores, d_logit):
    logit = np.log(scores) - np.log1p(-scores)
    return 1.0 / (1.0 + np.exp(-(logit + d_logit)))


REF = np.array([0.90, 0.10, 0.500, 0.499, 0.20, 0.30, 0.7, 0.6])


def test_identical_decisions_are_not_flips():
    assert _call(REF, REF, [[0, 2]], [[0, 2]]) == []


def test_a_flip_between_two_close_experts_is_within_noise():
    d = np.array([0.004, -0.004, -0.003, 0.004, 0.003, -0.003, 0.002, -0.004])
    (f,) = _call(REF, _logit_noise(REF, d), [[0, 2]], [[0, 3]])
    assert (f.layer, f.position, f.swapped_out, f.swapped_in) == (1, 7, [2], [3])
    assert np.isclose(f.margin, 0.001) and f.within_noise and f.margin <= f.bound


def test_a_flip_far_beyond_the_other_experts_noise_is_not_excused():
    # only experts 2 and 3 moved (logits by -/+0.8): a wrong router, not rounding
    ref = np.array([0.90, 0.10, 0.60, 0.45, 0.20, 0.30, 0.7, 0.15])
    d = np.array([1e-3, -1e-3, -0.8, 0.8, 1e-3, -1e-3, 1e-3, -1e-3])
    (f,) = _call(ref, _logit_noise(ref, d), [[0, 2]], [[0, 3]])
    assert np.isclose(f.margin, 0.15) and not f.within_noise and f.bound < 0.01


def test_the_run_history_widens_the_bound_of_a_token_with_quiet_neighbours():
    """Six experts of one token are few: the layer's noise over the run so far counts too."""
    d_token = np.array([1e-4, -1e-4, -0.004, 0.004, 1e-4, -1e-4, 1e-4, -1e-4])
    alone = _call(REF, _logit_noise(REF, d_token), [[0, 2]], [[0, 3]])[0]
    history = NoiseHistory()
    noisy = np.random.default_rng(0).normal(0, 0.004, (40, 8))
    _call(np.tile(REF, (40, 1)), _logit_noise(REF, noisy), [[0, 6]] * 40, [[0, 6]] * 40, history=history)
    seasoned = _call(REF, _logit_noise(REF, d_token), [[0, 2]], [[0, 3]], history=history)[0]
    assert not alone.within_noise and seasoned.within_noise and seasoned.bound > 5 * alone.bound


def test_grouped_routing_reports_the_group_margin():
    # 2 groups of 4, keep 1 group, top-2: the reference keeps group 0, the optimized path group 1
    ref = np.array([0.60, 0.50, 0.1, 0.1, 0.59, 0.505, 0.1, 0.1])
    d = np.array([-0.01, -0.01, 0.002, -0.002, 0.01, 0.01, 0.002, -0.002])
    (f,) = _call(ref, _logit_noise(ref, d), [[0, 1]], [[4, 5]], num_groups=2, topk_groups=1)
    assert f.grouped and np.isclose(f.margin, 1.10 - 1.095)
