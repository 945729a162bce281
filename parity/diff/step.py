"""One decode step of ``parity diff``: its logits on the host (``StepLogits``) and its record
(``StepRecord``), judged first on the logits alone: the greedy tokens, the flip bound from the
step's noise (``noise.py``), and, where the twin ran, the whole logit vector against that noise.
``runner.PromptRun.judge`` refines the verdict with the replay (``localize.py``) and the
counterfactuals (``excuse.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from parity.bounds.core import UNIT_ROUNDOFF
from parity.diff.neartie import classify_step

from .excuse import Counterfactual
from .head import HeadCheck
from .localize import Localization
from .logits import LogitsCheck
from .noise import LogitsNoise, logits_noise, step_noise
from .numerics import finite_or_none, kl_divergence, max_abs_diff
from .router import RouterFlip


@dataclass
class StepRecord:
    step: int
    position: int            # sequence index whose logits are compared
    input_token: int | None  # token both paths consumed before this step (None: step 0, the prompt)
    ref_token: int
    opt_token: int
    verdict: str             # match | near-tie | diverged (after the replay and counterfactuals)
    classified: str          # classify_step's own verdict
    max_abs_diff: float
    kl: float
    ref_margin: float        # r[ref_token] - r[opt_token] (0 for a match)
    bound: float | None      # the flip bound (None: the tokens agree and no noise was formed)
    ratio: float
    ref_gap: float = 0.0     # r[ref_token] - the reference's runner-up: how far from any flip
    router: list[RouterFlip] = field(default_factory=list)
    explanation: str | None = None  # why the verdict differs from ``classified``, or what localized it
    cause: str | None = None        # "router": a counterfactual showed a router flip; "op": a check
                                    # past its bound; "nonfinite"
    nonfinite: dict | None = None
    anchored: bool = False   # free mode: the optimized path was re-anchored after this step
    logits: LogitsCheck | None = None  # the logits' span check (None: the check did not apply)
    noise: LogitsNoise | None = None   # the logits against the step's noise (None: no twin ran)
    twin_note: str | None = None       # why the twin's noise was set aside at this step (None: it
                                       # was used, or did not run)
    head: HeadCheck | None = None      # the logits replayed through lm_head (None: no final_norm traced)
    counterfactual: Counterfactual | None = None  # the replay that showed (or last failed to show)
                                                  # a router flip
    localization: Localization | None = None  # steps judged past the noise (not in to_dict: the
                                              # report carries the one that matters)

    def to_dict(self) -> dict:
        return {
            "step": self.step, "position": self.position, "input_token": self.input_token,
            "ref_token": self.ref_token, "opt_token": self.opt_token, "verdict": self.verdict,
            "classified": self.classified, "max_abs_diff": finite_or_none(self.max_abs_diff),
            "kl": finite_or_none(self.kl), "ref_margin": finite_or_none(self.ref_margin),
            "bound": finite_or_none(self.bound), "ratio": finite_or_none(self.ratio),
            "ref_gap": finite_or_none(self.ref_gap),
            "router": [f.to_dict() for f in self.router], "explanation": self.explanation,
            "cause": self.cause,
            "nonfinite": self.nonfinite, "anchored": self.anchored,
            "logits": self.logits.to_dict() if self.logits is not None else None,
            "noise": self.noise.to_dict() if self.noise is not None else None,
            "twin_note": self.twin_note,
            "head": self.head.to_dict() if self.head is not None else None,
            "counterfactual": self.counterfactual.to_dict() if self.counterfactual is not None else None,
        }

    @property
    def past_noise(self) -> bool:
        """The logits past the step's noise, with no counterfactual that shows why."""
        shown = self.counterfactual is not None and self.counterfactual.shown
        return self.noise is not None and self.noise.units > 1 and not shown


@dataclass
class StepLogits:
    """One step's logits on the host (``PromptRun.logits``): the reference's ``r``, the engine's
    ``o`` and the twin's ``t`` (float64 ``[vocab]``; ``t`` None: the twin did not run), with what
    ``record`` judges them by: ``certified`` the ops' model-level bound ``[vocab]`` (None: not
    formed), ``scale`` the twin's ``arith_scale``."""
    step: int
    position: int
    input_token: int | None
    r: np.ndarray
    o: np.ndarray
    t: np.ndarray | None
    dtype: str
    lossy: str | None      # the engine's logits came back coarser than the run (``coarser``)
    stored: str | None     # the dtype the engine returned its logits in
    certified: np.ndarray | None = None
    scale: float = 1.0

    @property
    def flipped(self) -> bool:
        """The greedy tokens differ, or the engine's logits hold NaN/Inf."""
        o = self.o
        return int(np.argmax(self.r)) != int(np.argmax(np.where(np.isnan(o), -np.inf, o))) or not np.all(np.isfinite(o))

    def noise(self):
        """The step's ``noise.Noise`` (None: no twin ran and the tokens agree)."""
        if self.t is None and not self.flipped:
            return None
        return step_noise(self.r, self.o, self.t, dtype=self.dtype, scale=self.scale, certified=self.certified,
                          lossy=self.lossy)

    def record(self) -> StepRecord:
        """The step judged on its logits: host arithmetic over the vocabulary only, so the records
        of a batch's prompts may be taken side by side in threads."""
        r, o = self.r, self.o
        noise = self.noise()
        if noise is None:  # the greedy tokens agree and every logit is finite: a match (classify_step's)
            token = int(np.argmax(r))
            return StepRecord(step=self.step, position=self.position, input_token=self.input_token,
                              ref_token=token, opt_token=token, verdict="match", classified="match",
                              max_abs_diff=max_abs_diff(r, o), kl=kl_divergence(r, o), ref_margin=0.0,
                              bound=None, ratio=0.0, ref_gap=_gap(r))
        v = classify_step(r, o, bound=noise.e, dtype=self.dtype)
        return StepRecord(
            step=self.step, position=self.position, input_token=self.input_token,
            ref_token=int(v.ref_token), opt_token=int(v.opt_token), verdict=v.verdict,
            classified=v.verdict, max_abs_diff=max_abs_diff(r, o), kl=kl_divergence(r, o),
            ref_margin=float(v.margin), bound=float(v.bound), ratio=float(v.ratio), ref_gap=_gap(r),
            noise=logits_noise(r, o, noise), twin_note=noise.note if self.t is not None else None)


def _gap(r: np.ndarray) -> float:
    """The reference's top-1 minus its top-2: how far the step was from any flip."""
    return float(np.diff(np.partition(r, -2)[-2:])[0]) if r.size > 1 else 0.0


def coarser(stored: str | None, dtype: str) -> str | None:
    """``stored`` when logits came back in a dtype coarser than the run's ``dtype`` (their own
    rounding then joins the flip bound, and the report says so), else None."""
    if stored is None or stored not in UNIT_ROUNDOFF or dtype not in UNIT_ROUNDOFF:
        return None
    return stored if UNIT_ROUNDOFF[stored] > UNIT_ROUNDOFF[dtype] else None
