"""Dtype policy shared by the op families: which dtypes run, what they compute in, and the TF32 guard.

Compute dtype: bf16/fp16 and fp32 inputs compute in float32, float64 inputs in float64 (Triton runs
fp64 arithmetic, reductions and ``tl.dot`` on the H200 and in the interpreter). Outputs are cast once,
at the end, to the op's output dtype.

TF32: a float32 ``torch.matmul`` on CUDA silently uses TF32 (10-bit mantissa) when
``torch.backends.cuda.matmul.allow_tf32`` is True or ``torch.set_float32_matmul_precision`` is
"high"/"medium". That would void the lifted (fp32) certification, so every op that calls a torch GEMM
on float32 operands calls :func:`require_ieee_fp32_matmul` first: it *asserts* the settings (raising a
``RuntimeError`` that names the setting) instead of flipping global state behind the caller's back.
Triton ``tl.dot`` calls with fp32 operands pass ``input_precision="ieee"`` for the same reason.
"""
from __future__ import annotations

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch dtype the kernels compute in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_compute_dtype(dtype: torch.dtype):
    """Triton dtype the kernels compute in for inputs of ``dtype`` (passed as a constexpr)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name}: dtype {t.dtype} not supported (one of {FLOAT_DTYPES})")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t.shape == expected``."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name}: expected {what} = {tuple(expected)}, got {tuple(t.shape)}")


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


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: tensors on different devices: {devices}")


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


_ROUNDS_TO_NEAREST: dict[str, bool] = {}


def triton_bf16_cast_rounds_to_nearest(device: str | torch.device | None = None) -> bool:
    """Probe (once per device type) whether Triton's float32 -> bfloat16 cast rounds to nearest.

    Compiled Triton does (``cvt.rn.bf16.f32``). The Triton interpreter (3.6-3.9 at least) truncates
    unless ``optimized._interpreter`` patches it, so a test's bound for an in-kernel bf16 rounding is
    ``u`` on a GPU and a full ulp (``2u``) under an unpatched interpreter. Tests ask this instead of
    assuming either.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    key = torch.device(device).type
    if key not in _ROUNDS_TO_NEAREST:
        from .kernels import _cast_probe_kernel

        x = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -10], dtype=torch.float32, device=device)
        y = torch.empty(1, dtype=torch.bfloat16, device=device)
        _cast_probe_kernel[(1,)](x, y)
        _ROUNDS_TO_NEAREST[key] = bool(y.item() == 1.0 + 2.0 ** -7)
    return _ROUNDS_TO_NEAREST[key]
