"""Dtype policy shared by the op families: which dtype the kernels compute in.

Compute dtype: bf16/fp16 and fp32 inputs compute in float32, float64 inputs in float64 (Triton runs
fp64 arithmetic, reductions and ``tl.dot`` on the H200 and in the interpreter). Outputs are cast once,
at the end, to the op's output dtype. The argument checks and the TF32 guard: optimized/_checks.py.
"""
from __future__ import annotations

import torch
import triton.language as tl


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch dtype the kernels compute in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_compute_dtype(dtype: torch.dtype):
    """Triton dtype the kernels compute in for inputs of ``dtype`` (passed as a constexpr)."""
    return tl.float64 if dtype == torch.float64 else tl.float32
