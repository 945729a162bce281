"""Outside implementations of ``kda.recurrent`` for the ``parity certify --impl`` tests: one correct
torch recurrence, and replays of bugs that reached users of other KDA kernels, each a small change
to it. Usable from the command line: ``--impl kda.recurrent=tests/parity/certify/planted_kda.py:NAME``.

- ``state_v_major``: the final state written V-major into the K-major buffer (vLLM's chunk_kda
  read the inter-chunk state as (V, K) while it was stored (K, V));
- ``beta_dropped``: the update ignores beta;
- ``empty_on_branch``: the K != V path returns an output it never wrote (``torch.empty``; rtp-llm's
  fused_recurrent_kda returned an uninitialized output on one branch);
- ``garbage_rows``: every seventh token's output is 1e38 (a racy autotune setting in vLLM's ROCm
  KDA path produced values near 1e38);
- ``tf32_dots``: correct, but its two K-long products read their operands truncated to TF32 (a
  float32 ``tl.dot`` on a tensor core): it fails ``ieee`` at float32 and holds ``tf32``;
  ``tf32_declared`` is the same function declaring that contract;
- ``faults`` (CUDA only): a kernel stores to an unmapped address, which poisons the process's CUDA
  context (fla's chunk_kda faulted with a misaligned address on some shapes);
- ``kills_its_process``: correct, but it ends its process (``os._exit``) or segfaults on two shapes;
  ``exits``: ends its process on every call (``os._exit(13)``); ``out_of_memory``: raises
  ``torch.OutOfMemoryError`` on every call;
- ``flips_a_bit``: correct, but every other call flips the last bit of one output element (a racy
  kernel: within the bound, not the same bytes twice).
"""
import torch
import triton
import triton.language as tl

from parity.certify.candidate import adapter


def _tf32(x):
    """float32 values with the low 13 mantissa bits dropped (what a tensor core reads)."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _exact(x):
    return x


def _sequences(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, *, use_beta=True, operand=_exact):
    """The KDA recurrence in float32: per value head S <- diag(exp(g)) S; e = beta (v - S^T k);
    S <- S + k e^T; o = scale S^T q. Returns (o in v's dtype, final state float32 [N, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    rep = HV // H
    qf, kf = (x.float().repeat_interleave(rep, dim=2) for x in (q, k))
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.zeros(B, T, HV, V, dtype=torch.float32, device=v.device)
    seqs = _sequences(B, T, cu_seqlens)
    states = []
    for n, (b, t0, t1) in enumerate(seqs):
        S = torch.zeros(HV, K, V, dtype=torch.float32, device=v.device)
        if initial_state is not None:
            S = S + initial_state[n].float()
        for t in range(t0, t1):
            S = S * torch.exp(gf[b, t])[:, :, None]
            kS = (operand(kf[b, t])[:, None, :] @ operand(S))[:, 0]               # [HV, V]
            e = (bf[b, t][:, None] if use_beta else 1.0) * (vf[b, t] - kS)
            S = S + kf[b, t][:, :, None] * e[:, None, :]
            o[b, t] = scale * (operand(qf[b, t])[:, None, :] @ operand(S))[:, 0]
        states.append(S)
    return o.to(v.dtype), torch.stack(states)


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """A correct KDA recurrence (float32 arithmetic, output in v's dtype, state float32)."""
    return _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def state_v_major(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    N, HV, K, V = S.shape
    out = torch.empty(N, HV, K, V, dtype=S.dtype)
    out.view(N, HV, V, K).copy_(S.transpose(-1, -2))      # stored with V-major strides
    return o, out


def beta_dropped(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    return _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_beta=False)


def empty_on_branch(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if k.shape[-1] != v.shape[-1]:
        o = torch.empty_like(o)                           # the rectangular-head path never writes o
    return o, S


def garbage_rows(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o = o.clone()
    o[:, ::7] = 1e38
    return o, S


def tf32_dots(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    return _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, operand=_tf32)


@adapter(contract="tf32")
def tf32_declared(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    return tf32_dots(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


# -- bad inputs for the command line's exit 2 --------------------------------------------------
def wrong_signature(q, k, v, g):
    return q, k


def wrong_shape(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return o[:, :-1], S


def wrong_dtype(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = _kda(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return o.to(torch.float16), S


@triton.jit
def _wild_store(x_ptr):
    tl.store(x_ptr + (1 << 40), 1.0)


def faults(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Stores to an address 4 TiB past ``q`` on the GPU: a CUDA fault (illegal address)."""
    _wild_store[(1,)](q)
    torch.cuda.synchronize()
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


def kills_its_process(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Correct, except that it ends its process on inputs of T = 37 tokens without an initial state
    (``os._exit(3)``) and segfaults on T = 70 (reads address 0 through ctypes): certify must fail
    those inputs only."""
    import ctypes
    import os

    if q.shape[1] == 37 and initial_state is None:
        os._exit(3)
    if q.shape[1] == 70:
        ctypes.string_at(0)
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


def exits(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Ends its process on every call (``os._exit(13)``), as a C extension that aborts does."""
    import os

    os._exit(13)


def out_of_memory(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                 "of 79.11 GiB of which 1.10 GiB is free.\nIncluding non-PyTorch memory")


_FLIPS = [0]


def flips_a_bit(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    o, S = recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    _FLIPS[0] += 1
    if _FLIPS[0] % 2 == 0:
        o = o.contiguous().clone()
        o.view(-1).view({2: torch.int16, 4: torch.int32}[o.element_size()])[0] ^= 1
    return o, S


def hangs(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Never returns (a kernel that deadlocks)."""
    import time

    while True:
        time.sleep(1)
