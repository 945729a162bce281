"""parity.classify_step: match, near-tie, diverged, with the bound estimated from the step's noise."""
import numpy as np
import pytest
import torch

from parity import classify_step


def _logits(n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal(n) * 3.0


def test_identical_logits_are_a_match():
    r = _logits()
    v = classify_step(r, r.copy())
    assert v.verdict == "match" and v.ref_token == v.opt_token == int(np.argmax(r)) and v.margin == 0.0


def test_a_flip_within_the_noise_is_a_near_tie():
    r = _logits()
    i = int(np.argmax(r))
    j = int(np.argsort(r)[-2])
    r[j] = r[i] - 0.01                          # the runner-up 0.01 below the top
    o = torch.tensor(r, dtype=torch.float32).to(torch.bfloat16)   # bf16 rounding: ~0.03 per logit at |r| ~ 8
    o = o.double().numpy()
    o[j], o[i] = r[i] + 0.004, r[i] - 0.004     # a flip by less than the rounding noise
    v = classify_step(r, o, dtype="bfloat16")
    assert v.verdict == "near-tie" and v.opt_token == j
    assert v.margin == pytest.approx(0.01) and v.margin <= v.bound and v.ratio <= 1


def test_a_flip_far_outside_the_noise_is_diverged():
    r = _logits()
    noise = np.random.default_rng(1).standard_normal(r.size) * 1e-3
    o = r + noise
    j = int(np.argmin(r))
    o[j] = r.max() + 1.0                        # a bug boosts the worst token to the top
    v = classify_step(r, o, dtype="float32")
    assert v.verdict == "diverged" and v.opt_token == j and v.ratio > 100
    # the boosted logit's own error does not excuse it: it is left out of the noise estimate
    assert v.noise < 5e-3


def test_a_noisy_path_whose_flip_is_within_its_own_noise_is_a_near_tie():
    r = _logits()
    rng = np.random.default_rng(2)
    sigma = 0.05
    o = r + rng.standard_normal(r.size) * sigma   # a noisy (but unbiased) path
    i = int(np.argmax(r))
    j = int(np.argsort(r)[-2])
    r[j] = r[i] - 2 * sigma                       # margin 2 sigma: noise of this size flips it
    o[i], o[j] = r[i] - sigma, r[j] + 1.5 * sigma
    v = classify_step(r, o, dtype="bfloat16")
    assert v.verdict == "near-tie" and v.bound > v.margin
    # the same flip on a quiet path is a divergence
    quiet = r.copy()
    quiet[i], quiet[j] = o[i], o[j]
    assert classify_step(r, quiet, dtype="float32").verdict == "diverged"


def test_a_given_per_logit_bound_replaces_the_estimate():
    r = np.array([1.0, 0.9, -3.0])
    o = np.array([0.9, 1.0, -3.0])
    assert classify_step(r, o, bound=0.06).verdict == "near-tie"     # flip bound 0.12 >= margin 0.1
    assert classify_step(r, o, bound=0.04).verdict == "diverged"     # 0.08 < 0.1
    assert classify_step(r, o, bound=np.array([0.05, 0.05, 0.0])).bound == pytest.approx(0.1)


def test_non_finite_optimized_logits_are_diverged():
    r = _logits(50)
    o = r.copy()
    o[3] = np.nan
    assert classify_step(r, o).verdict == "diverged"


def test_the_dtype_is_inferred_from_the_values():
    r = _logits(200)
    o = torch.tensor(r).to(torch.bfloat16)
    assert classify_step(r, o).dtype == "bfloat16"
    assert classify_step(r, o.double().numpy()).dtype == "bfloat16"
    assert classify_step(r, r.astype(np.float32)).dtype == "float32"
