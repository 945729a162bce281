"""fla-core 0.6.0 (flash-linear-attention, the KDA kernels vLLM vendors) fitted to the registered
signatures: ``parity certify --impl fla``. Nothing here is fla's code; these functions call it, and
fla is imported only when one runs.

On CUDA, fla's Triton kernels: ``fused_kda_gate`` (kda.gate), ``fused_recurrent_kda`` (kda.recurrent
with the gate, l2norm and beta sigmoid off; kda.fused_recurrent with all three in the kernel),
``chunk_kda`` (kda.chunked, kda.fused_chunked; chunk sizes 32 and 64 only: other inputs are
``Unsupported``), ``l2norm`` (norm.l2norm) and ``rms_norm_gated`` with a sigmoid gate
(norm.gated_rms_norm). The bounded gate ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``:
``fused_kda_gate(..., lower_bound=)`` (kda.gate+lower_bound), ``fused_recurrent_kda(...,
lower_bound=)`` (kda.fused_recurrent+lower_bound) and the safe-gate path ``chunk_kda(...,
use_gate_in_kernel=True, safe_gate=True, lower_bound=)`` (kda.fused_chunked+lower_bound; its M = 16
tensor-core intra-chunk path). On the CPU, where fla's kernels do not run (Triton needs a GPU), fla's
own torch recurrences: ``naive_recurrent_kda`` (kda.recurrent), ``naive_chunk_kda`` (kda.chunked),
``naive_kda_gate`` (kda.gate) and ``naive_kda_lowerbound_gate`` (kda.gate+lower_bound).

Contracts, read in fla-core 0.6.0's source: ``chunk_kda``'s kernels call ``tl.dot`` without an
``input_precision`` (wy_fast.py, chunk_intra.py, common/chunk_delta_h.py, common/chunk_o.py), which
is Triton's default ``"tf32"`` for float32 operands, and chunk_intra.py solves the triangular system
with ``SOLVE_TRIL_DOT_PRECISION = "tf32"`` where TF32 exists: ``tf32``. ``fused_recurrent_kda``
reduces with ``tl.sum`` (no tensor-core product), the gate and the norms are elementwise with
``tl.sum`` reductions, the torch recurrences run IEEE float32 matmuls on the CPU: ``ieee``.
"""
from __future__ import annotations

import importlib
import warnings

import torch

from ..certify.candidate import adapter
from ..errors import Unsupported
from ..record.watch.adapters import Mapping, Mismatch, flag, require_none, returned

CHUNK_SIZES = (32, 64)   # chunk_kda refuses others: "`chunk_size` must be either 32 or 64 for KDA"


def implementations(device: str) -> dict:
    """op name -> adapter for ``device`` (``cuda``: fla's Triton kernels; ``cpu``: its torch
    recurrences)."""
    if device == "cuda":
        return {"kda.gate": gate, "kda.recurrent": recurrent, "kda.chunked": chunked,
                "kda.fused_recurrent": fused_recurrent, "kda.fused_chunked": fused_chunked,
                "norm.l2norm": l2norm, "norm.gated_rms_norm": gated_rms_norm,
                "kda.gate+lower_bound": bounded_gate, "kda.fused_recurrent+lower_bound": bounded_fused_recurrent,
                "kda.fused_chunked+lower_bound": safe_gate_chunked}
    return {"kda.gate": naive_gate, "kda.recurrent": naive_recurrent, "kda.chunked": naive_chunked,
            "kda.gate+lower_bound": naive_bounded_gate}


def _quiet_import(module: str):
    """Import an fla module; on a machine without a GPU fla warns that Triton rolls back to CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(module)


def _chunk(chunk_size):
    if chunk_size not in CHUNK_SIZES:
        raise Unsupported(f"fla chunk_kda: chunk_size {chunk_size} (it takes 32 or 64)")
    return chunk_size


# -- the other direction (parity.watch): a call of fla's function, fitted to a record -----------------
# chunk_kda / fused_recurrent_kda compute one of three records, by their flags:
#   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel all False: the core op;
#   only the l2norm: the core op of l2norm(q), l2norm(k) (parity.ops.kda.variants(): ``+qk_l2norm``);
#   all three: the fused op (g is then g_raw, beta the beta logits, A_log and dt_bias given), of the
#   bounded gate (its ``+lower_bound`` record, b a scalar kwarg) when lower_bound is given. A core call's
#   safe_gate (the M = 16 path for gates the caller bounded) and lower_bound change no result.
_BEYOND = ("allow_neg_eigval", "state_v_first", "return_intermediate_states", "cp_context")
_WHY = "no registered op computes it (beta in (0, 2), a V-major state, context parallelism)"


def _kda_op(a: dict, core: str, fused: str) -> str:
    require_none(a, _BEYOND, _WHY)
    flag(a, "safe_gate")
    l2, gate_, sig = (flag(a, n) for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                           "use_beta_sigmoid_in_kernel"))
    if gate_ and sig and l2:
        bounded = a.get("lower_bound") is not None
        for n in ("dt_bias",) if bounded else ("A_log", "dt_bias"):
            if a.get(n) is None:
                raise Mismatch(n, "None with use_gate_in_kernel=True: the fused gate needs it")
        return fused + ("+lower_bound" if bounded else "")
    if a.get("safe_gate") and a.get("lower_bound") is None and gate_:
        raise Mismatch("lower_bound", "None with safe_gate=True and use_gate_in_kernel=True")
    if gate_ or sig:
        name = "use_beta_sigmoid_in_kernel" if gate_ and not sig else \
            "use_gate_in_kernel" if sig and not gate_ else "use_qk_l2norm_in_kernel"
        value = {"use_qk_l2norm_in_kernel": l2, "use_gate_in_kernel": gate_, "use_beta_sigmoid_in_kernel": sig}[name]
        raise Mismatch(name, f"{value} with use_qk_l2norm_in_kernel={l2}, use_gate_in_kernel={gate_}, "
                             f"use_beta_sigmoid_in_kernel={sig}: a record fuses the gate and the beta sigmoid "
                             "only together, with the l2norm")
    return core + ("+qk_l2norm" if l2 else "")


def _kda_mapping(a: dict, op: str, contract: str, **scalars):
    fused = "fused" in op
    inputs = {"q": a["q"], "k": a["k"], "v": a["v"]}
    if fused:
        inputs.update(g_raw=a["g"], beta_logits=a["beta"], A_log=a["A_log"], dt_bias=a["dt_bias"])
    else:
        inputs.update(g=a["g"], beta=a["beta"])
    inputs.update(initial_state=a.get("initial_state"), cu_seqlens=a.get("cu_seqlens"))
    names = ("o", "final_state") if a.get("output_final_state") else ("o",)
    note = {True: "q/k l2norm, gate and beta sigmoid fused in the kernel"}.get(fused) or \
        ("q/k l2norm fused in the kernel" if op.endswith("+qk_l2norm") else "")
    if op.endswith("+lower_bound"):
        scalars["lower_bound"] = float(a["lower_bound"])
        note += f"; the bounded gate, lower_bound {a['lower_bound']}" + ("" if a.get("A_log") is not None else
                                                                         ", no A_log")
        if a.get("safe_gate"):
            note += " (safe_gate)"
    elif a.get("safe_gate"):
        note += ("; " if note else "") + "safe_gate (the gates given, bounded by the caller)"
    return Mapping(op, inputs, {"scale": a.get("scale"), **scalars}, returned(*names), contract, note)


def chunk_kda_reverse(a: dict):
    """A call of ``fla.ops.kda.chunk_kda``: kda.chunked, kda.chunked+qk_l2norm or kda.fused_chunked."""
    op = _kda_op(a, "kda.chunked", "kda.fused_chunked")
    return _kda_mapping(a, op, "tf32", chunk_size=int(a.get("chunk_size", 64)))


def fused_recurrent_kda_reverse(a: dict):
    """A call of ``fla.ops.kda.fused_recurrent_kda``: kda.recurrent(+qk_l2norm) or kda.fused_recurrent."""
    return _kda_mapping(a, _kda_op(a, "kda.recurrent", "kda.fused_recurrent"), "ieee")


def naive_chunk_kda_reverse(a: dict):
    """A call of fla's torch ``naive_chunk_kda``: kda.chunked."""
    return _kda_mapping(a, "kda.chunked", "ieee", chunk_size=int(a.get("chunk_size", 64)))


def naive_recurrent_kda_reverse(a: dict):
    """A call of fla's torch ``naive_recurrent_kda``: kda.recurrent."""
    return _kda_mapping(a, "kda.recurrent", "ieee")


# -- CUDA: fla's Triton kernels ---------------------------------------------------------------------
@adapter(contract="ieee", wraps="fla.ops.kda.gate:fused_kda_gate")
def gate(g_raw, A_log, dt_bias):
    return _quiet_import("fla.ops.kda.gate").fused_kda_gate(g_raw, A_log, dt_bias)


@adapter(contract="ieee", wraps="fla.ops.kda:fused_recurrent_kda", reverse=fused_recurrent_kda_reverse)
def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    return _quiet_import("fla.ops.kda").fused_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens)


@adapter(contract="ieee", wraps="fla.ops.kda:fused_recurrent_kda", reverse=fused_recurrent_kda_reverse)
def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                    cu_seqlens=None):
    return _quiet_import("fla.ops.kda").fused_recurrent_kda(
        q, k, v, g_raw, beta_logits, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)


@adapter(contract="tf32", wraps="fla.ops.kda:chunk_kda", reverse=chunk_kda_reverse)
def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    return _quiet_import("fla.ops.kda").chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, chunk_size=_chunk(chunk_size))


@adapter(contract="tf32", wraps="fla.ops.kda:chunk_kda", reverse=chunk_kda_reverse)
def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64):
    return _quiet_import("fla.ops.kda").chunk_kda(
        q, k, v, g_raw, beta_logits, scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=_chunk(chunk_size))


# -- CUDA: the bounded gate (fla's safe-gate path). Called without lower_bound (a mutant that drops it),
# the same kernels compute the softplus gate.
@adapter(contract="ieee", wraps="fla.ops.kda.gate:fused_kda_gate")
def bounded_gate(g_raw, A_log, dt_bias, *, lower_bound=None):
    return _quiet_import("fla.ops.kda.gate").fused_kda_gate(g_raw, A_log, dt_bias, lower_bound=lower_bound)


@adapter(contract="ieee", wraps="fla.ops.kda:fused_recurrent_kda", reverse=fused_recurrent_kda_reverse)
def bounded_fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                            cu_seqlens=None, lower_bound=None):
    return _quiet_import("fla.ops.kda").fused_recurrent_kda(
        q, k, v, g_raw, beta_logits, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, cu_seqlens=cu_seqlens)


@adapter(contract="tf32", wraps="fla.ops.kda:chunk_kda", reverse=chunk_kda_reverse)
def safe_gate_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                      cu_seqlens=None, chunk_size=64, lower_bound=None):
    return _quiet_import("fla.ops.kda").chunk_kda(
        q, k, v, g_raw, beta_logits, scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, safe_gate=lower_bound is not None, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens, chunk_size=_chunk(chunk_size))


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


@adapter(contract="ieee", wraps="fla.ops.kda.naive:naive_recurrent_kda", reverse=naive_recurrent_kda_reverse)
def naive_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    fn = _quiet_import("fla.ops.kda.naive").naive_recurrent_kda

    def run(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)

    return _each_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens)


@adapter(contract="ieee", wraps="fla.ops.kda.naive:naive_chunk_kda", reverse=naive_chunk_kda_reverse)
def naive_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    fn = _quiet_import("fla.ops.kda.naive").naive_chunk_kda

    def run(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                  chunk_size=chunk_size)

    return _each_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens, multiple=chunk_size)


@adapter(contract="ieee", wraps="fla.ops.kda.gate:naive_kda_gate")
def naive_gate(g_raw, A_log, dt_bias):
    return _quiet_import("fla.ops.kda.gate").naive_kda_gate(g_raw, A_log, dt_bias)


@adapter(contract="ieee", wraps="fla.ops.kda.gate:naive_kda_lowerbound_gate")
def naive_bounded_gate(g_raw, A_log, dt_bias, *, lower_bound=None):
    gate = _quiet_import("fla.ops.kda.gate")
    if lower_bound is None:   # the softplus gate (a mutant's call): fla's naive softplus gate
        return gate.naive_kda_gate(g_raw, A_log, dt_bias)
    return gate.naive_kda_lowerbound_gate(g_raw, A_log, dt_bias, lower_bound=lower_bound)
