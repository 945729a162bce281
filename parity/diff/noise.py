"""The noise a step is judged by: the certified twin's where the twin is sane at that step, else
the ops' model-level bound; and the check of the engine's whole logit vector against it.

Per logit ``v`` the twin gives ``e_v = arith_scale * twin_bound(r, t)_v`` (``parity.diff.neartie``;
``twin.py`` for the scale). The twin's noise counts at a step only where the twin is sane there:

* its greedy token is the reference's, and
* every logit is within the model-level bound of the ops (``parity.bounds.model``: every op on the
  deepest path rounding once, chained through the stack with gains of 1; derived from the
  arithmetic, measured at ~0.1 of it for a correct bf16 model), ``c_v = rel(S) (|W| |h|)_v`` with
  ``h`` the reference's own final-norm row.

A twin past ``c`` had a router flip of its own (a discontinuity no smooth bound covers: measured on
the bundled fixture, a prompt of one repeated byte puts the emulated twin at 1.55x ``c`` while the
correct engine sits at 0.08x), and its jump is not noise a correct implementation shows on this
step. Such a step is judged without the twin's excuse, on ``c``, and the report says why. A twin
whose token differs although it is within ``c`` flipped a near-tie of its own: it is set aside too.
Either way a step is never held to more than ``FAR`` times the twin's own noise: a margin many times
past what the twin shows is diverged whatever else is true, unless a counterfactual replay shows a
router flip that explains it (``excuse.py``). Where ``c`` cannot be formed (a reference that traced
no final norm), an insane twin leaves the dtype floor ``u |r_v|``: no excuse at all.

``LogitsNoise`` holds the engine's whole logit vector to that noise: ``||o - r|| <= ||e||``. Each
``e_v`` is the larger of the twin's own ``|t_v - r_v|``, its 99th percentile over the vocabulary
and the floor, so ``||e||`` sits ~2.6x above the twin's own ``||t - r||`` for Gaussian noise;
measured on the bundled fixture (8 steps, 3 prompts): a correct engine at <= 0.57 of it at bf16
and <= 0.09 at fp32 (with the emulated twin's scale). It is what an engine without traces is held
to at every step (a 2x lm_head is 20-40x past it at bf16), and with traces at each step whose tokens
differ (``runner.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity.bounds.core import UNIT_ROUNDOFF
from parity.diff.neartie import twin_bound

from .numerics import finite_or_none

SOURCES = ("twin", "ops", "floor")
FAR = 4.0  # a step set aside from its twin is held to the ops' bound, but never to more than FAR
           # times the twin's own noise (the ops' bound sits ~4x above it at bf16)


@dataclass(frozen=True)
class Noise:
    """One step's per-logit noise ``e [V]``: from the twin (``source`` "twin"), else the ops'
    model-level bound ("ops"), else the dtype floor ("floor"); ``note``: why the twin's was not
    used (None: it was)."""
    e: np.ndarray
    source: str
    note: str | None


@dataclass(frozen=True)
class LogitsNoise:
    """The engine's logits against the reference's: ``||o - r||`` in units of ``||e||``."""
    diff: float
    bound: float
    units: float
    source: str

    def to_dict(self) -> dict:
        return {"diff": finite_or_none(self.diff), "bound": finite_or_none(self.bound),
                "units": finite_or_none(self.units), "source": self.source}

    def describe(self) -> str:
        what = {"twin": "the twin's noise", "ops": "the ops' model-level bound", "floor": "the dtype floor"}
        return (f"logits: ||engine - reference|| = {self.diff:.3g} = {self.units:.3g}x {what[self.source]} "
                f"{self.bound:.3g}")


def twin_sanity(r: np.ndarray, t: np.ndarray, certified: np.ndarray | None) -> str | None:
    """Why the twin's logits ``t`` are not noise at this step (module docstring), or None."""
    if int(np.argmax(t)) != int(np.argmax(r)):
        return f"the twin's token {int(np.argmax(t))} is not the reference's {int(np.argmax(r))}"
    if certified is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            worst = float(np.max(np.abs(t - r) / certified))
        if not worst <= 1.0:
            return f"the twin is {worst:.3g}x the ops' model-level bound (a router flip of its own)"
    return None


def step_noise(r: np.ndarray, o: np.ndarray, t: np.ndarray | None, *, dtype: str, scale: float,
               certified: np.ndarray | None, lossy: str | None) -> Noise:
    """The step's noise (module docstring): ``r``, ``o``, ``t`` the reference's, the engine's and
    the twin's logits ``[V]`` (``t`` None: no twin); ``scale``: the twin's ``arith_scale``;
    ``certified``: the ops' model-level bound ``[V]`` (None: not formed); ``lossy``: the dtype the
    engine's logits were stored in where coarser than the run (their rounding joins ``e``)."""
    note = "no twin ran" if t is None else twin_sanity(r, t, certified)
    twin = None if t is None else scale * twin_bound(r, t, dtype=dtype)
    if note is None:
        e, source = twin, "twin"
    elif certified is not None:
        e, source = np.maximum(certified, UNIT_ROUNDOFF[dtype] * np.abs(r)), "ops"
        if twin is not None:  # set aside, the twin still caps the excuse: never FAR times its noise
            e = np.minimum(e, FAR * twin)
    else:
        e, source = UNIT_ROUNDOFF[dtype] * np.abs(r), "floor"
    if lossy is not None:
        with np.errstate(invalid="ignore"):
            e = e + UNIT_ROUNDOFF[lossy] * np.where(np.isfinite(o), np.abs(o), 0.0)
    return Noise(e=e, source=source, note=note)


def logits_noise(r: np.ndarray, o: np.ndarray, noise: Noise) -> LogitsNoise:
    """``||o - r||`` against ``||e||`` (non-finite logits: inf units)."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = float(np.linalg.norm(o - r))
        bound = float(np.linalg.norm(noise.e))
    units = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
    return LogitsNoise(diff=diff, bound=bound, units=units if np.isfinite(units) else float("inf"),
                       source=noise.source)
