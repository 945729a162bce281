"""FlashKDA's ``fwd`` as the stand-in computes it (tests/parity/peers/flashkda_standin.py), with NaN planted
where FlashKDA 1ce47ea's fp16 Neumann inverse gives it: the output and final state of every head
whose keys repeat 16 times in a row."""
from __future__ import annotations

import sys

import torch

from parity.certify.candidate import adapter
from parity.peers import flashkda
from tests.parity.peers import flashkda_standin


def repeats(k: torch.Tensor, run: int = 16) -> torch.Tensor:
    """[B, H]: whether a head's keys hold ``run`` equal rows in a row."""
    same = (k[:, 1:] == k[:, :-1]).all(-1)          # [B, T-1, H]
    B, T1, H = same.shape
    hit = torch.zeros(B, H, dtype=torch.bool)
    for t in range(max(0, T1 - run + 2)):
        hit |= same[:, t:t + run - 1].all(1)
    return hit


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):
    flashkda_standin.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=initial_state,
                         final_state=final_state, cu_seqlens=cu_seqlens)
    for b, h in repeats(k).nonzero().tolist():
        out[b, :, h] = float("nan")
        if final_state is not None:
            final_state[b if cu_seqlens is None else slice(None), h] = float("nan")


@adapter(contract="bf16-storage", wraps="tests.parity.peers.flashkda_nan:fwd", gate="lower_bound")
def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None, cu_seqlens=None,
                  chunk_size=64, lower_bound=None):
    """parity.peers.flashkda's adapter around this module's ``fwd`` (the adapter's import seam)."""
    return flashkda.run(sys.modules[__name__], q, k, v, g_raw, beta_logits, A_log, dt_bias, scale, initial_state,
                        cu_seqlens, lower_bound)
