"""Argument checks shared by the op families: one-line errors that name the op, the argument, what
was expected and what came (``ValueError`` for shapes and buffers, ``TypeError`` for types), and the
TF32 guard.

TF32: a float32 ``torch.matmul`` on CUDA silently uses TF32 (10-bit mantissa) when
``torch.backends.cuda.matmul.allow_tf32`` is True or ``torch.set_float32_matmul_precision`` is
"high"/"medium". That would void the lifted (fp32) certification, so every op that calls a torch GEMM
on float32 operands calls :func:`require_ieee_fp32_matmul` first: it *asserts* the settings (raising a
``RuntimeError`` that names the setting) instead of flipping global state behind the caller's back.
Triton ``tl.dot`` calls with fp32 operands pass ``input_precision="ieee"`` for the same reason.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    """``TypeError`` naming ``name`` unless ``t`` is a tensor of a float dtype the kernels run."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name}: dtype {t.dtype} not supported (one of {FLOAT_DTYPES})")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    """``ValueError`` naming ``name`` unless ``t.shape == expected``; ``what`` says it in shape
    letters (``"[B,T,HV,K]"``) or words (``"the shape of x"``)."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name}: expected {what} = {tuple(expected)}, got {tuple(t.shape)}")


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: tensors on different devices: {devices}")


def out_or_new(op: str, out, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """``out`` (an optional output buffer: e.g. the first rows of a padded decode tile) checked to
    be a contiguous ``shape`` tensor of like's dtype on like's device, or a new one like that;
    ``ValueError`` naming ``out`` otherwise."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != like.dtype
            or out.device != like.device or not out.is_contiguous()):
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
               + ("" if out.is_contiguous() else " (not contiguous)")
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"{op}: out: expected a contiguous {tuple(shape)} {like.dtype} tensor on "
                         f"{like.device}, got {got}")
    return out


def require_ieee_fp32_matmul(op: str, *tensors: torch.Tensor) -> None:
    """Refuse to run a float32 torch GEMM that could use TF32.

    Requires ``torch.backends.cuda.matmul.allow_tf32 is False`` (torch's default) and
    ``torch.get_float32_matmul_precision() == "highest"`` (also the default) whenever any operand is
    float32. bf16 and fp64 GEMMs are unaffected (bf16 GEMMs accumulate in fp32 on every backend used).
    """
    if not any(t.dtype == torch.float32 for t in tensors):
        return
    tf32, precision = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    if tf32 or precision != "highest":
        raise RuntimeError(
            f"{op}: a float32 GEMM would run in TF32: torch.backends.cuda.matmul.allow_tf32 = {tf32}, "
            f"torch.get_float32_matmul_precision() = {precision!r}; float32 (lifted) runs need the "
            "defaults (False, 'highest')")
