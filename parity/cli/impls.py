"""What ``parity certify`` and ``parity search`` both take from their arguments: the ops and dtypes,
and the device (the kernels' backend chosen for it). Their ``--impl`` values:
``parity.cli.certify.select_impls``."""
from __future__ import annotations

import torch

import optimized
from parity import ops
from parity.errors import InputError

DTYPES = ("bfloat16", "float32", "float64")


def select_runs(op_names, dtype_names) -> tuple[list, tuple]:
    """``(records, dtypes)`` of ``--ops`` and ``--dtype`` (default float32 then bfloat16, repeats
    dropped); an unknown op is an ``InputError`` naming it."""
    try:
        records = ops.select(op_names)
    except KeyError as exc:
        raise InputError(str(exc.args[0])) from None
    return records, tuple(dict.fromkeys(dtype_names or ("float32", "bfloat16")))


def setup_device(device):
    """Choose the kernels' backend for ``device`` (``optimized.use``: on CPU the Triton interpreter,
    made faithful for bf16 dots)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)")
    return optimized.use(device)
