"""The localization's model-level bound: the KDA read-out's amplification (a correct model at a
read-out that cancels is within its bound; a bug is still past it)."""
import dataclasses

import numpy as np
import pytest

import optimized
import reference
from .diff_helpers import perturbed_a_log
from parity.bounds.kda import readout_condition
from parity.diff.localize import _entry, localize
from reference import kda as rkda
from reference.config import KimiConfig
from reference.synthetic import SyntheticSource


def _states(q, k, v, g, beta):
    """S_t after every step, from the reference recurrence (one token at a time)."""
    S, out = None, []
    for t in range(q.shape[0]):
        _, S = rkda.recurrent(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1], g[None, t:t + 1],
                              beta[None, t:t + 1], initial_state=S)
        out.append(S[0])
    return np.stack(out)


def _core(r, T=6, H=2, HV=4, K=8, V=5):
    q = r.standard_normal((T, H, K))
    k = r.standard_normal((T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, r.standard_normal((T, HV, V)), -r.uniform(0.01, 1.0, (T, HV, K)), r.uniform(0, 1, (T, HV))


def test_readout_condition_is_the_ratio_of_the_terms_to_the_readout_on_the_references_states():
    r = np.random.default_rng(0)
    q, k, v, g, beta = _core(r)
    kappa, S_end = readout_condition(q, k, v, g, beta)
    S = _states(q, k, v, g, beta)                        # [T, HV, K, V]
    qv = q[:, np.arange(4) // 2]                         # GVA: value head hv reads qk head hv // 2
    want = (np.sqrt(np.einsum("thk,thkv->th", qv ** 2, S ** 2))
            / np.linalg.norm(np.einsum("thk,thkv->thv", qv, S), axis=-1))
    np.testing.assert_allclose(kappa, want, rtol=1e-12)
    np.testing.assert_allclose(S_end, S[-1], rtol=1e-12, atol=1e-15)
    assert np.all(kappa > 0.2) and np.median(kappa) < 3   # generic queries: about 1


def test_a_query_the_state_cancels_has_a_large_condition_and_a_zero_state_none():
    r = np.random.default_rng(1)
    q, k, v, g, beta = _core(r, T=1, H=1, HV=1, K=4, V=3)
    S0 = r.standard_normal((1, 4, 3))
    beta = beta * 0   # the step only decays: S_1 = exp(g) S0; aim q almost into the null space of S_1^T
    S1 = np.exp(g[0, 0])[:, None] * S0[0]
    null = np.linalg.svd(S1.T)[2][-1]                    # S1^T null = 0 (K=4 > V=3)
    q[0, 0] = null + 1e-6 * r.standard_normal(4)
    q[0, 0] /= np.linalg.norm(q[0, 0])
    kappa, _ = readout_condition(q, k, v, g, beta, S0)
    assert kappa[0, 0] > 1e4
    kappa, _ = readout_condition(q, k, np.zeros_like(v), g, beta)  # nothing stored: no error to amplify
    assert kappa[0, 0] == 1.0


def test_an_amplified_bound_excuses_only_the_positions_where_the_readout_cancels():
    u = 2.0**-8
    e = np.full(8, 2 * u)
    e[3] = 40 * u                                        # one position far past the plain bound
    ones = np.ones(8)
    plain = _entry("layers.0.mixer", 0, "kda", e, 4 * u * ones, amp=ones)
    assert plain.past_bound == [3] and plain.units < 1
    amp = ones.copy()
    amp[3] = 6.0
    loud = _entry("layers.0.mixer", 0, "kda", e, 4 * u * amp, amp=amp)
    assert loud.past_bound == [] and loud.readout == 6.0
    amp[3], amp[5] = 1.0, 6.0                           # amplification elsewhere excuses nothing
    assert _entry("layers.0.mixer", 0, "kda", e, 4 * u * amp, amp=amp).past_bound == [3]
    for bad in (np.full(8, 40 * u), np.full(8, np.nan)):  # a wrong op moves every position
        assert _entry("layers.0.mixer", 0, "kda", bad, 4 * u * amp, amp=amp).units > 1


# One KDA layer with 4 heads of 16 (the layer 0 of a hidden-64 checkpoint): on a run of one repeated
# token, head 3's read-out cancels at position 18 (|o| 4x below its median, kappa ~14) and the gated
# norm hands its relative error to the output at full weight: 1.75x the plain spike bound, 0.26x
# the amplified one (docs/error-bounds.md, "Model level").
ONE_LAYER = dataclasses.replace(KimiConfig.from_name("tiny"), kda_num_heads=4, kda_head_dim=16,
                                num_hidden_layers=1, kda_layers=(1,), full_attn_layers=())
RUN = [ord("a") + 3] * 19


@pytest.fixture(scope="module")
def one_layer():
    return SyntheticSource(ONE_LAYER, 0)


def test_a_correct_kda_mixer_whose_readout_cancels_stays_within_its_bound(one_layer, parity_device):
    loc = localize(reference.load(one_layer), optimized.load(one_layer, device=parity_device), RUN, ONE_LAYER)
    assert loc.first is None, loc.describe()
    mixer = next(e for e in loc.entries if e.name == "layers.0.mixer")
    assert mixer.spike_units <= 1 and mixer.readout > 3
    assert mixer.spike_units * mixer.readout > 1        # the plain bound would have called it a bug


def test_a_perturbed_a_log_in_that_mixer_is_still_past_its_bound(one_layer, parity_device):
    for delta in (1.0, -1.0):
        opt = optimized.load(perturbed_a_log(one_layer, layer=0, delta=delta), device=parity_device)
        loc = localize(reference.load(one_layer), opt, RUN, ONE_LAYER)
        assert loc.first is not None and loc.first.name == "layers.0.mixer", (delta, loc.describe())
        assert loc.first_kind == "level" and loc.first.units > 1
