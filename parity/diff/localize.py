"""Localization: which layer, and which op in it, first went past its bound.

The decode loop hands every call's traces of both paths to ``TraceStats`` (prefill: the prompt
positions; each decode step: its new position), so a diverged step is localized on exactly the
computation that produced it, the decode kernels included, with no extra model run. Per traced entry
and position ``p`` the error is ``e[p] = ||opt - ref|| / max(||ref[p]||, median_q ||ref[q]||)`` over
the hidden dimension (the floor keeps a position whose output happens to be small from passing as
a huge relative error).

Each layer has two ops on the residual stream: ``layers.i.mixer`` (KDA or MLA), which reads the
stream ``h_{i-1}`` at this and every earlier position (causal), and ``layers.i.ffn`` (dense MLP or
MoE), which reads ``mid_i = h_{i-1} + mixer_i`` at the same position. Both streams are recovered from
the traces (``mid_i = hidden_i - ffn_i``, ``h_{i-1} = mid_i - mixer_i``; layer 0 reads the exact
embedding). An op's error is judged against a propagation bound:

    bound = r * (A * (error of its input) + KAPPA_STORAGE * u + KAPPA_ARITH * ua)

``u`` is the unit roundoff of the optimized run's storage dtype (bf16: 2^-8; doubled where the
platform truncates instead of rounding to nearest, as the Triton interpreter does:
``parity.platform``) and ``ua`` of its arithmetic (fp32 accumulators and transcendentals;
``parity.bounds.core.precision_for``). The two
``KAPPA`` terms are the fresh rounding one op may add: a few values stored at ``u/2`` each
(projections, conv, norm outputs, the kernels' bf16 intermediates), and fp32 reductions and
exp/log/sqrt of a few ulps each. ``A`` is the amplification one op may apply to the error it is
handed (softmax attention with a sharp distribution amplifies most: ~4x measured on the small
preset). ``A`` and the ``KAPPA`` terms are calibrated on benign runs (docs/concepts.md: levels stay
below 0.6 of their bound in bf16; a perturbed ``A_log`` (+-1) in one KDA layer lands at 1.5-10x).
``r`` is derived, per position: 1, except for a KDA mixer, where it is the read-out's amplification
(``readout_amplification``): a head whose ``S^T q`` cancels carries a relative error ``kappa`` times
a generic head's, and the gated RMSNorm after it gives that head its full weight in the output
(docs/error-bounds.md, "Model level"). Two checks, in this order:

* level: the median of ``e`` over positions, against the median of the per-position bound. A
  wrong op (a perturbed ``A_log``, a mutant) moves its output at most positions; bf16 noise and the
  odd router flip do not move a median. The first entry, layer by layer, whose level is
  past its bound is the op that is wrong.
* spikes: single positions past ``SPIKE * bound`` built from that position's input error (the
  running maximum over earlier positions for the causal mixer) and its ``r``.

A router flip is what bf16 noise does that no bound can foresee: it swaps a whole expert, so the FFN
of its layer spikes at exactly the flipped position, and everything above that layer from that
position on inherits it. Spikes are therefore sorted out causally: a spike at a MoE FFN where the
router flipped within its noise bound (``router.py``) is a flip; a spike downstream of such a flip
(a higher layer, the same or a later position) is its consequence; any other spike is unexplained,
and the earliest of those (position, then layer, mixer before FFN; nothing later can have caused
it) names the op. With no level past its bound and no unexplained spike, the router flips in noise
explain what the logits did.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from parity.metrics import to_numpy

from .numerics import finite_or_none
from .router import RouterFlip

# Calibrated, not derived (docs/error-bounds.md, "Model level": the ops' derived bounds chained
# through a layer are 10^3 above its error, past any bug's reach)
AMPLIFICATION = 8.0   # A
KAPPA_STORAGE = 4.0   # fresh rounding of one op: values stored at the run dtype, units of u
KAPPA_ARITH = 64.0    # ... and its arithmetic (fp32 reductions, exp/log/sqrt), units of ua
SPIKE = 2.0           # a single position may exceed the level bound this much before it is a spike
ENTRIES = ("mixer", "ffn")


@dataclass
class EntryError:
    name: str           # trace key, e.g. "layers.2.mixer"
    layer: int | None   # None for final_norm
    op: str             # kda | mla | mlp | moe | norm
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
        for k in ("rel_err", "units", "spike_err", "spike_units", "readout"):
            d[k] = finite_or_none(d[k])
        return d


@dataclass
class Localization:
    step: int
    tokens: int
    entries: list[EntryError]
    first: EntryError | None                 # the op past its bound (level first, else the root spike);
                                             # None when nothing is, or only router flips in noise
    first_kind: str | None                   # "level" | "spike" | "router" (nothing past its bound)
    first_position: int | None               # the root spike's position (or the explaining flip's)
    nonfinite: dict | None                   # first entry where the optimized path holds NaN/Inf
    router_flips: list[RouterFlip]
    explained_by_router: list[RouterFlip]    # non-empty: the root spike is a router flip in noise
    backend_hint: str | None

    def to_dict(self) -> dict:
        return {
            "step": self.step, "tokens": self.tokens,
            "first": self.first.to_dict() if self.first else None,
            "first_kind": self.first_kind, "first_position": self.first_position,
            "nonfinite": self.nonfinite,
            "explained_by_router": [f.to_dict() for f in self.explained_by_router],
            "backend_hint": self.backend_hint,
            "router_flips": [f.to_dict() for f in self.router_flips],
            "entries": [e.to_dict() for e in self.entries],
        }

    def describe(self) -> str:
        if self.nonfinite is not None:
            return f"first NaN/Inf at {self.nonfinite['name']} (position {self.nonfinite['position']})"
        if self.explained_by_router:
            head = ("every op within its bound, no spike" if self.first_kind == "router" else
                    "every op within its bound except the FFN right where the router flipped")
            more = len(self.explained_by_router) - 2
            return (f"{head}; router flip(s) in noise: "
                    + "; ".join(f.describe() for f in self.explained_by_router[:2])
                    + (f" (+{more} more)" if more > 0 else ""))
        if self.first is None:
            return "not localized: every layer within its bound"
        f = self.first
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


def _op(config, i: int, entry: str) -> str:
    mixer, ffn = config.layer_kind(i)
    return mixer if entry == "mixer" else ("moe" if ffn == "moe" else "mlp")


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


KDA_CORE = ("q", "k", "v", "g", "beta", "initial_state", "normed")


def readout_amplification(ref_trace: dict, i: int) -> np.ndarray:
    """``[T]``: how much KDA layer ``i``'s read-out amplifies, at each position, the relative error
    its operands carry, seen at the mixer's output (docs/error-bounds.md, "Model level"): with
    ``kappa_h`` the read-out's condition number of value head ``h``
    (``parity.bounds.kda.readout_condition``) and ``y_h`` the head's gated-norm output,
    ``sqrt(sum_h |y_h|^2 max(1, kappa_h)^2 / sum_h |y_h|^2)``. The gated RMSNorm is scale invariant:
    it hands on the relative error of each head's read-out, whatever that head's magnitude, so a
    read-out that cancels (``kappa >> 1``) reaches the output at full weight."""
    from parity.bounds.kda import readout_condition

    p = f"layers.{i}.kda."
    missing = [n for n in KDA_CORE if p + n not in ref_trace]
    if missing:
        raise ValueError(f"the reference trace has no {p}{missing[0]}: the localization's bound needs the "
                         "KDA core's values (load the reference with trace_kda_core = True)")
    q, k, v, g, beta, s0, y = (to_numpy(ref_trace[p + n]).astype(np.float64) for n in KDA_CORE)
    kappa, _ = readout_condition(q, k, v, g, beta, s0)
    ny2 = np.sum(y * y, axis=-1)                                   # [T, HV]
    total = np.sum(ny2, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        amp = np.sqrt(np.sum(ny2 * np.maximum(1.0, kappa) ** 2, axis=-1) / total)
    return np.where(total > 0, amp, 1.0)


class TraceStats:
    """Per-position error and magnitude of every stream and op output, over the calls of one run.

    Stored per key (``layers.i.{in,mixer,mid,ffn}``, ``final_norm``): ``||opt - ref||`` and
    ``||ref||`` per position (two floats, whatever the hidden size)."""

    def __init__(self, config):
        self.config = config
        self.diff: dict[str, list[np.ndarray]] = {}
        self.norm: dict[str, list[np.ndarray]] = {}
        self.amp: dict[str, list[np.ndarray]] = {}   # KDA mixers: read-out amplification per position
        self.positions = 0
        self.nonfinite: dict | None = None

    def _put(self, key, ref, opt):
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.linalg.norm(opt - ref, axis=-1)
        self.diff.setdefault(key, []).append(np.where(np.isfinite(d), d, np.inf))
        self.norm.setdefault(key, []).append(np.linalg.norm(ref, axis=-1))

    def add(self, ref_trace: dict, opt_trace: dict) -> None:
        """One call's traces (rows = consecutive positions starting at ``self.positions``)."""
        c = self.config
        T = None
        for i in range(c.num_hidden_layers):
            keys = [f"layers.{i}.{k}" for k in ("mixer", "ffn", "hidden")]
            if not all(k in ref_trace and k in opt_trace for k in keys):
                break
            (ar, fr, hr), (ao, fo, ho) = ([_rows(t[k]) for k in keys] for t in (ref_trace, opt_trace))
            T = ar.shape[0]
            mid_r, mid_o = hr - fr, ho - fo
            self._put(f"layers.{i}.in", mid_r - ar, mid_o - ao)
            self._put(f"layers.{i}.mixer", ar, ao)
            self._put(f"layers.{i}.mid", mid_r, mid_o)
            self._put(f"layers.{i}.ffn", fr, fo)
            self._put(f"layers.{i}.hidden", hr, ho)
            if c.is_kda_layer(i):
                self.amp.setdefault(f"layers.{i}.mixer", []).append(readout_amplification(ref_trace, i))
        if "final_norm" in ref_trace and "final_norm" in opt_trace:
            self._put("final_norm", _rows(ref_trace["final_norm"]), _rows(opt_trace["final_norm"]))
        if self.nonfinite is None:
            bad = first_nonfinite(opt_trace, c)
            if bad is not None:
                bad["position"] += self.positions
                self.nonfinite = bad
        self.positions += T or 0

    def rel(self, key: str, upto: int) -> np.ndarray:
        """``e[p]`` for positions ``0..upto-1`` (see the module docstring)."""
        d = np.concatenate(self.diff[key])[:upto]
        n = np.concatenate(self.norm[key])[:upto]
        floor = np.median(n)
        with np.errstate(invalid="ignore", divide="ignore"):
            e = d / np.maximum(n, floor if floor > 0 else 1.0)
        return np.where(np.isfinite(e), e, np.inf)

    def amplification(self, key: str, upto: int) -> np.ndarray:
        """The read-out amplification of entry ``key`` at positions ``0..upto-1`` (1: none)."""
        if key not in self.amp:
            return np.ones(upto)
        return np.concatenate(self.amp[key])[:upto]

    def localize(self, step: int, upto: int, flips: list[RouterFlip], *, precision) -> Localization:
        """Localize the divergence seen at ``step`` from positions ``0..upto-1``; ``precision``: the
        optimized run's ``parity.bounds.core.Precision`` (its ``u`` includes the platform's rounding)."""
        c = self.config
        fresh = KAPPA_STORAGE * precision.u + KAPPA_ARITH * precision.ua
        entries: list[EntryError] = []
        for i in range(c.num_hidden_layers):
            if f"layers.{i}.mixer" not in self.diff:
                break
            e_in, e_mid = self.rel(f"layers.{i}.in", upto), self.rel(f"layers.{i}.mid", upto)
            if i == 0:
                e_in = np.zeros_like(e_in)  # the embedding lookup reads the same stored weights
            for entry, inherited in (("mixer", e_in), ("ffn", e_mid)):
                e = self.rel(f"layers.{i}.{entry}", upto)
                spike_in = np.maximum.accumulate(inherited) if entry == "mixer" else inherited
                amp = self.amplification(f"layers.{i}.{entry}", upto)
                entries.append(_entry(f"layers.{i}.{entry}", i, _op(c, i, entry), e, inherited, spike_in,
                                      fresh, amp))
        if "final_norm" in self.diff and entries:
            e_last = self.rel(f"layers.{c.num_hidden_layers - 1}.hidden", upto)
            e = self.rel("final_norm", upto)
            entries.append(_entry("final_norm", None, "norm", e, e_last, e_last, fresh, np.ones(upto)))
        visible = [f for f in flips if f.position < upto]
        first, kind, pos = next(((x, "level", None) for x in entries if x.units > 1.0), (None, None, None))
        explained: list[RouterFlip] = []
        if first is None:
            flip_at = {(f.layer, f.position): f for f in visible if f.within_noise}
            roots = []  # flip spikes in noise: the router swapped an expert there
            unexplained = []
            for k, x in enumerate(entries):
                for q in x.past_bound:
                    f = flip_at.get((x.layer, q)) if x.op == "moe" else None
                    if f is not None:
                        roots.append(f)
                    else:
                        unexplained.append((q, k, x))
            # a flip at (layer L, position p) reaches every later layer at p and after; the same
            # layer's mixer and FFN at later positions never see it
            layer_of = lambda x: c.num_hidden_layers if x.layer is None else x.layer  # noqa: E731
            unexplained = [(q, k, x) for q, k, x in unexplained
                           if not any(layer_of(x) > f.layer and q >= f.position for f in roots)]
            if unexplained:  # the root: nothing later in (position, layer) order can have caused it
                pos, _, first = min(unexplained, key=lambda s: (s[0], s[1]))
                kind = "spike"
            elif roots:
                kind, explained = "spike", roots
            elif visible and all(f.within_noise for f in visible):
                # every op within its bound and no spike: the router's discrete decisions are the only
                # way a correct model moves logits past their noise
                kind, explained = "router", list(visible)
            if explained:  # the flips of the latest position first: the ones nearest the step
                explained = sorted(explained, key=lambda f: (-f.position, f.layer))
                first, pos = None, explained[0].position
        hint = None
        if first is not None and not explained:
            hint = f"--backend {'moe' if first.op == 'mlp' else first.op}=reference"
        return Localization(step=step, tokens=upto, entries=entries, first=first,
                            first_kind=kind, first_position=pos,
                            nonfinite=self.nonfinite if self.nonfinite and self.nonfinite["position"] < upto else None,
                            router_flips=visible, explained_by_router=explained, backend_hint=hint)


def _entry(name, layer, op, e, inherited, spike_in, fresh, amp) -> EntryError:
    """``amp``: the op's own amplification per position (the KDA read-out's, 1 elsewhere): the
    bound at a position is ``amp * (A * input error + fresh)``; the level bound is the median of it
    (if every position is within its bound, so is the median)."""
    level = float(np.median(e))
    level_bound = float(np.median(amp * (AMPLIFICATION * inherited + fresh)))
    spike_bound = SPIKE * amp * (AMPLIFICATION * spike_in + fresh)
    with np.errstate(invalid="ignore"):
        spike_units = np.where(np.isfinite(e), e / spike_bound, np.inf)
    p = int(np.argmax(spike_units))
    units = level / level_bound if np.isfinite(level) else np.inf
    return EntryError(name=name, layer=layer, op=op, rel_err=level, bound=level_bound, units=units,
                      position=p, spike_err=float(e[p]), spike_bound=float(spike_bound[p]),
                      spike_units=float(spike_units[p]),
                      past_bound=[int(q) for q in np.flatnonzero(spike_units > 1.0)], readout=float(amp[p]))


def localize(ref_model, opt_model, token_ids: list[int], config, *, dtype: str = "bfloat16",
             rounding: str = "nearest", step: int = 0) -> Localization:
    """Localize from one ``forward`` of both paths over ``token_ids`` (the prefill kernels only; the
    decode loop localizes from its own traces instead). ``rounding``: the platform's conversion to
    ``dtype`` (``parity.platform.store_rounding``)."""
    from parity.bounds.core import precision_for

    from .router import trace_router_flips

    ref_trace, opt_trace = {}, {}
    ref_model.trace_kda_core = True  # the bound reads the KDA core's values
    ref_model.forward(list(token_ids), trace=ref_trace)
    opt_model.forward(list(token_ids), trace=opt_trace)
    stats = TraceStats(config)
    stats.add(ref_trace, opt_trace)
    precision = precision_for(dtype, rounding=rounding)
    flips = trace_router_flips(ref_trace, opt_trace, config, 0)
    return stats.localize(step, len(token_ids), flips, precision=precision)
