"""The diff's teeth: bugs that shipped in other engines, planted in our optimized model at an early
and a deep layer, in bf16 and fp32, diffed directly and through a dump. Every one is caught (the
run is ``diverged`` or ``past-bound``: exit 1) and named at its layer and op; clean runs stay clean.

Each op is judged on the engine's own inputs (``parity.diff.replay``), so an upstream router flip in
noise never loosens a later layer's check, and the flip noise comes from the certified twin."""
import pytest

import reference
from .planted_model import BUGS, OP, planted_engine
from parity.diff import run_diff
from parity.engines import CheckedEngine, load_engine, router_bias
from parity.engines.dump import record
from parity.platform import store_rounding
from reference.checkpoint import open_source
from reference.config import KimiConfig
from reference.fixtures import default_checkpoint_path
from reference.synthetic import SyntheticSource

PROMPT = [75, 107, 104, 117, 35, 108, 104, 111, 104, 100, 117, 35, 115, 100, 117, 104]
STEPS = 6
# tiny: KDA at 0-2, MLA at 3, MoE at 1-3; small: MLA at 2 and 5 (the early and the deep MLA layer)
LAYERS = {"fb_doubled": (0, 2), "state_transposed": (0, 2), "raw_routing": (1, 3), "bias_dropped": (1, 3),
          "bias_bf16": (1, 3), "nan_state": (0, 3), "mla_stale": (2, 5)}
CELLS = [(bug, layer, dtype) for bug in BUGS for layer in LAYERS[bug] for dtype in ("bfloat16", "float32")]


@pytest.fixture(scope="module")
def sources():
    return {"tiny": open_source(default_checkpoint_path()), "small": SyntheticSource(KimiConfig.from_name("small"), 0)}


def _source(sources, bug):
    return sources["small" if bug == "mla_stale" else "tiny"]


def _diff(source, engine, dtype, *, steps=STEPS, mode="forced", tokens=None, prompt=PROMPT):
    device = str(getattr(getattr(engine, "engine", engine), "device", "cpu")).split(":")[0]
    return run_diff(reference.load(source), engine, prompt, config=source.config, steps=steps, mode=mode,
                    dtype=dtype, rounding=store_rounding(dtype, device if device in ("cpu", "cuda") else None),
                    tokens=tokens)


def _caught(result, bug, layer):
    assert result.verdict in ("diverged", "past-bound"), result.summary()["line"]
    loc = result.localization
    assert loc is not None, result.summary()["line"]
    if bug == "nan_state":
        assert loc.nonfinite is not None and loc.nonfinite["name"] == f"layers.{layer}.mixer", loc.describe()
    else:
        assert loc.first is not None and loc.first.name == f"layers.{layer}.{OP[bug]}", loc.describe()


@pytest.mark.parametrize("bug,layer,dtype", CELLS)
def test_a_planted_bug_is_caught_and_named_at_its_layer_and_op(sources, bug, layer, dtype):
    source = _source(sources, bug)
    _caught(_diff(source, planted_engine(source, bug, layer, dtype=dtype), dtype), bug, layer)


@pytest.mark.parametrize("bug,layer", [(bug, LAYERS[bug][-1]) for bug in BUGS])
def test_a_planted_bug_is_caught_through_a_dump_of_the_engine(sources, bug, layer, tmp_path):
    source, dtype = _source(sources, bug), "bfloat16"
    path = record(planted_engine(source, bug, layer, dtype=dtype), tmp_path / "run.safetensors",
                  config=source.config, dtype=dtype, prompt_ids=PROMPT, steps=STEPS)
    dump = CheckedEngine(load_engine(f"dump:{path}", source, dtype=None, device=None), source.config,
                         name="dump", bias=router_bias(source))
    _caught(_diff(source, dump, dtype, mode="free", tokens=dump.engine.tokens), bug, layer)


@pytest.mark.parametrize("fixture,dtype", [("tiny", "bfloat16"), ("tiny", "float32"), ("small", "bfloat16")])
def test_clean_runs_of_64_steps_stay_clean(sources, fixture, dtype):
    import optimized

    source = sources[fixture]
    result = _diff(source, optimized.load(source, dtype=dtype), dtype, steps=64, prompt=PROMPT[:4])
    assert result.verdict in ("match", "near-tie"), result.summary()["line"]
    worst = max(e.units for e in result.final.entries)
    assert worst < 1, result.final.describe()
