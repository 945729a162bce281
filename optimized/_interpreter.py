"""Running the Triton kernels on CPU under the Triton interpreter (``TRITON_INTERPRET=1``).

The trap: the interpreter (Triton 3.6 through 3.9 at least) stores bfloat16 tensors as their raw
uint16 bit patterns and computes ``tl.dot`` with ``np.matmul`` on those patterns, i.e. it multiplies
integers, not numbers. On a GPU a bf16 ``tl.dot`` multiplies the bf16 values exactly and accumulates
in float32. ``install_faithful_bf16_dot`` makes the interpreter do the same: it widens bf16 operands
to float32 (exact) before the matmul. Kernels are untouched; on a GPU nothing here runs.

This is installed explicitly by the test harness (``tests/conftest.py``) and by the parity CLI when it
runs kernels on CPU; ``interpreter_is_faithful()`` lets a report state it.
"""
from __future__ import annotations

import os

_INSTALLED = False


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (set before kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def install_faithful_bf16_dot() -> None:
    """Patch the interpreter's ``create_dot`` so bf16 operands are widened to float32 first."""
    global _INSTALLED
    if _INSTALLED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    builder_cls = _interp.InterpreterBuilder
    original = builder_cls.create_dot

    def _widen(handle):
        if handle.dtype.scalar == tl.bfloat16 or handle.dtype == tl.bfloat16:
            # bf16 bits are the top half of a float32: shifting them up is exact.
            bits = handle.data.astype(np.uint32) << np.uint32(16)
            return _interp.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
    _INSTALLED = True


def interpreter_is_faithful() -> bool:
    return _INSTALLED
