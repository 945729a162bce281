"""Localization: which op, in which layer, is past its bound, judged on the replay.

Every call of the engine is replayed (``replay.py``): the float64 reference runs each op on the
engine's own input to it, so each op is judged on its own arithmetic and an upstream difference (a
benign router flip, a bug one layer down) never loosens the check of a later op. ``ReplayStats``
collects, per op and position, the replay's relative error ``e[p]`` and the parts of its bound:

    bound[p] = amp[p] * (A * e_in[p] + KAPPA_STORAGE * u + KAPPA_ARITH * ua)

``e_in`` is the storage rounding of the trace the op's input was recovered from (``replay.py``),
``u`` the unit roundoff of the engine's storage dtype (doubled where the platform truncates, as the
Triton interpreter does: ``parity.platform``) and ``ua`` of its arithmetic (fp32 accumulators and
transcendentals; ``parity.bounds.core.precision_for``). The two ``KAPPA`` terms are the fresh
rounding one op may add: a few values stored at ``u/2`` each (projections, conv, norm outputs, the
kernels' bf16 intermediates), and fp32 reductions and exp/log/sqrt of a few ulps each. ``A`` is the
amplification one op may apply to the error it is handed. ``A`` and the ``KAPPA`` terms are
calibrated on benign runs (docs/concepts.md); ``amp`` is derived, per position: 1, except for a KDA
mixer, where it is the read-out's amplification (``replay.readout_amplification``: a head whose
``S^T q`` cancels carries a relative error ``kappa`` times a generic head's). The router has a
derived bound of its own (``router.py``); its ``e`` is in units of it, and so are the residual
stream's (``replay.py``) and lm_head's (``head.py``): the ``DERIVED`` checks, each a worst-case bound
per position, past which any single position is a bug.

Two checks per op: the level (the median of ``e`` over positions against the median of the bound:
a wrong op moves its output at most positions) and spikes (single positions past ``SPIKE`` times
their bound; a ``DERIVED`` check's bound is derived per position, so any position past it is one).
The first check past either, layer by layer (mixer, router, FFN, residual stream), then the final
norm and lm_head, is named: each is judged on the engine's own values, so the earliest in the
computation is where the first bug is. With every check within its bound, a router flip may explain
a step only where a counterfactual replay shows it (``excuse.py``; the runner records it here).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from parity.bounds.core import precision_for
from parity.metrics import to_numpy

from .numerics import finite_or_none
from .replay import Replay, ReplayCall
from .router import RouterFlip

# Calibrated, not derived (docs/error-bounds.md, "Model level": the ops' derived bounds chained
# through a layer are 10^3 above its error, past any bug's reach)
AMPLIFICATION = 8.0   # A
KAPPA_STORAGE = 4.0   # fresh rounding of one op: values stored at the run dtype, units of u
KAPPA_ARITH = 64.0    # ... and its arithmetic (fp32 reductions, exp/log/sqrt), units of ua
SPIKE = 2.0           # a single position may exceed the level bound this much before it is a spike
ENTRIES = ("mixer", "ffn")
DERIVED = ("router", "residual", "lm_head")  # their e is in units of a bound derived per position
HINT = {"kda": "kda", "mla": "mla", "moe": "moe", "mlp": "moe", "router": "moe", "norm": "norm",
        "residual": "norm", "lm_head": "embed"}  # the family to swap (our model fuses each residual add
                                                 # with the norm after it)


@dataclass
class EntryError:
    name: str           # trace key, e.g. "layers.2.mixer", or the check: "layers.2.residual", "lm_head"
    layer: int | None   # None for final_norm and lm_head
    op: str             # kda | mla | mlp | moe | router | residual | norm | lm_head
    rel_err: float      # level: median relative error over the positions
    bound: float        # its bound
    units: float        # rel_err / bound
    position: int       # the position of the largest spike
    spike_err: float
    spike_bound: float
    spike_units: float
    past_bound: list[int] = field(default_factory=list)  # positions with a spike past its bound
    readout: float = 1.0   # the KDA read-out's amplification at ``position`` (1 for other ops)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["past_bound"] = d["past_bound"][:32]
        for k in ("rel_err", "bound", "units", "spike_err", "spike_bound", "spike_units", "readout"):
            d[k] = finite_or_none(d[k])
        return d


@dataclass
class Localization:
    step: int
    tokens: int
    entries: list[EntryError]
    first: EntryError | None                 # the op past its bound (level first, else the root spike);
                                             # None when nothing is, or only router flips in noise
    first_kind: str | None                   # "level" | "spike" | "router" (nothing past its bound
                                             # and a replayed flip shown to explain the step)
    first_position: int | None               # the root spike's position (or the explaining flip's)
    nonfinite: dict | None                   # first entry where the optimized path holds NaN/Inf
    router_flips: list[RouterFlip]
    explained_by_router: list[RouterFlip]    # the flip a counterfactual replay showed to explain the
                                             # step (set by the runner; ``shown`` says what it gave)
    backend_hint: str | None
    unchecked: list[str] = field(default_factory=list)  # checks that could not run, and why
    shown: object | None = None              # the ``excuse.Counterfactual`` that explained the step

    @property
    def localized(self) -> bool:
        """Whether something is named: a check past its bound, or NaN/Inf."""
        return self.first is not None or self.nonfinite is not None

    def to_dict(self) -> dict:
        return {
            "step": self.step, "tokens": self.tokens,
            "first": self.first.to_dict() if self.first else None,
            "first_kind": self.first_kind, "first_position": self.first_position,
            "nonfinite": self.nonfinite,
            "explained_by_router": [f.to_dict() for f in self.explained_by_router],
            "shown": self.shown.to_dict() if self.shown is not None else None,
            "backend_hint": self.backend_hint,
            "router_flips": [f.to_dict() for f in self.router_flips],
            "checks": self.checks(),
            "unchecked": self.unchecked,
            "entries": [e.to_dict() for e in self.entries],
        }

    def checks(self) -> list[str]:
        """What was judged, in order: ``mixer``, ``router``, ``ffn``, ``residual`` (per layer),
        ``final_norm``, ``lm_head`` (those the run's traces allowed)."""
        seen: list[str] = []
        for e in self.entries:
            kind = e.name.rsplit(".", 1)[-1]
            if kind not in seen:
                seen.append(kind)
        return seen

    def ran(self) -> str:
        """``mixer, router, ffn, residual of 4 layers, final_norm, lm_head over 12 positions``."""
        kinds = self.checks()
        layers = len({e.layer for e in self.entries if e.layer is not None})
        per_layer = [k for k in kinds if k not in ("final_norm", "lm_head")]
        head = [k for k in kinds if k in ("final_norm", "lm_head")]
        text = ", ".join(per_layer) + f" of {layers} layers" if per_layer else "nothing"
        return text + "".join(f", {k}" for k in head) + f" over {self.tokens} positions"

    def describe(self) -> str:
        if self.nonfinite is not None:
            return f"first NaN/Inf at {self.nonfinite['name']} (position {self.nonfinite['position']})"
        if self.first is None:
            text = f"every check within its bound (judged: {self.ran()}"
            if self.unchecked:
                text += "; could not run: " + "; ".join(self.unchecked)
            text += ")"
            if self.shown is not None:
                return f"{text}; a router decision shown to explain it: {self.shown.describe()}"
            return f"not localized: {text}"
        f = self.first
        bad = [x for x in self.router_flips if x.layer == f.layer and not x.within_noise]
        if f.op == "router" and bad:
            return f"{f.name} (router): flip past its noise: {bad[0].describe()}"
        if f.op == "router":
            return (f"{f.name} (router) at position {f.position}: its scores or selection "
                    f"{f.spike_units:.3g}x their derived bound")
        pos = f.position if self.first_position is None else self.first_position
        worst = "" if pos == f.position else f" at worst (position {f.position})"
        if f.op == "residual":
            return (f"{f.name} (residual stream) at position {pos}: the stream after the layer differs from its "
                    f"input + mixer + FFN output by {f.spike_units:.3g}x its bound{worst}")
        if f.op == "lm_head":
            return (f"lm_head at position {pos}: the engine's logits differ from lm_head of its own final_norm row "
                    f"by {f.spike_units:.3g}x their bound{worst}")
        if self.first_kind == "level":
            text = (f"{f.name} ({f.op}): median error {f.rel_err:.3g} = {f.units:.3g}x its bound "
                    f"{f.bound:.3g}")
        else:
            text = (f"{f.name} ({f.op}) at position {self.first_position}: error {f.spike_err:.3g} = "
                    f"{f.spike_units:.3g}x its bound {f.spike_bound:.3g}")
        return text


def _rows(x) -> np.ndarray:
    x = to_numpy(x)
    return x.reshape(-1, x.shape[-1])


def first_nonfinite(opt_trace: dict, config) -> dict | None:
    """The first traced entry (layer by layer) where the optimized path holds NaN or Inf."""
    names = [f"layers.{i}.{e}" for i in range(config.num_hidden_layers) for e in (*ENTRIES, "hidden")]
    for name in names + ["final_norm"]:
        if name not in opt_trace:
            continue
        x = _rows(opt_trace[name])
        bad = ~np.isfinite(x)
        if bad.any():
            pos = int(np.argmax(bad.any(axis=-1)))
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            return {"name": name, "layer": layer, "position": pos,
                    "nan": int(np.isnan(x).sum()), "inf": int(np.isinf(x).sum())}
    return None


class ReplayStats:
    """Per op and position, the replay's error and its bound's parts, over the calls of one run:
    every call replays the same ops in the same order, so each part is an ``[ops, positions]``
    matrix and a step's localization judges every op at once."""

    def __init__(self, config):
        self.config = config
        self.names: list[tuple[str, int, str]] = []  # (name, layer, op) of each row
        self._parts: list[np.ndarray] = []  # per call (joined when a step localizes): [3, ops, T] of
                                            # err, err_in, amp
        self.flips: list[RouterFlip] = []
        self.positions = 0
        self.nonfinite: dict | None = None

    def add(self, call: ReplayCall, nonfinite: dict | None = None) -> None:
        """One call's replay (rows = consecutive positions starting at ``self.positions``);
        ``nonfinite``: the call's first NaN/Inf in the engine's trace (``first_nonfinite``, its
        position counted within the call), None when it holds none."""
        names = [(o.name, o.layer, o.op) for o in call.ops]
        if not self._parts:
            self.names = names
        elif names != self.names:
            raise ValueError("replay statistics: a call replayed other ops than the run's first")
        T = len(call.ops[-1].err) if call.ops else 0
        if call.ops:
            self._parts.append(np.stack([np.stack([o.err, o.err_in, o.amp]) for o in call.ops], axis=1))
        self.flips += call.flips
        if self.nonfinite is None and nonfinite is not None:
            self.nonfinite = {**nonfinite, "position": nonfinite["position"] + self.positions}
        self.positions += T

    def localize(self, step: int, upto: int, *, precision) -> Localization:
        """Judge every replayed op over positions ``0..upto-1``; ``precision``: the engine's
        ``parity.bounds.core.Precision`` (its ``u`` includes the platform's rounding)."""
        fresh = KAPPA_STORAGE * precision.u + KAPPA_ARITH * precision.ua
        entries = []
        if self._parts:
            if len(self._parts) > 1:
                self._parts = [np.concatenate(self._parts, axis=-1)]
            e, e_in, amp = self._parts[0][..., :upto]
            derived = np.array([op in DERIVED for _, _, op in self.names])
            # the router's, the residual stream's and lm_head's e are in units of their own derived
            # bound: each spikes at any position past it
            bound = np.where(derived[:, None], 1.0, amp * (AMPLIFICATION * e_in + fresh))
            entries = _entries(self.names, e, bound, amp, spike=np.where(derived, 1.0, SPIKE), router=derived)
        first = next((x for x in entries if x.units > 1.0 or x.past_bound), None)
        kind = pos = None
        if first is not None:
            kind = "level" if first.units > 1.0 else "spike"
            pos = None if kind == "level" else first.past_bound[0]
        visible = [f for f in self.flips if f.position < upto]
        hint = None if first is None else f"--backend {HINT[first.op]}=reference"
        nonfinite = self.nonfinite if self.nonfinite and self.nonfinite["position"] < upto else None
        return Localization(step=step, tokens=upto, entries=entries, first=first, first_kind=kind,
                            first_position=pos, nonfinite=nonfinite, router_flips=visible,
                            explained_by_router=[], backend_hint=hint, unchecked=self.unchecked())

    def unchecked(self) -> list[str]:
        """The head's checks the run's traces did not allow, each with why."""
        if not self._parts or any(name == "final_norm" for name, _, _ in self.names):
            return []
        why = "the engine's trace holds no final_norm"
        return [f"final_norm ({why})", f"lm_head replay ({why}; the logits are held to the twin's noise only)"]


def _entries(names, e, bound, amp, *, spike, router) -> list[EntryError]:
    """Judge each op's ``e [ops, P]`` against ``bound [ops, P]``: the level (medians over the
    positions) and single positions past ``spike [ops]`` times their bound. ``amp``: each op's own
    amplification inside ``bound``, reported (1 for the router, whose ``router`` row it is)."""
    level = np.median(e, axis=1)
    level_bound = np.median(bound, axis=1)
    spike_bound = spike[:, None] * bound
    with np.errstate(invalid="ignore", divide="ignore"):
        spike_units = np.where(np.isfinite(e), e / spike_bound, np.inf)
        units = np.where(np.isfinite(level), level / level_bound, np.inf)
    worst = np.argmax(spike_units, axis=1)
    out = []
    for r, ((name, layer, op), p) in enumerate(zip(names, worst)):
        past = np.flatnonzero(spike_units[r] > 1.0) if spike_units[r, p] > 1.0 else ()
        out.append(EntryError(name=name, layer=layer, op=op, rel_err=float(level[r]), bound=float(level_bound[r]),
                              units=float(units[r]), position=int(p), spike_err=float(e[r, p]),
                              spike_bound=float(spike_bound[r, p]), spike_units=float(spike_units[r, p]),
                              past_bound=[int(q) for q in past],
                              readout=1.0 if router[r] else float(amp[r, p])))
    return out


def localize(ref_model, opt_model, token_ids: list[int], config, *, dtype: str = "bfloat16",
             rounding: str = "nearest", step: int = 0) -> Localization:
    """Localize from one traced ``forward`` of the engine over ``token_ids``, replayed on the
    reference (the prefill kernels only; the decode loop replays its own calls instead).
    ``rounding``: the platform's conversion to ``dtype`` (``parity.platform.store_rounding``)."""
    precision = precision_for(dtype, rounding=rounding)
    ref_model.trace_kda_core = True  # the KDA read-out's amplification reads the core's values
    opt_trace: dict = {}
    opt_model.forward(list(token_ids), trace=opt_trace)
    stats = ReplayStats(config)
    stats.add(Replay(ref_model, config, u=precision.u, ua=precision.ua).add(token_ids, opt_trace),
              first_nonfinite(opt_trace, config))
    return stats.localize(step, len(token_ids), precision=precision)
