"""What the platform running the kernels does with rounding, measured rather than assumed.

The stock Triton interpreter (3.6-3.9 at least) converts float32 to bfloat16 by truncation (round
toward zero: ``triton/runtime/interpreter.py`` ``cast_impl`` passes no rounding mode), while a GPU
rounds to nearest even; ``optimized._interpreter.install_faithful_bf16_dot`` now also makes those
casts round to nearest. Truncation errs by up to one ulp (2u) instead of half an ulp (u). The bound
models use the rounding the platform really has, found by :func:`store_rounding` with a
one-element kernel, and certificates state it.
"""
from __future__ import annotations

import functools

import torch
import triton.language as tl

from optimized import _interpreter
from optimized._interpreter import interpreting
from optimized._jit import jit

NEAREST = "nearest"
TOWARD_ZERO = "toward-zero"


def default_device(device: str | None = None) -> str:
    """``device``, or where the optimized kernels run by default: ``cuda`` on a machine with a GPU
    (compiled kernels), else ``cpu`` (the Triton interpreter, also where it was selected on a machine
    with a GPU: ``optimized.use("cpu")``)."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def store_rounding(dtype: str, device: str | None = None) -> str:
    """How a Triton kernel rounds a float32 value stored as ``dtype`` on ``device``: ``nearest`` or
    ``toward-zero``. float32/float64 runs are ``nearest`` (IEEE). Measured once per state of the
    interpreter's patches."""
    if dtype not in ("bfloat16", "float16"):
        return NEAREST
    return _probe_rounding(dtype, default_device(device), _interpreter.interpreter_is_faithful())


@functools.lru_cache(maxsize=None)
def _probe_rounding(dtype: str, device: str, patched: bool) -> str:
    @jit   # optimized's: the backend settled at launch, as for the kernels it measures
    def _probe(x_ptr, y_ptr):
        x = tl.load(x_ptr)
        tl.store(y_ptr, x.to(y_ptr.dtype.element_ty))

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    # halfway-and-a-bit above 1: nearest rounds up to 1 + 2^-p+1, truncation gives 1
    step = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    x = torch.tensor([1.0 + 0.75 * step, -(1.0 + 0.75 * step)], dtype=torch.float32, device=device)
    y = torch.empty(2, dtype=tdt, device=device)
    _probe[(1,)](x, y)
    y0 = float(y[0].float().cpu())
    return NEAREST if y0 == 1.0 + step else TOWARD_ZERO
