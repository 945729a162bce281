"""The localization's model-level bound: the KDA read-out's amplification (a correct model at a
read-out that cancels is within its bound; a bug is still past it)."""
import dataclasses

import numpy as np
import pytest

import optimized
import reference
from ..diff_helpers import perturbed_a_log
from parity.diff.localize import SPIKE, _entries, localize
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource


def _entry(name, layer, op, e, bound, *, amp):
    """One op's entry, judged as a step's localization judges each op."""
    return _entries([(name, layer, op)], e[None], bound[None], amp[None], spike=np.array([SPIKE]),
                    router=np.array([False]))[0]


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
