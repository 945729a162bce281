"""A router flip excuses a step only where a counterfactual replay shows it.

A step past the noise (its margin past the flip bound, or its logits past ``||e||``: ``noise.py``)
while every check of the replay is within its bound at the positions feeding it may still be a
correct run: a router decision within its noise swapped a whole expert, which moves the logits far
more than any smooth noise. That is a claim, and it is shown, never assumed: the float64 reference
is run again over the step's sequence, forced down the engine's own choice, and the step is judged
against those logits ``r'`` instead of ``r``. The excuse holds only where ``r'`` reproduces the
engine's token, or its margin within the flip bound, **and** the engine's whole logit vector within
the noise (``||o - r'|| <= ||e||``). Two counterfactuals, in this order:

* ``flip``: one replayed router flip within its noise (``router.py``: the engine's router and the
  float64 router disagree on the engine's own input, within the arithmetic's noise), the reference
  forced down the engine's choice at that layer and position and at no other (``routing`` rows of
  ``-1`` keep the reference's own choice: ``reference.Model.forward``). The latest flips first, at
  most ``MAX_FLIPS`` of them;
* ``routing``: the two runs' routing split without any replayed flip (the engine's stream drifted
  within its bounds, and its router, right for its own input, picked another expert than the
  reference's own run): the reference forced down every choice the engine made.

Both are tried only where no check is past its bound at the positions feeding the step (the
replayed ops, the residual stream, the head, NaN/Inf): only routing whose inputs passed their own
checks is trusted. The report names the flip that was replayed and what the replay gave.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity.diff.neartie import classify_step
from parity.metrics import to_numpy
from reference.checks import OWN

from .numerics import finite_or_none
from .router import RouterFlip

MAX_FLIPS = 4  # replayed flips tried per step (each a reference forward over the step's sequence)


@dataclass
class Counterfactual:
    """One counterfactual replay of a step and what it gave."""
    what: str                  # "flip" | "routing"
    flip: RouterFlip | None    # the replayed flip ("flip")
    forced: int                # choices forced down the engine's
    first: tuple[int, int] | None  # "routing": (layer, position) of the first choice the runs made apart
    token: int                 # the forced reference's greedy token
    opt_token: int             # the engine's
    margin: float              # r'[token] - r'[opt_token]
    bound: float               # the flip bound at those two tokens
    units: float               # ||o - r'|| / ||e||
    shown: bool                # the replay reproduces the engine's step within the noise

    def to_dict(self) -> dict:
        return {"what": self.what, "flip": self.flip.to_dict() if self.flip is not None else None,
                "forced": self.forced, "first": list(self.first) if self.first is not None else None,
                "token": self.token, "opt_token": self.opt_token, "margin": finite_or_none(self.margin),
                "bound": finite_or_none(self.bound), "units": finite_or_none(self.units), "shown": self.shown}

    def describe(self) -> str:
        if self.what == "flip":
            what = f"the reference forced down the engine's choice at {self.flip.describe()} (and at no other)"
        else:
            layer, pos = self.first
            what = (f"the reference forced down the engine's own expert choices at every position ({self.forced} "
                    f"differ from the reference's own run, first layers.{layer} pos {pos}; each within its noise)")
        if self.token == self.opt_token:
            gave = f"gives the engine's token {self.opt_token}"
        else:
            rel = "<=" if self.margin <= self.bound else ">"
            gave = (f"gives token {self.token}, the engine's {self.opt_token} at margin {self.margin:.3g} {rel} "
                    f"bound {self.bound:.3g}")
        return f"{what} {gave}; the engine's logits are {self.units:.3g}x the noise away from that replay's"


def judged(what: str, r2: np.ndarray, o: np.ndarray, e: np.ndarray, dtype: str, *, flip=None, forced: int = 1,
           first=None) -> Counterfactual:
    """The step judged against the forced reference's logits ``r2 [V]``: the engine's ``o`` and the
    per-logit noise ``e`` as the step's."""
    v = classify_step(r2, o, bound=e, dtype=dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff, bound = float(np.linalg.norm(o - r2)), float(np.linalg.norm(e))
    units = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
    units = units if np.isfinite(units) else float("inf")
    return Counterfactual(what=what, flip=flip, forced=forced, first=first, token=int(v.ref_token),
                          opt_token=int(v.opt_token), margin=float(v.margin), bound=float(v.bound), units=units,
                          shown=v.verdict != "diverged" and units <= 1.0)


def replay_flip(ref_model, seq: list[int], flip: RouterFlip, chosen: np.ndarray, o, e, dtype: str) -> Counterfactual:
    """``flip`` replayed alone: the reference over ``seq`` with the engine's experts ``chosen
    [k_e]`` at ``flip``'s layer and position and its own choice everywhere else."""
    routing = np.full((len(seq), len(chosen)), OWN, dtype=np.int64)
    routing[flip.position] = chosen
    r2 = to_numpy(ref_model.forward(list(seq), routing={flip.layer: routing}, logits="last")).reshape(-1)
    return judged("flip", r2, o, e, dtype, flip=flip)


def replay_routing(ref_model, seq: list[int], routing: dict, split: tuple[int, int, int], o, e,
                   dtype: str) -> Counterfactual:
    """The reference over ``seq`` down the engine's every expert choice ``routing``; ``split``: the
    ``Routes.split()`` it answers."""
    n, layer, pos = split
    r2 = to_numpy(ref_model.forward(list(seq), routing=routing, logits="last")).reshape(-1)
    return judged("routing", r2, o, e, dtype, forced=n, first=(layer, pos))


def candidates(flips: list[RouterFlip], position: int) -> list[RouterFlip]:
    """The replayed flips within their noise at positions up to ``position``, the latest first (at
    most ``MAX_FLIPS``)."""
    mine = [f for f in flips if f.within_noise and f.position <= position]
    return sorted(mine, key=lambda f: (-f.position, f.layer))[:MAX_FLIPS]


class Routes:
    """Both paths' own expert choices (``layers.i.router.ids``) over the calls of one run: where the
    engine's stream drifted (every op within its bound), its router may choose otherwise than the
    reference's own run, a whole expert apart although each choice is right for its own input."""

    def __init__(self, config):
        self.layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self.ref: dict[int, list[np.ndarray]] = {i: [] for i in self.layers}
        self.eng: dict[int, list[np.ndarray]] = {i: [] for i in self.layers}

    def add(self, ref_trace: dict, opt_trace: dict) -> None:
        for i in self.layers:
            k = f"layers.{i}.router.ids"
            if k in ref_trace and k in opt_trace:
                self.ref[i].append(np.sort(to_numpy(ref_trace[k]).astype(np.int64), axis=-1))
                self.eng[i].append(to_numpy(opt_trace[k]).astype(np.int64))

    def engine(self) -> dict:
        """``{layer: ids [T, k_e]}``: the engine's choices at every position so far."""
        return {i: np.concatenate(v) for i, v in self.eng.items() if v}

    def split(self) -> tuple[int, int, int] | None:
        """``(count, first layer, first position)`` of the choices the two runs made differently."""
        first, n = None, 0
        for i, v in self.engine().items():
            diff = np.flatnonzero(np.any(np.sort(v, axis=-1) != np.concatenate(self.ref[i]), axis=-1))
            n += diff.size
            if diff.size and (first is None or (diff[0], i) < (first[1], first[0])):
                first = (i, int(diff[0]))
        return None if first is None else (n, *first)
