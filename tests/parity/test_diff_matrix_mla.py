"""The diff's teeth on MLA layers: a stale row in the latent cache and NaN in it, planted in our
optimized model at an early and a deep MLA layer (bf16; fp32 at the deep one), caught and named at
its layer, directly and through a dump; a clean run past the 64th position stays clean."""
import pytest

import optimized
from .planted_model import CLEAN_STEPS, LONG_PROMPT, assert_caught, base_source, assert_clean, diff, mla_source, planted_engine, through_dump

CELLS = [("mla_stale", layer, "bfloat16") for layer in (1, 3)] + [("mla_stale", 3, "float32")]
CELLS += [("nan_state", layer, "bfloat16") for layer in (1, 3)]


@pytest.fixture(scope="module")
def source():
    return mla_source()   # tiny with MLA at layers 1 and 3


@pytest.mark.parametrize("bug,layer,dtype", CELLS)
def test_a_planted_mla_bug_is_caught_and_named_at_its_layer(source, bug, layer, dtype):
    source = base_source(source, bug, layer)
    assert_caught(diff(source, planted_engine(source, bug, layer, dtype=dtype), dtype), bug, layer)


def test_a_stale_latent_row_is_caught_through_a_dump(source, tmp_path):
    engine = planted_engine(source, "mla_stale", 3, dtype="bfloat16")
    assert_caught(through_dump(source, engine, "bfloat16", tmp_path / "run.safetensors"), "mla_stale", 3)


def test_a_clean_bf16_run_past_the_64th_position_stays_clean(source):
    assert_clean(diff(source, optimized.load(source, dtype="bfloat16"), "bfloat16", steps=CLEAN_STEPS,
                      prompt=LONG_PROMPT))
