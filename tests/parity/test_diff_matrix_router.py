"""The diff's teeth on the MoE router: ranking raw logits, a dropped correction bias, the bias held
in bf16; each planted in our optimized model at an early and a deep MoE layer (bf16; fp32 at the
deep one), caught and named as that layer's router (the router is replayed on the engine's own
input, its noise derived from the arithmetic: ``parity.diff.router``), directly and through a dump;
a clean fp32 run stays clean."""
import pytest

import optimized
from .planted_model import PROMPT, assert_caught, base_source, assert_clean, diff, planted_engine, through_dump
from reference.checkpoint import open_source
from reference.fixtures import default_checkpoint_path

CELLS = [(bug, layer, "bfloat16") for bug in ("raw_routing", "bias_dropped", "bias_bf16") for layer in (1, 3)]
CELLS += [(bug, 3, "float32") for bug in ("raw_routing", "bias_dropped", "bias_bf16")]


@pytest.fixture(scope="module")
def source():
    return open_source(default_checkpoint_path())   # tiny: MoE at layers 1-3


@pytest.mark.parametrize("bug,layer,dtype", CELLS)
def test_a_planted_router_bug_is_caught_and_named_at_its_layer(source, bug, layer, dtype):
    source = base_source(source, bug, layer)
    assert_caught(diff(source, planted_engine(source, bug, layer, dtype=dtype), dtype), bug, layer)


def test_a_bias_held_in_bf16_is_caught_through_a_dump(source, tmp_path):
    engine = planted_engine(source, "bias_bf16", 3, dtype="bfloat16")
    assert_caught(through_dump(source, engine, "bfloat16", tmp_path / "run.safetensors"), "bias_bf16", 3)


def test_a_clean_fp32_run_stays_clean(source):
    assert_clean(diff(source, optimized.load(source, dtype="float32"), "float32", steps=16, prompt=PROMPT[:4]))
