"""Localization: which layer, and which op in it, first went past its bound.

Both paths run ``forward`` over the same token sequence with a trace; every traced entry is
compared position by position. The error of an entry is relative, ``||opt - ref|| / ||ref||`` over
the hidden dimension at one position, and its bound is a propagation model:

    bound = A * (error already in the entry's input) + KAPPA * u

``u`` is the unit roundoff of the optimized path's compute dtype; ``KAPPA * u`` is the fresh rounding
one layer stage may add (a handful of bf16 roundings of projections, norms and the mixer's own
reductions); ``A`` is how much a stage may amplify the error it was handed. The input of
``layers.i.mixer`` is the residual stream ``layers.{i-1}.hidden`` at every position up to this one
(the mixers are causal: the running maximum over earlier positions is used); the input of
``layers.i.ffn`` is the stream after the mixer, ``hidden_{i-1} + mixer_i``, at the same position (the
FFN is per token); ``final_norm`` reads the last hidden state. An entry is in *units* of its bound;
the first entry (layer by layer, mixer before FFN) with units > 1 names the layer and the op.

A benign run stays well below one unit everywhere (measured in docs/concepts.md); a wrong op adds
an error far larger than the rounding its stage may add, independent of how much noise it inherits.
A router flip is the exception the model cannot see coming: it swaps a whole expert, so the FFN of
its layer jumps past its bound at exactly the flipped positions. When those are the only positions
past the bound and every flip there is within its noise bound, the divergence is explained by
router near-ties (see ``router.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .numerics import finite_or_none, to_f64
from .router import RouterFlip, trace_router_flips

AMPLIFICATION = 4.0   # A: how much one stage may amplify the relative error it receives
KAPPA = 16.0          # fresh rounding one stage may add, in units of u
ENTRY_ORDER = ("mixer", "ffn")


@dataclass
class EntryError:
    name: str          # trace key, e.g. "layers.2.mixer"
    layer: int | None  # None for final_norm
    op: str            # kda | mla | mlp | moe | norm
    rel_err: float     # at the worst position (largest units)
    bound: float       # its bound there
    units: float       # rel_err / bound
    position: int      # sequence index of the worst position
    past_bound: list[int] = field(default_factory=list)  # every position with units > 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["past_bound"] = d["past_bound"][:32]
        d["rel_err"], d["units"] = finite_or_none(self.rel_err), finite_or_none(self.units)
        return d


@dataclass
class Localization:
    step: int
    tokens: int
    entries: list[EntryError]
    first: EntryError | None                 # the first entry past its bound
    nonfinite: dict | None                   # first entry where the optimized path has NaN/Inf
    router_flips: list[RouterFlip]
    explained_by_router: list[RouterFlip]    # non-empty: the first exceedance is router flips in noise
    backend_hint: str | None

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "first": self.first.to_dict() if self.first else None,
            "nonfinite": self.nonfinite,
            "explained_by_router": [f.to_dict() for f in self.explained_by_router],
            "backend_hint": self.backend_hint,
            "router_flips": [f.to_dict() for f in self.router_flips],
            "entries": [e.to_dict() for e in self.entries],
        }

    def describe(self) -> str:
        if self.nonfinite and (self.first is None or self.nonfinite["name"] == self.first.name):
            return f"first NaN/Inf at {self.nonfinite['name']} (position {self.nonfinite['position']})"
        if self.first is None:
            return "no layer past its bound"
        f = self.first
        text = f"{f.name} ({f.op}) at position {f.position}, {f.units:.3g}x its bound"
        if self.explained_by_router:
            text += " = router flip in noise: " + self.explained_by_router[0].describe()
        return text


def _rows(x) -> np.ndarray:
    x = to_f64(x)
    return x.reshape(-1, x.shape[-1])


def _rel_err(ref: np.ndarray, opt: np.ndarray) -> np.ndarray:
    """[T, D] x2 -> [T]: ||opt - ref|| / ||ref|| per position (inf where opt is not finite)."""
    num = np.linalg.norm(opt - ref, axis=-1)
    den = np.linalg.norm(ref, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = num / np.where(den > 0, den, 1.0)
    return np.where(np.isfinite(e), e, np.inf)


def _op(config, i: int, entry: str) -> str:
    mixer, ffn = config.layer_kind(i)
    return mixer if entry == "mixer" else ("moe" if ffn == "moe" else "mlp")


def first_nonfinite(opt_trace: dict, config) -> dict | None:
    """The first traced entry (layer by layer) where the optimized path holds NaN or Inf."""
    names = [f"layers.{i}.{e}" for i in range(config.num_hidden_layers) for e in (*ENTRY_ORDER, "hidden")]
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


def compare_traces(ref_trace: dict, opt_trace: dict, config, *, unit_roundoff: float) -> list[EntryError]:
    """Every traced entry's error in units of its propagation bound (module docstring)."""
    fresh = KAPPA * unit_roundoff
    entries = []
    prev_ref = prev_opt = None  # hidden_{i-1}; None before layer 0 (the embedding lookup is exact)
    for i in range(config.num_hidden_layers):
        keys = [f"layers.{i}.{k}" for k in ("mixer", "ffn", "hidden")]
        if not all(k in ref_trace and k in opt_trace for k in keys):
            break
        mix_r, mix_o = _rows(ref_trace[keys[0]]), _rows(opt_trace[keys[0]])
        ffn_r, ffn_o = _rows(ref_trace[keys[1]]), _rows(opt_trace[keys[1]])
        T = mix_r.shape[0]
        e_in = np.zeros(T) if prev_ref is None else _rel_err(prev_ref, prev_opt)
        mid_r = mix_r if prev_ref is None else prev_ref + mix_r
        mid_o = mix_o if prev_ref is None else prev_opt + mix_o
        for entry, err, inherited in (
            ("mixer", _rel_err(mix_r, mix_o), np.maximum.accumulate(e_in)),
            ("ffn", _rel_err(ffn_r, ffn_o), _rel_err(mid_r, mid_o)),
        ):
            entries.append(_entry(f"layers.{i}.{entry}", i, _op(config, i, entry), err,
                                  AMPLIFICATION * inherited + fresh))
        prev_ref, prev_opt = _rows(ref_trace[keys[2]]), _rows(opt_trace[keys[2]])
    if prev_ref is not None and "final_norm" in ref_trace and "final_norm" in opt_trace:
        err = _rel_err(_rows(ref_trace["final_norm"]), _rows(opt_trace["final_norm"]))
        entries.append(_entry("final_norm", None, "norm", err,
                              AMPLIFICATION * _rel_err(prev_ref, prev_opt) + fresh))
    return entries


def _entry(name, layer, op, err: np.ndarray, bound: np.ndarray) -> EntryError:
    with np.errstate(invalid="ignore"):
        units = np.where(np.isfinite(err), err / bound, np.inf)
    p = int(np.argmax(units))
    return EntryError(name=name, layer=layer, op=op, rel_err=float(err[p]), bound=float(bound[p]),
                      units=float(units[p]), position=p,
                      past_bound=[int(q) for q in np.flatnonzero(units > 1.0)])


def localize_traces(step: int, ref_trace: dict, opt_trace: dict, config, *,
                    unit_roundoff: float) -> Localization:
    """Localize from two full-sequence forward traces (row t of every entry = sequence position t)."""
    entries = compare_traces(ref_trace, opt_trace, config, unit_roundoff=unit_roundoff)
    flips = trace_router_flips(ref_trace, opt_trace, config, 0, unit_roundoff=unit_roundoff)
    first = next((e for e in entries if e.units > 1.0), None)
    explained = []
    if first is not None and first.op == "moe":
        at = {f.position: f for f in flips if f.layer == first.layer}
        if all(p in at and at[p].within_noise for p in first.past_bound):
            explained = [at[p] for p in first.past_bound]
    hint = None
    if first is not None and not explained:
        family = {"kda": "kda", "mla": "mla", "moe": "moe", "mlp": "moe", "norm": "norm"}[first.op]
        hint = f"--backend {family}=reference"
    tokens = _rows(ref_trace["final_norm"]).shape[0] if "final_norm" in ref_trace else 0
    return Localization(step=step, tokens=tokens, entries=entries, first=first,
                        nonfinite=first_nonfinite(opt_trace, config), router_flips=flips,
                        explained_by_router=explained, backend_hint=hint)


def localize(step: int, ref_model, opt_model, token_ids: list[int], config, *,
             unit_roundoff: float) -> Localization:
    """Run ``forward`` on both paths over ``token_ids`` with traces and localize (see module doc)."""
    ref_trace, opt_trace = {}, {}
    ref_model.forward(list(token_ids), trace=ref_trace)
    opt_model.forward(list(token_ids), trace=opt_trace)
    return localize_traces(step, ref_trace, opt_trace, config, unit_roundoff=unit_roundoff)
