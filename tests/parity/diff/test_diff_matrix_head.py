"""The diff's teeth between the ops: the final norm with the zero-centred ``(1 + w)`` gamma, step 0's
logits read from the second-to-last prompt row, the shared expert's output added to the stream
twice, a 2x lm_head. Each is planted in our optimized model (bf16), diffed with traces, and the same
run written as a dump is diffed again with its traces and without (the engine runs once). Each exits
1 and is named at its place (``final_norm``, ``lm_head``, ``layers.2.residual``; without traces, the
logits against the twin's noise), with no near-tie; traces never weaken a verdict."""
import pytest

from .planted_model import HEAD, OP, Recording, assert_traces_never_weaken, diff, diff_dump, planted_engine
from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path

LAYER = 2  # the MoE layer of the double add (the others live in the head)


@pytest.fixture(scope="module")
def source():
    return open_source(default_checkpoint_path())


def _where(bug: str) -> str:
    return HEAD.get(bug) or f"layers.{LAYER}.{OP[bug]}"


def assert_named(result, bug: str) -> None:
    """Exit 1, no near-tie, and the planted check named first."""
    line = result.summary()["line"]
    assert result.verdict in ("diverged", "past-bound") and result.counts["near-tie"] == 0, line
    loc = result.localization
    assert loc is not None and loc.first is not None and loc.first.name == _where(bug), line


@pytest.mark.parametrize("bug", ["norm_one_plus_w", "wrong_row", "double_residual", "lm_head_scaled"])
def test_a_bug_between_the_ops_is_named_in_our_model_and_through_a_dump_with_and_without_traces(source, bug, tmp_path):
    engine = Recording(planted_engine(source, bug, LAYER, dtype="bfloat16"))
    assert_named(diff(source, engine, "bfloat16"), bug)
    traced = diff_dump(source, engine.write(tmp_path / "run.safetensors", source.config, "bfloat16"), "bfloat16")
    assert_named(traced, bug)
    bare = diff_dump(source, engine.write(tmp_path / "bare.safetensors", source.config, "bfloat16", traced=False),
                     "bfloat16")
    # every one of these moves the logits: without traces the twin's noise catches it, unnamed
    assert bare.verdict in ("diverged", "past-bound") and bare.counts["near-tie"] == 0, bare.summary()["line"]
    assert not bare.traced and bare.localization is None
    assert_traces_never_weaken(traced, bare)
