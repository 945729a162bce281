"""The decode loop's bookkeeping on scripted logits (no model, no traces): verdicts per step,
free-mode splits, re-anchoring and re-convergence, the summary line. The flip noise comes from a
scripted twin: the reference plus the same 0.01 noise, never the engine's own logits."""
import numpy as np

from kimi.config import KimiConfig
from parity.diff import run_diff
from parity.diff.runner import NO_TRACES

CONFIG = KimiConfig.from_name("tiny")
V = CONFIG.vocab_size


class Scripted:
    """``prefill``/``decode`` return the next row of ``rows`` (logits [V]); no trace entries."""

    def __init__(self, rows):
        self.rows, self.k, self.seen = rows, 0, []

    def _next(self):
        self.k += 1
        return self.rows[self.k - 1]

    def prefill(self, ids, *, trace=None):
        self.seen.append(list(ids))
        return self._next()[None], "cache"

    def decode(self, token, cache, *, trace=None):
        self.seen.append(token)
        return self._next(), cache


class ScriptedTwin:
    """A twin whose logits are the reference's rows plus noise of 0.01 (a correct engine's)."""

    def __init__(self, rows):
        self.rows = rows

    def logits(self, seq, prompt_len):
        return self.rows[len(seq) - prompt_len]

    def describe(self):
        return "a scripted twin"


def _pair(flips: dict[int, float], steps: int):
    """Reference rows with a clear winner; optimized rows = reference + noise 0.01, with the top
    two swapped at ``flips`` steps (reference margin = the given value)."""
    rng = np.random.default_rng(0)
    ref, opt, twin = [], [], []
    for step in range(steps):
        r = rng.normal(0, 1, V)
        a, b = 10 + step, 20 + step
        r[a] = 5.0
        r[b] = 5.0 - flips.get(step, 1.0)
        o = r + rng.uniform(-0.01, 0.01, V)
        twin.append(r + rng.uniform(-0.01, 0.01, V))
        if step in flips:
            o[a], o[b] = r[b], r[a]
        ref.append(r)
        opt.append(o.astype(np.float32))
    return Scripted(ref), Scripted(opt), ScriptedTwin(twin)


def test_free_mode_re_anchors_at_each_split_and_reports_re_convergence():
    ref, opt, twin = _pair({1: 0.004, 2: 0.003, 4: 0.002}, steps=6)
    result = run_diff(ref, opt, [5, 6, 7], config=CONFIG, steps=6, mode="free", dtype="float32",
                      twin=twin)
    assert [s.verdict for s in result.steps] == ["match", "near-tie", "near-tie", "match", "near-tie", "match"]
    assert result.splits == [{"step": 1, "verdict": "near-tie", "reconverged_at": 3},
                             {"step": 2, "verdict": "near-tie", "reconverged_at": 3},
                             {"step": 4, "verdict": "near-tie", "reconverged_at": 5}]
    assert [s.anchored for s in result.steps] == [False, True, True, False, True, False]
    # re-anchored: the optimized path consumed the reference's token, never its own
    assert opt.seen[1:] == ref.seen[1:] == [10, 11, 12, 13, 14]
    assert result.summary()["line"].endswith(f"free mode: 3 split(s), 3 re-converged; {NO_TRACES}")


def test_a_split_that_never_re_converges_is_reported_so():
    ref, opt, twin = _pair({2: 0.004, 3: 0.003}, steps=4)
    result = run_diff(ref, opt, [5], config=CONFIG, steps=4, mode="free", dtype="float32", twin=twin)
    assert [sp["reconverged_at"] for sp in result.splits] == [None, None]


def test_forced_mode_classifies_without_anchoring_and_a_far_flip_is_diverged():
    ref, opt, twin = _pair({1: 0.004, 3: 2.0}, steps=4)
    result = run_diff(ref, opt, [5], config=CONFIG, steps=4, mode="forced", dtype="float32",
                      twin=twin)
    assert [s.verdict for s in result.steps] == ["match", "near-tie", "match", "diverged"]
    assert result.splits == [] and not any(s.anchored for s in result.steps)
    s1, s3 = result.steps[1], result.steps[3]
    assert s1.ref_margin <= s1.bound and s3.ref_margin > s3.bound
    assert result.summary()["line"] == (
        f"2/4 tokens match, 1 near-tie (step 1, margin {s1.ref_margin:.3g} <= bound {s1.bound:.3g}), "
        f"1 diverged (first: step 3, margin 2 > bound {s3.bound:.3g}); {NO_TRACES}")
    assert result.localization is None and not result.traced  # scripted logits: nothing to localize


def test_without_traces_every_steps_logits_are_held_to_the_twins_noise():
    """A 2x lm_head never moves a token; the logits of every step are past the twin's noise."""
    ref, opt, twin = _pair({}, steps=3)
    opt.rows = [(2 * r).astype(np.float32) for r in ref.rows]
    result = run_diff(ref, opt, [5], config=CONFIG, steps=3, mode="forced", dtype="float32", twin=twin)
    assert result.counts["match"] == 3 and result.verdict == "past-bound"
    assert all(s.noise.source == "twin" and s.noise.units > 10 for s in result.steps)
    assert "not clean: past its bound although no step diverged: step 0: logits: ||engine - reference||" \
        in result.summary()["line"]


def test_a_twin_that_picks_another_token_is_set_aside_and_excuses_nothing_without_a_bound_to_fall_back_on():
    """The scripted reference traces no final norm: no model-level bound can be formed, so a step
    whose twin is not sane is held to the dtype floor, and the report says why."""
    ref, opt, twin = _pair({1: 0.004}, steps=3)
    r = ref.rows[1]
    twin.rows[1] = r.copy()
    twin.rows[1][[10 + 1, 20 + 1]] = r[[20 + 1, 10 + 1]] + [0.0, 0.001]   # the twin flips the tie too
    result = run_diff(ref, opt, [5], config=CONFIG, steps=3, mode="forced", dtype="float32", twin=twin)
    s1 = result.steps[1]
    assert s1.twin_note == "the twin's token 21 is not the reference's 11" and s1.noise.source == "floor"
    assert s1.verdict == "diverged" and result.twin_set_aside == [{"step": 1, "why": s1.twin_note}]
    assert "the twin's noise set aside at 1 step(s) (step 1: the twin's token 21" in result.summary()["line"]
