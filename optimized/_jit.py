"""``jit``: the ``@triton.jit`` of optimized/'s kernels, whose backend is settled when a kernel
launches rather than when it is defined, so that importing optimized chooses nothing. A launch
before any ``optimized.use(device)`` takes the default (a GPU when torch sees one, else the Triton
interpreter); under the interpreter the kernel runs interpreted even though it was defined before
``TRITON_INTERPRET`` was set (``_interpreter._interpret_jit_functions``). On a GPU it is
``triton.jit``'s ``JITFunction``: the compiler sees the same object, and a launch costs one check
more.

Every launch asks for floating-point fusion (``a * b + c`` as one FMA) unless it names its own
choice: the kernels were certified with it, Triton's default through 3.9, and Triton 3.10 turns the
default off (3.9 warns), which would change the GPU's bits under every certificate. The interpreter
drops the option."""
from __future__ import annotations

from triton.runtime.jit import JITFunction

from . import _interpreter


FP_FUSION = True  # what the certificates were made with (module docstring)


class Kernel(JITFunction):
    """A ``JITFunction`` that settles the backend at its first launch (:func:`_interpreter.settle`)."""

    def run(self, *args, grid, warmup, **kwargs):
        _interpreter.settle()
        kwargs.setdefault("enable_fp_fusion", FP_FUSION)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)


def jit(fn) -> Kernel:
    """``@jit`` in place of ``@triton.jit`` (a kernel, or a device function the kernels call)."""
    return Kernel(fn)
