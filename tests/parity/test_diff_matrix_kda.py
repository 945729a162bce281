"""The diff's teeth on KDA layers: a doubled ``f_b``, a state transposed after prefill, NaN in the
carried state; each planted in our optimized model at an early and a deep layer (bf16; fp32 at the
deep one), caught and named at its layer and op, directly and through a dump; a clean run past the
64th position stays clean, and so does an engine holding its KDA state in bf16 between calls (below
bf16 rounding of the state, a shipped precision option). Each op is judged on the engine's own inputs
(``parity.diff.replay``)."""
import pytest

import optimized
from .planted_model import CLEAN_STEPS, LONG_PROMPT, assert_caught, base_source, assert_clean, diff, planted_engine, through_dump
from reference.checkpoint import open_source
from reference.fixtures import default_checkpoint_path

CELLS = [(bug, layer, "bfloat16") for bug in ("fb_doubled", "state_transposed", "nan_state") for layer in (0, 2)]
CELLS += [(bug, 2, "float32") for bug in ("fb_doubled", "state_transposed", "nan_state")]


@pytest.fixture(scope="module")
def source():
    return open_source(default_checkpoint_path())   # tiny: KDA at layers 0-2


@pytest.mark.parametrize("bug,layer,dtype", CELLS)
def test_a_planted_kda_bug_is_caught_and_named_at_its_layer(source, bug, layer, dtype):
    source = base_source(source, bug, layer)
    assert_caught(diff(source, planted_engine(source, bug, layer, dtype=dtype), dtype), bug, layer)


def test_a_doubled_f_b_is_caught_through_a_dump(source, tmp_path):
    engine = planted_engine(source, "fb_doubled", 2, dtype="bfloat16")
    assert_caught(through_dump(source, engine, "bfloat16", tmp_path / "run.safetensors"), "fb_doubled", 2)


def test_a_clean_bf16_run_past_the_64th_position_stays_clean(source):
    assert_clean(diff(source, optimized.load(source, dtype="bfloat16"), "bfloat16", steps=CLEAN_STEPS,
                      prompt=LONG_PROMPT))


def test_an_engine_holding_its_kda_state_in_bf16_stays_clean(source):
    from .engines_planted import bf16_state

    assert_clean(diff(source, bf16_state(source, dtype="bfloat16", device=None), "bfloat16", steps=8))
