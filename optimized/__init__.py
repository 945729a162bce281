"""Optimized Kimi-Linear: Triton kernels (torch for plain GEMMs) and the bf16 model.

Importing it chooses nothing. Where the kernels run is chosen by :func:`use` (``optimized.use(device)``),
which every entry point calls with its device: compiled for a GPU, or on the CPU under the Triton
interpreter made faithful (``_interpreter.py``: bf16 dots and casts as a GPU computes them); a kernel
launched before any choice takes the default, a GPU when torch sees one. ``backend_info()`` reports
what ran.
"""
from __future__ import annotations

import torch
import triton

from ._interpreter import (ensure_faithful, install_faithful_bf16_dot, interpreting,  # noqa: F401
                           interpreter_is_faithful, select, use)
from .model import load

__all__ = ["use", "load", "backend_info", "interpreting", "interpreter_is_faithful"]


def backend_info() -> dict:
    """What runs the kernels: for reports."""
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "triton_interpreter": interpreting(),
        "faithful_bf16_dot": interpreter_is_faithful(),
    }
