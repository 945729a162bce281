"""Outside implementations fitted to the registered op signatures (docs/ARCHITECTURE.md): fla-core
0.6.0's KDA (the kernels vLLM vendors). Nothing here is fla's code; these only call it.

On CUDA: ``fused_recurrent_kda`` for ``kda.recurrent`` (gate, l2norm and beta sigmoid off) and
``kda.fused_recurrent`` (all three in the kernel), ``chunk_kda`` for ``kda.chunked`` and
``kda.fused_chunked`` (chunk sizes 32 and 64 only: fla refuses others). On CPU (no Triton):
``fla.ops.kda.naive``'s torch recurrences for the core ops, one sequence at a time (they take no
``cu_seqlens``), the chunked one on each sequence padded with zero rows to a whole number of chunks
(it asserts ``T % chunk == 0``; a zero row has ``g = 0``, ``beta = 0``, ``k = 0``: it leaves the
state as it is and the earlier outputs alone, so the padding is exact).
"""
from __future__ import annotations

FLA_CHUNKS = {True: (32, 64), False: (16, 32, 64)}   # keyed by "on CUDA"


class Unsupported(Exception):
    """The implementation does not take this configuration (an fla chunk size of 16, say)."""


def _unsupported(msg):
    return Unsupported(msg)


def fla_kda(op: str, device: str):
    """fla's implementation of KDA op ``op`` (``kda.recurrent``, ``kda.chunked``,
    ``kda.fused_recurrent``, ``kda.fused_chunked``) on ``device``, with the registered signature."""
    import optimized  # noqa: F401  (fla imports triton: the interpreter must be chosen first on CPU)

    table = ({"kda.recurrent": recurrent, "kda.chunked": chunked, "kda.fused_recurrent": fused_recurrent,
              "kda.fused_chunked": fused_chunked} if device == "cuda" else
             {"kda.recurrent": naive_recurrent, "kda.chunked": naive_chunked})
    if op not in table:
        raise _unsupported(f"fla-core on {device}: no implementation of {op}")
    return table[op]


# -- CUDA: fla's Triton kernels ---------------------------------------------------------------------
def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=True, cu_seqlens=cu_seqlens)


def fused_recurrent(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                    cu_seqlens=None):
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(q, k, v, g_raw, beta_logits, A_log=A_log, dt_bias=dt_bias, scale=scale,
                               initial_state=initial_state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)


def _chunk_size(chunk_size):
    if chunk_size not in FLA_CHUNKS[True]:
        raise _unsupported(f"fla chunk_kda: chunk_size {chunk_size} (it takes 32 or 64)")
    return chunk_size


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                     cu_seqlens=cu_seqlens, chunk_size=_chunk_size(chunk_size))


def fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g_raw, beta_logits, scale=scale, initial_state=initial_state,
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                     chunk_size=_chunk_size(chunk_size))


# -- CPU: fla's torch recurrences -----------------------------------------------------------------
def _per_sequence(fn, q, k, v, g, beta, initial_state, cu_seqlens, pad_to=1):
    """``fn(q, k, v, g, beta, h0) -> (o, S)`` on each sequence (a batch row, or a ``cu_seqlens``
    segment), each padded with zero rows to a multiple of ``pad_to``."""
    import torch

    B, T = q.shape[:2]
    segs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    outs, states = [], []
    for n, (b, t0, t1) in enumerate(segs):
        pad = -(t1 - t0) % pad_to
        parts = [x[b:b + 1, t0:t1] for x in (q, k, v, g, beta)]
        parts = [torch.cat([x, x.new_zeros((1, pad, *x.shape[2:]))], dim=1) for x in parts]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, S = fn(*parts, h0)
        outs.append(o[:, :t1 - t0])
        states.append(S)
    o = torch.cat(outs, dim=1) if cu_seqlens is not None else torch.cat(outs, dim=0)
    return o, torch.cat(states, dim=0)


def naive_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    from fla.ops.kda.naive import naive_recurrent_kda

    def one(q, k, v, g, beta, h0):
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)

    return _per_sequence(one, q, k, v, g, beta, initial_state, cu_seqlens)


def naive_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    from fla.ops.kda.naive import naive_chunk_kda

    def one(q, k, v, g, beta, h0):
        return naive_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                               chunk_size=chunk_size)

    return _per_sequence(one, q, k, v, g, beta, initial_state, cu_seqlens, pad_to=chunk_size)
