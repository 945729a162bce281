"""Named semantic bugs of the norms, per op: the wrap mutants' transformations of the real
candidate's inputs, keyword arguments and outputs, and the internal ones evaluated by the emulation
(parity/mutants.py)."""
from __future__ import annotations

import torch

from parity.mutants import internal, wrap
from parity.registry import Mutant

from . import emulate


def _w_plus_one(d):
    d["weight"] = d["weight"] + 1
    return d


def _no_eps(kw):
    kw["eps"] = 0.0
    return kw


def _eps_tenth(kw):
    kw["eps"] = kw["eps"] / 10
    return kw


def _gate_open(d):
    d["gate"] = torch.full_like(d["gate"], 30.0)   # sigmoid(30) rounds to 1 in float32
    return d


def _no_residual(d):
    d["residual"] = torch.zeros_like(d["residual"])
    return d


def _h_not_written(out, inp):
    out["h"] = inp["residual"].clone()
    return out


class _NormOfBranch:
    """Wrap mutant: h is right, but y normalizes the branch output x instead of the sum."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            out = dict(cand(inp, kw))
            out["y"] = cand(dict(inp, residual=torch.zeros_like(inp["residual"])), kw)["y"]
            return out

        return mutated


def _swap_last(d):
    d["x"] = d["x"].transpose(-1, -2).contiguous()
    return d


def _swap_back(out, inp):
    out["y"] = out["y"].transpose(-1, -2).contiguous()
    return out


WEIGHT_PLUS_ONE = wrap("weight_plus_one", "(1 + w) weight convention", inputs=_w_plus_one)

RMS_NORM = (
    wrap("weight_plus_one", "(1 + w) weight convention (Gemma) applied to a plain weight", inputs=_w_plus_one),
    internal("sum_not_mean", "sum of squares instead of their mean", emulate.rms_norm),
    wrap("eps_dropped", "eps left out of the rms (visible in the small rows)", kwargs=_no_eps),
    wrap("eps_one_tenth", "eps / 10 (kv_a_layernorm's 1e-6 where 1e-5 is asked)", kwargs=_eps_tenth),
)

ADD_RMS_NORM = (
    wrap("residual_dropped", "the residual not added (the norm of the branch output alone)", inputs=_no_residual),
    wrap("h_not_written", "the sum never stored: the residual stream comes back unchanged", outputs=_h_not_written),
    WEIGHT_PLUS_ONE,
    Mutant("norm_of_branch", "y normalizes the branch output x, not the sum h", "wrap", _NormOfBranch()),
)

GATED_RMS_NORM = (
    internal("silu_gate", "SiLU gate instead of sigmoid (an early transformers port)", emulate.gated_rms_norm),
    internal("norm_after_gate", "normalizes x * sigmoid(gate) instead of gating the normalized x",
             emulate.gated_rms_norm),
    WEIGHT_PLUS_ONE,
    wrap("gate_dropped", "the sigmoid gate left out (a plain rms_norm)", inputs=_gate_open),
)

L2NORM = (
    internal("no_sqrt", "divides by sum(x^2) + eps, not its square root", emulate.l2norm),
    internal("mean_not_sum", "normalizes by the rms (mean of squares) instead of the 2-norm", emulate.l2norm),
    wrap("wrong_axis", "normalizes over the second-to-last axis", inputs=_swap_last, outputs=_swap_back),
)
