"""Router flips: which experts swapped, the reference margin, and the noise bound it is judged by."""
import numpy as np

from parity.diff.router import router_flips

U = 2.0**-8


def _sel(values):
    return np.asarray(values, dtype=float)[None, :]


def test_identical_decisions_are_not_flips():
    sel = _sel([0.9, 0.1, 0.5, 0.3])
    assert router_flips(1, 0, sel, sel, [[0, 2]], [[0, 2]], unit_roundoff=U) == []


def test_a_flip_between_two_close_experts_is_within_noise():
    ref = _sel([0.90, 0.10, 0.500, 0.499, 0.20, 0.30])
    noise = np.array([0.001, -0.001, -0.0008, 0.0009, 0.0006, -0.0007])
    opt = ref + noise
    (f,) = router_flips(3, 7, ref, opt, [[0, 2]], [[0, 3]], unit_roundoff=U)
    assert (f.layer, f.position, f.swapped_out, f.swapped_in) == (3, 7, [2], [3])
    assert np.isclose(f.margin, 0.001)
    assert f.within_noise and f.margin <= f.bound


def test_a_flip_far_beyond_the_other_experts_noise_is_not_excused():
    # only experts 2 and 3 moved (by 0.2): a wrong router, not rounding
    ref = _sel([0.90, 0.10, 0.60, 0.45, 0.20, 0.30])
    opt = ref + np.array([1e-4, -1e-4, -0.1, 0.1, 1e-4, -1e-4])
    (f,) = router_flips(1, 0, ref, opt, [[0, 2]], [[0, 3]], unit_roundoff=U)
    assert np.isclose(f.margin, 0.15)
    assert not f.within_noise and f.bound < 0.01


def test_the_bound_ignores_a_common_shift_of_every_score():
    ref = _sel([0.9, 0.1, 0.5, 0.4995, 0.2, 0.3])
    opt = ref + 0.05  # reorders nothing
    opt[0, 3] += 0.001
    (f,) = router_flips(1, 0, ref, opt, [[0, 2]], [[0, 3]], unit_roundoff=U)
    assert f.bound < 0.01  # the 0.05 shift is not noise of the pair


def test_grouped_routing_reports_the_group_margin():
    # 2 groups of 4, keep 1 group, top-2: the reference keeps group 0, the optimized path group 1
    ref = _sel([0.60, 0.50, 0.0, 0.0, 0.59, 0.505, 0.0, 0.0])
    opt = ref + np.array([-1e-3, -1e-3, 0, 0, 1e-3, 1e-3, 0, 0])
    (f,) = router_flips(2, 0, ref, opt, [[0, 1]], [[4, 5]], num_groups=2, topk_groups=1, unit_roundoff=U)
    assert f.grouped and np.isclose(f.margin, 1.10 - 1.095)
