"""The checks between the ops, each on its own: the residual stream, the final norm and lm_head.
A float64 engine declared bf16 is within every bound; its values bent after each call (the bug of
each check, and a zero, a constant and a NaN) are named at that check. Seconds: NumPy engines."""
import numpy as np
import pytest

import reference
from .planted_model import PROMPT, diff
from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path

LAYER = 2


@pytest.fixture(scope="module")
def source():
    return open_source(default_checkpoint_path())


class Bent:
    """The float64 reference, ``bend(logits, trace)`` applied to what each call returns."""

    def __init__(self, model, bend):
        self.model, self.bend = model, bend

    def prefill(self, ids, *, trace=None):
        logits, cache = self.model.prefill(ids, trace=trace)
        return self.bend(np.array(logits), trace), cache

    def decode(self, token, cache, *, trace=None):
        logits, cache = self.model.decode(token, cache, trace=trace)
        return self.bend(np.array(logits), trace), cache


def _set(key, fn):
    def bend(logits, trace):
        trace[key] = fn(np.array(trace[key]), trace)
        return logits
    return bend


def _logits(fn):
    return lambda logits, trace: fn(logits)


h = f"layers.{LAYER}.hidden"
CASES = {
    "residual: the shared expert added twice": (_set(h, lambda x, t: x + t[f"layers.{LAYER}.ffn"]), f"layers.{LAYER}.residual"),
    "residual: zero": (_set(h, lambda x, t: 0 * x), f"layers.{LAYER}.residual"),
    "residual: constant": (_set(h, lambda x, t: np.ones_like(x)), f"layers.{LAYER}.residual"),
    "residual: NaN": (_set(h, lambda x, t: x * np.nan), None),
    "final norm: 2x": (_set("final_norm", lambda x, t: 2 * x), "final_norm"),
    "final norm: zero": (_set("final_norm", lambda x, t: 0 * x), "final_norm"),
    "final norm: constant": (_set("final_norm", lambda x, t: np.ones_like(x)), "final_norm"),
    "final norm: NaN": (_set("final_norm", lambda x, t: x * np.nan), None),
    "lm_head: 2x": (_logits(lambda o: 2 * o), "lm_head"),
    "lm_head: zero": (_logits(lambda o: 0 * o), "lm_head"),
    "lm_head: constant": (_logits(lambda o: np.ones_like(o)), "lm_head"),
}


def test_a_correct_engine_is_within_every_check(source):
    result = diff(source, Bent(reference.load(source), lambda logits, trace: logits), "bfloat16", steps=2)
    assert result.verdict == "match", result.summary()["line"]
    units = {e.name: max(e.units, e.spike_units) for e in result.final.entries}
    assert {f"layers.{LAYER}.residual", "final_norm", "lm_head"} <= set(units) and max(units.values()) < 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_a_bent_value_is_named_at_its_check(source, case):
    bend, where = CASES[case]
    result = diff(source, Bent(reference.load(source), bend), "bfloat16", steps=2)
    assert result.verdict in ("diverged", "past-bound") and result.counts["near-tie"] == 0, result.summary()["line"]
    loc = result.localization
    if where is None:
        assert loc.nonfinite is not None and loc.nonfinite["name"] == case.split(":")[0].replace(
            "residual", h).replace("final norm", "final_norm"), loc.describe()
    else:
        assert loc.first is not None and loc.first.name == where, loc.describe()


def test_a_trace_without_final_norm_says_which_checks_could_not_run(source):
    def drop(logits, trace):
        del trace["final_norm"]
        return logits
    result = diff(source, Bent(reference.load(source), drop), "bfloat16", steps=2)
    text = result.final.describe()
    assert result.verdict == "match" and text.startswith("not localized: every check within its bound")
    assert "could not run: final_norm (the engine's trace holds no final_norm)" in text
    assert "lm_head" not in result.final.checks() and "residual" in result.final.checks()
