"""Moonshot's FlashKDA (``flash_kda.fwd``, CUTLASS, SM90+) fitted to the bounded gate's fused chunked
record: ``parity certify --impl flashkda``. Nothing here is FlashKDA's code; it is imported only when
an adapter runs, and never installed by kimi-parity (build it from its source: docs/certificates.md).

What ``flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
final_state=None, cu_seqlens=None)`` computes (its docstring and ``tests/torch_ref.py`` at 1ce47ea):
l2norm of q and k, the **bounded gate** ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` fused
(``g`` raw; the softplus gate it does not compute), ``sigmoid(beta)`` of beta logits, chunks of 16
tokens, output into ``out``; states **V-major**, ``[N, H, V, K]``. It takes bf16 q, k, v, g, beta,
fp32 ``A_log [H]`` and ``dt_bias [H, K]``, K = V = 128, as many value heads as qk heads, CUDA
tensors, int64 ``cu_seqlens`` with B = 1. So the adapter serves ``kda.fused_chunked+lower_bound``
and declares the bounded gate (``adapter(gate="lower_bound")``): certified as the softplus gate's
``kda.fused_chunked`` it fails, the certificate naming the gate it computes. Inputs it does not take
(another dtype, K or V other than 128, grouped value heads) are ``Unsupported``, skipped and counted.

Layout, the adapter's work: the record's K-major state ``[N, HV, K, V]`` is handed over transposed
(V-major) and the final state transposed back; ``dt_bias [HV*K]`` becomes ``[H, K]``; an input
without ``A_log`` (the A_log-free bounded gate) passes ``A_log = 0``, which is that gate exactly
(``exp(0) = 1``). The final state is asked for in float32. The chunk size is the kernel's own (16):
the record's ``chunk_size`` names how the reference cuts chunks, which does not change what KDA
computes.

Contract: ``bf16-storage``. FlashKDA keeps its intermediates and its running state in bf16 and feeds
bf16 operands to its products; it also inverts each 16x16 chunk matrix by an fp16 Neumann series
with fp16 accumulation, which no contract here models: the certificate says by how much that
exceeds the bf16-storage bound, or that it turned NaN.

The import seam: :func:`fused_chunked` imports ``flash_kda`` and hands it to :func:`run`, which calls
any module with the documented ``fwd``: an adapter of another build (or the tests' torch stand-in,
tests/parity/peers/flashkda_standin.py) is the same three lines around :func:`run` with its module, so
nothing is monkeypatched.
"""
from __future__ import annotations

import importlib

import torch

from ..certify.candidate import adapter
from ..errors import Unsupported

HEAD_DIM = 128   # FlashKDA takes K = V = 128 only


def implementations(device: str) -> dict:
    """op name -> adapter for ``device``: on CUDA FlashKDA's ``fwd`` for the bounded gate's fused
    chunked op (and, declared as the bounded gate, for the softplus gate's, where it fails); on the
    CPU nothing (FlashKDA is CUDA only)."""
    if device != "cuda":
        return {}
    return {"kda.fused_chunked+lower_bound": fused_chunked, "kda.fused_chunked": fused_chunked}


def _flash_kda():
    return importlib.import_module("flash_kda")


@adapter(contract="bf16-storage", wraps="flash_kda:fwd", gate="lower_bound")
def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64, lower_bound=None):
    return run(_flash_kda(), q, k, v, g_raw, beta_logits, A_log, dt_bias, scale, initial_state, cu_seqlens,
               lower_bound)


def run(fk, q, k, v, g_raw, beta_logits, A_log, dt_bias, scale, initial_state, cu_seqlens, lower_bound):
    """``fk.fwd`` (``fk``: FlashKDA's module, or any with its documented ``fwd``) on the record's
    arguments: what it refuses raised as Unsupported, the layouts converted (module docstring).
    Returns ``(o [B,T,H,V] bf16, final_state [N,H,K,V] float32)``."""
    if lower_bound is None:
        raise ValueError("FlashKDA computes only the bounded gate lower_bound * sigmoid(exp(A_log) (g + dt_bias)); "
                         "it was asked for the softplus gate (lower_bound None)")
    if q.dtype != torch.bfloat16:
        raise Unsupported(f"FlashKDA: {str(q.dtype).replace('torch.', '')} inputs (it takes bf16 only)")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM or V != HEAD_DIM:
        raise Unsupported(f"FlashKDA: K = {K}, V = {V} (it takes K = V = {HEAD_DIM} only)")
    if HV != H:
        raise Unsupported(f"FlashKDA: {HV} value heads for {H} qk heads (it takes as many of each)")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev = q.device
    A = torch.zeros(H, dtype=torch.float32, device=dev) if A_log is None else A_log.reshape(H).float().contiguous()
    bias = dt_bias.reshape(H, K).float().contiguous()
    h0 = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()   # [N,H,V,K]
    out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)
    final = torch.zeros(N, H, V, K, dtype=torch.float32, device=dev)
    fk.fwd(q.contiguous(), k.contiguous(), v.contiguous(), g_raw.contiguous(), beta_logits.contiguous(),
           K ** -0.5 if scale is None else float(scale), out, A, bias, float(lower_bound),
           initial_state=h0, final_state=final,
           cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int64).contiguous())
    return out, final.transpose(-1, -2).contiguous()
