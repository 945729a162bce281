"""Shared pieces of the KDA kernels: dtype policy, argument checks, varlen chunk plans, and the small
``@triton.jit`` device functions every KDA kernel uses (gate, sigmoid, l2norm, dot).

Dtype policy (all KDA kernels):

- inputs q, k, v in bf16, fp16, fp32 or fp64 (one dtype for the three);
- the *compute* dtype ``ACC`` is float32, or float64 for fp64 inputs: every load is widened to it,
  every ``tl.dot`` accumulates in it, recurrent states live in it;
- the *dot operand* dtype is the input dtype: bf16 runs feed bf16 tensor cores (fp32 accumulate),
  fp32 runs use ``input_precision="ieee"`` (never TF32), fp64 runs use fp64 ``tl.dot``.
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

from reference.checks import check_lower_bound

from .._jit import jit
from .._checks import FLOAT_DTYPES, check_shape  # noqa: F401  (check_shape: re-exported for chunk.py, recurrent.py)
from ..elementwise.kernels import sigmoid_f, softplus_f  # noqa: F401  (sigmoid_f: re-exported for gate.py)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute/state dtype for inputs of ``dtype``: float64 for fp64 runs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(op: str, name: str, t, ndim: int | None = None, letters: str = "") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name}: dtype {t.dtype} not supported (one of {FLOAT_DTYPES})")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name}: expected [{letters}] ({ndim} dims), got {tuple(t.shape)}")
    return t


def check_device(op: str, ref: torch.Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {ref.device} (the device of q)")


def check_qkv(op: str, q, k, v):
    """Validate ``q, k [B,T,H,K]``, ``v [B,T,HV,V]``; returns ``(B, T, H, HV, K, V)``."""
    check_tensor(op, "q", q, 4, "B,T,H,K")
    check_tensor(op, "k", k, 4, "B,T,H,K")
    check_tensor(op, "v", v, 4, "B,T,HV,V")
    B, T, H, K = q.shape
    check_shape(op, "k", k, q.shape, "[B,T,H,K]")
    if tuple(v.shape[:2]) != (B, T) or v.shape[2] == 0 or v.shape[2] % H != 0:
        raise ValueError(f"{op}: v: expected [B,T,HV,V] with B,T = {(B, T)} and HV a multiple of "
                         f"H = {H}, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V < 1 or K < 1:
        raise ValueError(f"{op}: K = {K}, V = {V}: K must be in [1, 256] (one key block per program)")
    check_device(op, q, k=k, v=v)
    return B, T, H, HV, K, V


def check_gate_params(op: str, A_log, dt_bias, HV: int, K: int, ref: torch.Tensor, lower_bound=None):
    """A_log: any shape with HV elements (checkpoint shape [1,1,HV,1] accepted), or None with a
    ``lower_bound`` (the bounded gate without A_log); dt_bias: HV*K; lower_bound: None (the softplus
    gate) or a number in [-5, 0). Returns ``(A_log, dt_bias, lower_bound)``."""
    lower_bound = check_bound(op, lower_bound)
    if A_log is None and lower_bound is None:
        raise ValueError(f"{op}: A_log: None is the bounded gate's form only (give lower_bound, or A_log)")
    if A_log is not None:
        check_tensor(op, "A_log", A_log)
        if A_log.numel() != HV:
            raise ValueError(f"{op}: A_log: expected [HV] = ({HV},), got {tuple(A_log.shape)}")
    check_tensor(op, "dt_bias", dt_bias)
    if dt_bias.numel() != HV * K:
        raise ValueError(f"{op}: dt_bias: expected [HV*K] = ({HV * K},), got {tuple(dt_bias.shape)}")
    check_device(op, ref, A_log=A_log, dt_bias=dt_bias)
    A_log = None if A_log is None else A_log.reshape(HV).contiguous()
    return A_log, dt_bias.reshape(HV * K).contiguous(), lower_bound


def check_bound(op: str, lower_bound):
    """``lower_bound`` as a float in [-5, 0), or None (the softplus gate); the error names ``op``."""
    try:
        return check_lower_bound(lower_bound)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def bound_exact(lower_bound, acc: torch.dtype) -> bool:
    """The kernels' ``B_EXACT`` constexpr: the bounded gate's ``lower_bound`` is exact in the compute
    dtype ``acc`` (-5, -4.5, ...; then ``b * sigmoid(z)`` is formed in ``acc``,
    :func:`bounded_gate_f`)."""
    if lower_bound is None:
        return False
    # fp64 holds every bound the checks accept; fp32 those that survive a round trip through it
    return acc == torch.float64 or float(np.float32(lower_bound)) == lower_bound


def gate_kind(lower_bound) -> int:
    """The kernels' ``GATE`` constexpr: 0 for the softplus gate (``lower_bound`` None), 1 bounded."""
    return 0 if lower_bound is None else 1


def prepare_state(op: str, initial_state, N: int, HV: int, K: int, V: int, acc, ref, varlen: bool):
    """Initial state as a contiguous ``acc``-dtype tensor [N,HV,K,V] (a copy only when needed)."""
    if initial_state is None:
        return None
    check_tensor(op, "initial_state", initial_state)
    check_shape(op, "initial_state", initial_state, (N, HV, K, V), "[N,HV,K,V]" if varlen else "[B,HV,K,V]")
    check_device(op, ref, initial_state=initial_state)
    return initial_state.to(acc).contiguous()


def prepare_cu_seqlens(op: str, cu_seqlens, B: int, T: int, device):
    """``cu_seqlens`` as an int32 tensor on ``device``; returns ``(cu, N)``.

    Validated in full (0 .. T, non-decreasing) when given on the host (list or CPU tensor); a device
    tensor is trusted, because validating it would cost a host sync in the hot path.
    """
    if B != 1:
        raise ValueError(f"{op}: cu_seqlens: requires B == 1, got B = {B}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"{op}: cu_seqlens: expected a 1-D integer tensor [N+1], got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        host = cu_seqlens.device.type == "cpu"
        cu = cu_seqlens
    else:
        host = True
        cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64)
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens: expected [N+1] ints, got {cu_seqlens!r}")
    if host:
        c = cu.to(torch.int64)
        if int(c[0]) != 0 or int(c[-1]) != T or bool((c[1:] < c[:-1]).any()):
            raise ValueError(f"{op}: cu_seqlens: expected non-decreasing ints from 0 to T = {T}, "
                             f"got {c.tolist()}")
    return cu.to(device=device, dtype=torch.int32).contiguous(), cu.numel() - 1


def varlen_chunk_plan(cu: torch.Tensor, N: int, T: int, BT: int):
    """Chunk table for ``cu_seqlens`` without a host sync.

    Returns ``(cidx [UB, 2] int32, co [N+1] int32, UB)``: program ``p < UB`` handles chunk ``cidx[p, 1]``
    of sequence ``cidx[p, 0]`` (``-1``: nothing to do); ``co[n]`` is the global index of sequence
    ``n``'s first chunk, so program ``p``'s chunk has global index ``p``. ``UB = T // BT + N`` bounds
    ``sum_n ceil(len_n / BT)`` from above, so the grid size is known on the host.
    """
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    nch = (lens + BT - 1) // BT
    co = torch.zeros(N + 1, dtype=torch.int64, device=cu.device)
    co[1:] = torch.cumsum(nch, 0)
    UB = T // BT + N
    pid = torch.arange(UB, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(co[1:].contiguous(), pid, right=True)
    local = pid - co[seq.clamp(max=N - 1)]
    seq = torch.where(seq < N, seq, torch.full_like(seq, -1))
    cidx = torch.stack([seq, local], 1).to(torch.int32).contiguous()
    return cidx, co.to(torch.int32), UB


def cdiv(a: int, b: int) -> int:
    """Plain-Python ceil division (``triton.cdiv`` is a jit-wrapped function, whose call overhead
    would land in the host's hot path of a decode step)."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def block_k(K: int) -> int:
    return max(16, next_pow2(K))


# ------------------------------------------------------------------------------------------------
# device functions (inputs and results in the compute dtype)

# ``tl.reduce(x, axis, SUM)`` is ``tl.sum(x, axis)`` for float32/float64 ``x`` (tl.sum is this reduce
# after a no-op dtype pick). Kernels call it directly in their loops: under the Triton interpreter
# every call of a ``@triton.jit`` function (tl.sum is one) re-patches triton.language, while
# the interpreter maps a reduce with this combine function straight to ``np.sum``. Same code on GPU.
SUM = tl.standard._sum_combine


@jit
def chunk_span(cu, cidx, i_c, i_b, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Grid chunk ``i_c`` (batch row ``i_b`` when not varlen): ``(t0, eos, i_n)``, the row of its
    first token, the end row of its sequence, and its sequence; ``i_n < 0``: a padding entry of the
    varlen chunk plan (``varlen_chunk_plan``), for which the caller returns."""
    if IS_VARLEN:
        i_n = tl.load(cidx + 2 * i_c)
        local = tl.load(cidx + 2 * i_c + 1)
        n = tl.maximum(i_n, 0)
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
    else:
        i_n = i_b
        local = i_c
        bos = i_b.to(tl.int64) * T
        eos = bos + T
    return bos + local * BT, eos, i_n


@jit
def exp_normal(x, FTZ: tl.constexpr):
    """``exp(x)`` of an fp32 tile whose results are all normal (or inf, NaN): with ``FTZ``,
    ``ex2.approx.ftz.f32`` of ``x log2(e)``, the instruction and the product ``tl.exp`` compiles to,
    without the range test and two scalings that keep subnormal results (about three instructions an
    element, in a kernel of a few hundred exps); the same bits wherever ``exp(x)`` is normal. Else
    (other dtypes, the interpreter, which runs no inline PTX) ``tl.exp``."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.exp(x)


@jit
def kda_gate_f(x, a, bias):
    """``g = -a * softplus(x + bias)`` with ``a = exp(A_log)`` (log-space decay, <= 0)."""
    return -a * softplus_f(x + bias, 20.0)  # torch's threshold (spec b.1)


@jit
def bounded_gate_f(z, b, ACC: tl.constexpr, B_EXACT: tl.constexpr = False):
    """``g = b * sigmoid(z)`` with ``z = exp(A_log) * (g_raw + dt_bias)`` (or without the factor):
    the bounded gate, in (b, 0) for ``b < 0``. ``b`` is the kernel's fp64 scalar argument: the
    product is rounded once, to ACC. ``B_EXACT`` (b exact in ACC, :func:`bound_exact`): the product
    is formed in ACC, the same rounding (a product of two ACC numbers is exact in fp64) without a
    conversion to fp64 and back per element."""
    if B_EXACT:
        return tl.cast(b, ACC) * sigmoid_f(z)
    return (b * sigmoid_f(z)).to(ACC)


@jit
def l2norm_rows(x):
    """``x * (1 / sqrt(sum(x^2) + 1e-6))`` per row of a [R, BK] tile (masked lanes hold 0): one
    division per row, not per element (a reciprocal and BK multiplies per row in the blocks
    kernel's load path; docs/BENCHMARKS.md, "KDA against fla-core"), the form the bound's l2norm
    model assumes."""
    return x * (1.0 / tl.sqrt(tl.reduce(x * x, 1, SUM) + 1e-6))[:, None]


@jit
def l2norm_cols(x):
    """:func:`l2norm_rows` per column of a [BK, C] tile."""
    return x * (1.0 / tl.sqrt(tl.reduce(x * x, 0, SUM) + 1e-6))[None, :]


@jit
def dot(a, b, DT: tl.constexpr, ACC: tl.constexpr):
    """``a @ b`` with both operands cast to ``DT`` (the input dtype) and accumulated in ``ACC``.
    ``ieee``: fp32 operands are never rounded to TF32 (ignored for bf16/fp16/fp64 operands)."""
    return tl.dot(a.to(DT), b.to(DT), input_precision="ieee", out_dtype=ACC)


@jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A state block's indices: ``(dk, mk, dv, mv, mkv, kv_off)``, its K rows and V block ``i_v``'s
    columns with their masks, and the elements' offsets in a [K, V] state."""
    dk = tl.arange(0, BK)
    mk = dk < K
    dv = i_v * BV + tl.arange(0, BV)
    mv = dv < V
    return dk, mk, dv, mv, mk[:, None] & mv[None, :], dk[:, None] * V + dv[None, :]


@jit
def start_state(h0, i_nh, kv_off, mkv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr):
    """``[BK, BV]``, ACC: the state a state pass starts from (row ``i_nh`` of h0's [*, K, V] blocks,
    or zeros)."""
    if HAS_H0:
        S = tl.load(h0 + i_nh.to(tl.int64) * K * V + kv_off, mask=mkv, other=0.0).to(ACC)
    else:
        S = tl.zeros([BK, BV], dtype=ACC)
    return S
