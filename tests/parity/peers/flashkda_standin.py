"""A stand-in for FlashKDA's module (``flash_kda``), which needs an SM90 GPU: its documented ``fwd``
(FlashKDA 1ce47ea, ``flash_kda/__init__.py`` and ``tests/torch_ref.py``), computed by the float64
reference, so that the adapter's layouts and gate plumbing (parity.peers.flashkda) are tested on
the CPU. Its checks are those ``fwd`` documents: bf16 q, k, v, g, beta; fp32 ``A_log [H]`` and
``dt_bias [H, K]``; K = V = 128; states ``[N, H, V, K]`` (V-major); int64 ``cu_seqlens`` with B = 1.

tests/parity/peers/flashkda_nan.py is the same with FlashKDA 1ce47ea's NaN planted."""
from __future__ import annotations

import sys

import numpy as np
import torch

from parity.certify.candidate import adapter
from parity.peers import flashkda
from reference import kda

D = 128


def _check(q, k, v, g, beta, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        assert t.dtype == torch.bfloat16 and t.is_contiguous(), f"{name}: bf16, contiguous"
    B, T, H, K = q.shape
    assert K == D and v.shape == (B, T, H, D) and g.shape == (B, T, H, K) and beta.shape == (B, T, H)
    assert A_log.dtype == torch.float32 and A_log.shape == (H,)
    assert dt_bias.dtype == torch.float32 and dt_bias.shape == (H, K)
    assert -5.0 <= lower_bound <= 0.0
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    assert cu_seqlens is None or (B == 1 and cu_seqlens.dtype == torch.int64)
    for s in (initial_state, final_state):
        assert s is None or (s.shape == (N, H, D, K) and s.dtype in (torch.bfloat16, torch.float32))


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):
    """FlashKDA's ``fwd``: ``out`` and ``final_state`` written in place (module docstring)."""
    _check(q, k, v, g, beta, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens)
    n = lambda t: None if t is None else t.detach().double().numpy()  # noqa: E731
    h0 = None if initial_state is None else n(initial_state).swapaxes(-1, -2)   # V-major -> K-first
    o, s = kda.fused_chunked(n(q), n(k), n(v), n(g), n(beta), n(A_log), n(dt_bias).reshape(-1), scale=scale,
                             initial_state=h0, cu_seqlens=None if cu_seqlens is None else cu_seqlens.numpy(),
                             lower_bound=lower_bound)
    out.copy_(torch.from_numpy(o))
    if final_state is not None:
        final_state.copy_(torch.from_numpy(np.ascontiguousarray(s.swapaxes(-1, -2))))


@adapter(contract="bf16-storage", wraps="tests.parity.peers.flashkda_standin:fwd", gate="lower_bound")
def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None, cu_seqlens=None,
                  chunk_size=64, lower_bound=None):
    """parity.peers.flashkda's adapter around this module's ``fwd`` (the adapter's import seam)."""
    return flashkda.run(sys.modules[__name__], q, k, v, g_raw, beta_logits, A_log, dt_bias, scale, initial_state,
                        cu_seqlens, lower_bound)
