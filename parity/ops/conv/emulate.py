"""Short convolution in torch at float32 arithmetic (see parity.emulate), and its in-place decode
step over a state pool."""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def _w(weight):
    return weight[:, 0, :] if weight.dim() == 3 else weight


def short_conv(x, weight, *, initial_state=None, mutation=None):
    check_mutation("short_conv", mutation, ("no_activation",))
    B, T, C = x.shape
    w = _w(weight).to(cdt(x.dtype))
    W = w.shape[1]
    h0 = torch.zeros(B, C, W - 1, dtype=x.dtype, device=x.device) if initial_state is None else initial_state
    xp = torch.cat([h0.to(x.dtype).transpose(1, 2), x], dim=1)
    xc = xp.to(w.dtype)
    acc = torch.zeros(B, T, C, dtype=w.dtype, device=x.device)
    for j in range(W):
        acc = acc + w[:, j] * xc[:, j:j + T, :]
    y = acc if mutation == "no_activation" else acc * torch.sigmoid(acc)
    return y.to(x.dtype), xp[:, T:, :].transpose(1, 2).contiguous()


def short_conv_step(x, weight, state, *, mutation=None):
    check_mutation("short_conv_step", mutation, ("no_activation",))
    w = _w(weight).to(cdt(x.dtype))
    win = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)
    acc = (w[None] * win.to(w.dtype)).sum(-1)
    y = acc if mutation == "no_activation" else acc * torch.sigmoid(acc)
    return y.to(x.dtype), win[:, :, 1:].contiguous()


def short_conv_step_(x, weight, state_pool, slot_ids, *, mutation=None):
    """:func:`short_conv_step` on each sequence's pool row ``slot_ids[b]``, written back in place; a
    padding row (slot -1) outputs zeros. Returns ``(y, state_pool)``."""
    y = torch.zeros_like(x)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        yb, sb = short_conv_step(x[b][None], weight, state_pool[s][None], mutation=mutation)
        y[b] = yb[0]
        state_pool[s] = sb[0]
    return y, state_pool
