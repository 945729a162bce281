"""The diff's teeth on the layers of each op family, one test per check parametrized by family:

- ``kda``: a doubled ``f_b``, a state transposed after prefill, NaN in the carried state (the tiny
  checkpoint: KDA at layers 0-2); an engine holding its KDA state in bf16 between calls stays clean
  (below bf16 rounding of the state, a shipped precision option);
- ``mla``: a stale row in the latent cache and NaN in it (tiny with MLA at layers 1 and 3);
- ``router``: ranking raw logits, a dropped correction bias, the bias held in bf16 (the tiny
  checkpoint: MoE at layers 1-3), named as that layer's router (replayed on the engine's own input,
  its noise derived from the arithmetic: ``parity.diff.router``).

Each bug is planted in our optimized model at an early and a deep layer (bf16; fp32 at the deep
one), caught and named at its layer and op, directly and through a dump; a clean run (bf16 past the
64th position; the router's at fp32) stays clean. Each op is judged on the engine's own inputs
(``parity.diff.replay``). The bugs between the ops: test_diff_matrix_head.py."""
from __future__ import annotations

import dataclasses

import pytest

import optimized
from .engines_planted import bf16_state
from .planted_model import (CLEAN_STEPS, LONG_PROMPT, PROMPT, assert_caught, assert_clean, base_source, diff,
                            mla_source, planted_engine, through_dump)
from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's cells: its bugs at an early and a deep layer (``layers``), the one caught
    through a dump (at the deep layer), and the clean run (``dtype``, ``steps``, ``prompt``)."""
    bugs: tuple
    layers: tuple
    clean: dict


FAMILIES = {
    "kda": Family(("fb_doubled", "state_transposed", "nan_state"), (0, 2),
                  dict(dtype="bfloat16", steps=CLEAN_STEPS, prompt=LONG_PROMPT)),
    "mla": Family(("mla_stale", "nan_state"), (1, 3), dict(dtype="bfloat16", steps=CLEAN_STEPS, prompt=LONG_PROMPT)),
    "router": Family(("raw_routing", "bias_dropped", "bias_bf16"), (1, 3),
                     dict(dtype="float32", steps=16, prompt=PROMPT[:4])),
}
# the one bug of each family diffed through a dump, and the deep-layer bugs also run at fp32
DUMPED = {"kda": "fb_doubled", "mla": "mla_stale", "router": "bias_bf16"}
FP32 = {"kda": ("fb_doubled", "state_transposed", "nan_state"), "mla": ("mla_stale",),
        "router": ("raw_routing", "bias_dropped", "bias_bf16")}
CELLS = [(family, bug, layer, "bfloat16") for family, f in FAMILIES.items() for bug in f.bugs for layer in f.layers]
CELLS += [(family, bug, FAMILIES[family].layers[1], "float32") for family, bugs in FP32.items() for bug in bugs]


@pytest.fixture(scope="module")
def sources():
    tiny = open_source(default_checkpoint_path())
    return {"kda": tiny, "mla": mla_source(), "router": tiny}


@pytest.mark.parametrize("family,bug,layer,dtype", CELLS)
def test_a_planted_bug_is_caught_and_named_at_its_layer(sources, family, bug, layer, dtype):
    source = base_source(sources[family], bug, layer)
    assert_caught(diff(source, planted_engine(source, bug, layer, dtype=dtype), dtype), bug, layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_planted_bug_is_caught_through_a_dump(sources, family, tmp_path):
    source, bug, layer = sources[family], DUMPED[family], FAMILIES[family].layers[1]
    engine = planted_engine(source, bug, layer, dtype="bfloat16")
    assert_caught(through_dump(source, engine, "bfloat16", tmp_path / "run.safetensors"), bug, layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_clean_run_stays_clean(sources, family):
    clean = FAMILIES[family].clean
    engine = optimized.load(sources[family], dtype=clean["dtype"])
    assert_clean(diff(sources[family], engine, clean["dtype"], steps=clean["steps"], prompt=clean["prompt"]))


def test_an_engine_holding_its_kda_state_in_bf16_stays_clean(sources):
    source = sources["kda"]
    assert_clean(diff(source, bf16_state(source, dtype="bfloat16", device=None), "bfloat16", steps=8))
