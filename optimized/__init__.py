"""Optimized Kimi-Linear: Triton kernels (torch for plain GEMMs) and the bf16 model.

On a machine without CUDA the kernels run on CPU under the Triton interpreter. The interpreter is
selected by ``TRITON_INTERPRET=1`` at the time kernels are defined, so it is set here, before any
kernel module is imported, when no GPU is present (``_interpreter.select``, the one place that sets
it up; entry points that take a device call it with theirs); ``optimized.backend_info()`` reports
it. Under the interpreter the faithful bf16 dot and rounding (``_interpreter.py``) are put in force
there, so every entry point computes what a GPU computes (each family checks again as it defines its
kernels).
"""
from __future__ import annotations

import torch

from ._interpreter import (ensure_faithful, install_faithful_bf16_dot, interpreting,  # noqa: F401
                           interpreter_is_faithful, select)

select()


def load(path_or_source, **kwargs):
    """The optimized model (``optimized.model.load``; imported on first use, it pulls in every kernel)."""
    from .model import load as _load

    return _load(path_or_source, **kwargs)


def backend_info() -> dict:
    """What runs the kernels: for reports."""
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "triton_interpreter": interpreting(),
        "faithful_bf16_dot": interpreter_is_faithful(),
    }
