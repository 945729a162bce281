"""The step's noise (``parity.diff.noise``): the twin's where it is sane, else the ops' model-level
bound capped at FAR times the twin's own noise, else the dtype floor."""
import numpy as np

from parity.diff.neartie import twin_bound
from parity.diff.noise import FAR, logits_noise, step_noise, twin_sanity

RNG = np.random.default_rng(0)
V = 512
R = RNG.normal(0, 2, V)
R[7] = 9.0   # a clear winner
T = R + RNG.normal(0, 0.01, V)
CERTIFIED = np.full(V, 0.2)


def test_a_sane_twin_gives_its_noise_scaled_for_the_arithmetic_inside_the_ops():
    n = step_noise(R, R, T, dtype="float32", scale=17.0, certified=CERTIFIED, lossy=None)
    assert n.source == "twin" and n.note is None
    np.testing.assert_array_equal(n.e, 17.0 * twin_bound(R, T, dtype="float32"))


def test_a_twin_past_the_ops_bound_is_set_aside_for_that_bound_capped_at_far_times_its_noise():
    jumped = T.copy()
    jumped[:40] += 0.5   # an expert of its own: past the ops' bound at 40 logits
    assert "router flip of its own" in twin_sanity(R, jumped, CERTIFIED)
    n = step_noise(R, R, jumped, dtype="bfloat16", scale=1.0, certified=CERTIFIED, lossy=None)
    assert n.source == "ops" and "x the ops' model-level bound" in n.note
    np.testing.assert_array_equal(n.e, np.minimum(np.maximum(CERTIFIED, 2.0**-8 * np.abs(R)),
                                                  FAR * twin_bound(R, jumped, dtype="bfloat16")))


def test_without_a_bound_to_fall_back_on_a_set_aside_twin_leaves_the_dtype_floor():
    other = T.copy()
    other[8] = 10.0   # the twin's token is not the reference's
    n = step_noise(R, R, other, dtype="bfloat16", scale=1.0, certified=None, lossy=None)
    assert n.source == "floor" and n.note == "the twin's token 8 is not the reference's 7"
    np.testing.assert_array_equal(n.e, 2.0**-8 * np.abs(R))


def test_the_logits_are_held_to_the_norm_of_the_noise_and_nan_is_never_within_it():
    n = step_noise(R, R, T, dtype="float32", scale=1.0, certified=None, lossy=None)
    assert logits_noise(R, T, n).units < 1 < logits_noise(R, 2 * R, n).units
    assert logits_noise(R, np.full(V, np.nan), n).units == np.inf


def test_the_twin_of_our_optimized_model_is_never_the_engine_under_test():
    import optimized
    import reference
    from kimi.checkpoint import open_source
    from kimi.fixtures import default_checkpoint_path
    from parity.diff.twin import twin_for

    source = open_source(default_checkpoint_path())
    ref, engine = reference.load(source), optimized.load(source, dtype="bfloat16")
    twin = twin_for(engine, ref, dtype="bfloat16")
    assert twin.kind == "emulated" and "every op family on the reference backend" in twin.describe()
    model = twin._load()
    assert model is not engine and set(model.ops.choice.values()) == {"reference"}
    assert abs(twin.arith_scale - 1.0) < 1e-3 and twin_for(engine, ref, dtype="float32").arith_scale == 17.0
    # any other engine on a GPU: our optimized model (loaded on first use only)
    assert twin_for(object(), ref, dtype="bfloat16", device="cuda").kind == "triton"
