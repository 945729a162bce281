"""Causal depthwise short convolution + SiLU (spec b.5; KDA ``q/k/v_conv1d``) as Triton kernels.

Conventions (ARCHITECTURE.md): ``x [B, T, C]``; ``weight [C, W]`` (the checkpoint's ``[C, 1, W]`` is
accepted); tap ``weight[:, W-1]`` multiplies the current token. The state ``[B, C, W-1]`` holds the
last ``W-1`` **pre-conv** inputs, oldest first (zeros = no history). The state only ever holds copies
of inputs, so keeping it in x's dtype (or any wider float dtype) is exact; the final state takes the
dtype of ``initial_state`` (x's dtype when there is none).

``short_conv`` (prefill / chunked prefill), ``short_conv_step`` (one token, functional) and
``short_conv_step_`` (one token for a batch of sequences whose states live in a pool, updated in
place) accumulate every output in the same order, so they agree bit for bit however a sequence is cut.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import _counters, _launch, _pdl
from .._checks import check_float, check_same_device, check_shape
from ..elementwise._precision import tl_compute_dtype
from .kernels import _short_conv_kernel, _short_conv_step_kernel


__all__ = ["short_conv", "short_conv_step", "short_conv_step_"]

#: Channels per step-kernel program on a GPU. In a decode tile most rows are padding, whose
#: programs only write zeros, so a real row's channels are the work: 256 spread them over C / 256
#: programs (48 at the 48B model's C = 12288, where 1024 leaves 12 SMs to carry the row;
#: ``benchmarks/tune.py conv``, docs/BENCHMARKS.md, "Norms and conv").
STEP_BLOCK_C = 256


@dataclass(frozen=True)
class StepLaunch:
    """Launch settings of the decode step kernel (``short_conv_step``, ``short_conv_step_``). Each
    channel is computed alone, so they change neither a value nor its rounding.

    ``block_c``: channels per program; None: :data:`STEP_BLOCK_C` on a GPU, 1024 under the CPU
    interpreter (where a program costs its Python overhead, not its loads). ``num_warps``: 4.
    """
    block_c: int | None = None
    num_warps: int = 4


STEP_LAUNCH = StepLaunch()  # the defaults (frozen, so one instance serves every call)


def _weight(op: str, weight: torch.Tensor) -> torch.Tensor:
    check_float(op, "weight", weight)
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight: expected [C, W] or [C, 1, W], got {tuple(weight.shape)}")
    return weight.contiguous()


def _state(op: str, name: str, state: torch.Tensor, x: torch.Tensor, expected: tuple) -> torch.Tensor:
    check_float(op, name, state)
    check_shape(op, name, state, expected, "[B, C, W-1]" if len(expected) == 3 else "[slots, C, W-1]")
    if torch.finfo(state.dtype).bits < torch.finfo(x.dtype).bits or (
            state.dtype in (torch.float16, torch.bfloat16) and state.dtype != x.dtype):
        raise TypeError(f"{op}: {name}: dtype {state.dtype} cannot hold x's {x.dtype} values exactly")
    if state.stride(-1) != 1:
        raise ValueError(f"{op}: {name}: last dim must be contiguous, strides {state.stride()}")
    return state


def short_conv(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None = None):
    """Prefill (or continue) sequences: ``y = silu(causal depthwise conv(cat(state, x)))``.

    x: [B, T, C] (T >= 1); weight: [C, W] or [C, 1, W]; initial_state: [B, C, W-1] or None (zeros).
    Returns ``(y [B, T, C] in x's dtype, final_state [B, C, W-1])``; the final state is the last W-1
    inputs of ``cat(initial_state, x)`` along time (valid for any T, also T < W-1).
    """
    op = "conv.short_conv"
    _counters.record(op)
    check_float(op, "x", x)
    weight = _weight(op, weight)
    C, W = weight.shape
    if x.dim() != 3 or x.shape[2] != C:
        raise ValueError(f"{op}: x: expected [B, T, C] with C = {C} (weight), got {tuple(x.shape)}")
    B, T, _ = x.shape
    if T < 1:
        raise ValueError(f"{op}: x: T must be >= 1, got {tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    if initial_state is not None:
        _state(op, "initial_state", initial_state, x, (B, C, W - 1))
    check_same_device(op, x=x, weight=weight, initial_state=initial_state)
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    sdtype = initial_state.dtype if initial_state is not None else x.dtype
    final = torch.empty((B, C, W - 1), dtype=sdtype, device=x.device)
    s0 = initial_state if initial_state is not None else final  # dummy pointer when absent
    block_c = min(128, triton.next_power_of_2(C))
    block_t = min(64, triton.next_power_of_2(T))
    grid = (B, triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _short_conv_kernel[grid](
        x, weight, s0, y, final, T, C,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), s0.stride(0), s0.stride(1),
        final.stride(0), final.stride(1),
        W=W, HAS_STATE=initial_state is not None, CD=tl_compute_dtype(x.dtype),
        BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return y, final


def _step_launch(op, x, weight, state, out_state, slot_ids, launch):
    launch = _launch.resolve(op, launch, STEP_LAUNCH)
    C, W = weight.shape
    B = x.shape[0]
    y = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    if W == 1:
        raise ValueError(f"{op}: weight: W = 1 has no state; use short_conv")
    block_c = launch.block_c
    if block_c is None:
        block_c = STEP_BLOCK_C if x.device.type == "cuda" else 1024
    block_c = min(block_c, triton.next_power_of_2(C))
    pdl = _pdl.enabled(x.device)
    _short_conv_step_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, state, y, out_state, slot_ids if slot_ids is not None else x, C,
        x.stride(0), y.stride(0), state.stride(0), state.stride(1),
        out_state.stride(0), out_state.stride(1),
        W=W, INDEXED=slot_ids is not None, CD=tl_compute_dtype(x.dtype), BLOCK_C=block_c,
        PDL=pdl, launch_pdl=pdl, num_warps=launch.num_warps)
    return y


def _step_x(op: str, x: torch.Tensor, C: int) -> torch.Tensor:
    check_float(op, "x", x)
    if x.dim() != 2 or x.shape[1] != C:
        raise ValueError(f"{op}: x: expected [B, C] with C = {C} (weight), got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def short_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, *,
                    launch: StepLaunch | None = None):
    """One decode token: ``y = silu(sum_j weight[:, j] * cat(state, x)[:, :, j])``.

    x: [B, C]; weight: [C, W] or [C, 1, W]; state: [B, C, W-1] (oldest first); launch: a
    :class:`StepLaunch` (default: the tuned one).
    Returns ``(y [B, C], new_state [B, C, W-1])`` (a new tensor: state shifted left, x appended),
    bitwise equal to ``short_conv`` with T = 1.
    """
    op = "conv.short_conv_step"
    _counters.record(op)
    weight = _weight(op, weight)
    C, W = weight.shape
    x = _step_x(op, x, C)
    _state(op, "state", state, x, (x.shape[0], C, W - 1))
    check_same_device(op, x=x, weight=weight, state=state)
    new_state = torch.empty_like(state, memory_format=torch.contiguous_format)
    y = _step_launch(op, x, weight, state, new_state, None, launch)
    return y, new_state


def short_conv_step_(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                     slot_ids: torch.Tensor, *, launch: StepLaunch | None = None) -> torch.Tensor:
    """One decode token for B sequences whose states live in a pool, updated **in place**.

    x: [B, C]; weight: [C, W] or [C, 1, W]; state_pool: [slots, C, W-1]; slot_ids: [B] int32/int64,
    the pool row of each sequence. Only rows ``state_pool[slot_ids[b]]`` change (shifted left, x
    appended); every other row stays bit-identical. A negative slot id marks a padding row: its
    output row is 0 and no state is touched. Slot ids must be distinct and < slots (not checked on
    the device: checking would need a host sync). launch: as in :func:`short_conv_step`.
    Returns y [B, C].
    """
    op = "conv.short_conv_step_"
    _counters.record(op)
    weight = _weight(op, weight)
    C, W = weight.shape
    x = _step_x(op, x, C)
    if state_pool.dim() != 3:
        raise ValueError(f"{op}: state_pool: expected [slots, C, W-1], got {tuple(state_pool.shape)}")
    _state(op, "state_pool", state_pool, x, (state_pool.shape[0], C, W - 1))
    if slot_ids.dtype not in (torch.int32, torch.int64) or slot_ids.shape != (x.shape[0],):
        raise ValueError(f"{op}: slot_ids: expected [B] = ({x.shape[0]},) int32/int64, got "
                         f"{tuple(slot_ids.shape)} {slot_ids.dtype}")
    check_same_device(op, x=x, weight=weight, state_pool=state_pool, slot_ids=slot_ids)
    return _step_launch(op, x, weight, state_pool, state_pool, slot_ids.contiguous(), launch)
