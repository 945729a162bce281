"""fla-core 0.6.0 (flash-linear-attention, the KDA kernels vLLM vendors) fitted to the registered
signatures: ``parity certify --impl fla``. Nothing here is fla's code; these functions call it, and
fla is imported only when one runs.

On CUDA, fla's Triton kernels: ``fused_kda_gate`` (kda.gate), ``fused_recurrent_kda`` (kda.recurrent
with the gate, l2norm and beta sigmoid off; kda.fused_recurrent with all three in the kernel),
``chunk_kda`` (kda.chunked, kda.fused_chunked; chunk sizes 32 and 64 only: other inputs are
``Unsupported``), ``l2norm`` (norm.l2norm) and ``rms_norm_gated`` with a sigmoid gate
(norm.gated_rms_norm). On the CPU, where fla's kernels do not run (Triton needs a GPU), fla's own
torch recurrences: ``naive_recurrent_kda`` (kda.recurrent), ``naive_chunk_kda`` (kda.chunked) and
``naive_kda_gate`` (kda.gate).

Contracts, read in fla-core 0.6.0's source: ``chunk_kda``'s kernels call ``tl.dot`` without an
``input_precision`` (wy_fast.py, chunk_intra.py, common/chunk_delta_h.py, common/chunk_o.py), which
is Triton's default ``"tf32"`` for float32 operands, and chunk_intra.py solves the triangular system
with ``SOLVE_TRIL_DOT_PRECISION = "tf32"`` where TF32 exists: ``tf32``. ``fused_recurrent_kda``
reduces with ``tl.sum`` (no tensor-core product), the gate and the norms are elementwise with
``tl.sum`` reductions, the torch recurrences run IEEE float32 matmuls on the CPU: ``ieee``.
"""
from __future__ import annotations

import warnings

from ..candidate import adapter
from ..errors import Unsupported

CHUNK_SIZES = (32, 64)   # chunk_kda refuses others: "`chunk_size` must be either 32 or 64 for KDA"


def implementations(device: str) -> dict:
    """op name -> adapter for ``device`` (``cuda``: fla's Triton kernels; ``cpu``: its torch
    recurrences)."""
    if device == "cuda":
        return {"kda.gate": gate, "kda.recurrent": recurrent, "kda.chunked": chunked,
                "kda.fused_recurrent": fused_recurrent, "kda.fused_chunked": fused_chunked,
                "norm.l2norm": l2norm, "norm.gated_rms_norm": gated_rms_norm}
    return {"kda.gate": naive_gate, "kda.recurrent": naive_recurrent, "kda.chunked": naive_chunked}


def _quiet_import(module: str):
    """Import an fla module; on a machine without a GPU fla warns that Triton rolls back to CPU."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(module)


def _chunk(chunk_size):
    if chunk_size not in CHUNK_SIZES:
        raise Unsupported(f"fla chunk_kda: chunk_size {chunk_size} (it takes 32 or 64)")
    return chunk_size


# -- CUDA: fla's Triton kernels ---------------------------------------------------------------------
@adapter(contract="ieee", wraps="fla.ops.kda.gate:fused_kda_gate")
def gate(g_raw, A_log, dt_bias):
    return _quiet_import("fla.ops.kda.gate").fused_kda_gate(g_raw, A_log, dt_bias)


@adapter(contract="ieee", wraps="fla.ops.kda:fused_recurrent_kda")
def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    return _quiet_import("fla.ops.kda").fused_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens)


@adapter(contract="ieee", wraps="fla.ops.kda:fused_recurrent_kda")
def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                    cu_seqlens=None):
    return _quiet_import("fla.ops.kda").fused_recurrent_kda(
        q, k, v, g_raw, beta_logits, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)


@adapter(contract="tf32", wraps="fla.ops.kda:chunk_kda")
def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    return _quiet_import("fla.ops.kda").chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, chunk_size=_chunk(chunk_size))


@adapter(contract="tf32", wraps="fla.ops.kda:chunk_kda")
def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64):
    return _quiet_import("fla.ops.kda").chunk_kda(
        q, k, v, g_raw, beta_logits, scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=_chunk(chunk_size))


@adapter(contract="ieee", wraps="fla.modules.norm.l2norm:l2norm")
def l2norm(x, *, eps=1e-6):
    return _quiet_import("fla.modules.norm.l2norm").l2norm(x, eps=eps)


@adapter(contract="ieee", wraps="fla.modules.norm.fused_norm_gate:rms_norm_gated")
def gated_rms_norm(x, gate, weight, *, eps):
    return _quiet_import("fla.modules.norm.fused_norm_gate").rms_norm_gated(
        x, gate, weight, None, activation="sigmoid", eps=eps)


# -- CPU: fla's torch recurrences -------------------------------------------------------------------
def _each_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens, multiple=1):
    """``run(q, k, v, g, beta, h0) -> (o, S)`` on one sequence at a time (a batch row or a
    ``cu_seqlens`` segment: fla's torch recurrences take no ``cu_seqlens``), each padded with zero
    rows to a multiple of ``multiple`` tokens (naive_chunk_kda asserts whole chunks). A zero row
    (g = 0, beta = 0, k = q = v = 0) leaves the state as it is and comes after every real token, so
    the padding changes no output."""
    import torch

    B, T = q.shape[:2]
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
        spans = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    outs, states = [], []
    for n, (b, t0, t1) in enumerate(spans):
        pad = -(t1 - t0) % multiple
        xs = []
        for x in (q, k, v, g, beta):
            x = x[b:b + 1, t0:t1]
            xs.append(torch.cat([x, x.new_zeros((1, pad, *x.shape[2:]))], dim=1) if pad else x)
        o, S = run(*xs, None if initial_state is None else initial_state[n:n + 1])
        outs.append(o[:, :t1 - t0])
        states.append(S)
    return torch.cat(outs, dim=1 if cu_seqlens is not None else 0), torch.cat(states, dim=0)


@adapter(contract="ieee", wraps="fla.ops.kda.naive:naive_recurrent_kda")
def naive_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    fn = _quiet_import("fla.ops.kda.naive").naive_recurrent_kda

    def run(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)

    return _each_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens)


@adapter(contract="ieee", wraps="fla.ops.kda.naive:naive_chunk_kda")
def naive_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    fn = _quiet_import("fla.ops.kda.naive").naive_chunk_kda

    def run(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                  chunk_size=chunk_size)

    return _each_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens, multiple=chunk_size)


@adapter(contract="ieee", wraps="fla.ops.kda.gate:naive_kda_gate")
def naive_gate(g_raw, A_log, dt_bias):
    return _quiet_import("fla.ops.kda.gate").naive_kda_gate(g_raw, A_log, dt_bias)
