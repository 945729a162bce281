"""Named semantic bugs of the short convolution, per op: the wrap mutants' transformations of the
real candidate's inputs and outputs, and the internal ones evaluated by the emulation
(parity/mutants.py)."""
from __future__ import annotations

import torch

from parity.mutants import internal, wrap
from parity.ops import _slots

from . import emulate


def _flip_taps(d):
    d["weight"] = d["weight"].flip(-1).contiguous()
    return d


def _shift_taps(d):
    d["weight"] = d["weight"].roll(1, dims=-1).contiguous()
    return d


def _drop_state(d):
    d["initial_state"] = None
    return d


def _state_off_by_one(out, inp):
    # the state keeps inputs t-W .. t-2 instead of t-W+2 .. t (one step stale)
    x, h0 = inp["x"], inp.get("initial_state")
    B, T, C = x.shape
    W1 = out["final_state"].shape[-1]
    h0 = torch.zeros(B, C, W1, dtype=x.dtype, device=x.device) if h0 is None else h0
    xp = torch.cat([h0.to(x.dtype).transpose(1, 2), x], dim=1)
    out["final_state"] = xp[:, T - 1:T - 1 + W1, :].transpose(1, 2).contiguous().to(out["final_state"].dtype)
    return out


def _not_rolled(out, inp):
    out["new_state"] = inp["state"].clone()
    return out


TAPS_REVERSED = wrap("taps_reversed", "taps applied in reverse order", inputs=_flip_taps)

SHORT_CONV = (
    wrap("taps_reversed", "taps applied in reverse order (weight[:, 0] on the current token)", inputs=_flip_taps),
    wrap("initial_state_ignored", "the carried state is not read (zero history)", inputs=_drop_state),
    wrap("state_off_by_one", "the final state is one token stale", outputs=_state_off_by_one),
    internal("no_activation", "SiLU not applied after the convolution", emulate.short_conv),
    wrap("taps_shifted", "taps shifted by one (weight[:, j] applied to input t - W + j + 2)", inputs=_shift_taps),
)

SHORT_CONV_STEP = (
    TAPS_REVERSED,
    wrap("state_not_rolled", "the state is returned unchanged", outputs=_not_rolled),
    internal("no_activation", "SiLU not applied", emulate.short_conv_step),
)

SHORT_CONV_STEP_ = _slots.MUTANTS + (TAPS_REVERSED, _slots.blanked_by_zero("y"))
