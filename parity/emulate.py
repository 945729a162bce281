"""Float evaluations of every op in torch: the ``reference-f32`` stand-in candidate and the engine
of the internal mutants. Each op family's are its ``emulate`` module
(``parity/ops/<family>/emulate.py``); this module has what they share.

Each function has the optimized op's signature and contract (torch tensors in, the inputs' dtype
out, states float32 in bf16/fp16 runs) and computes in float32 (float64 for float64 inputs), i.e.
"the reference evaluated at float32 arithmetic, inputs and outputs at the candidate's dtype".
``mutation=`` (keyword, default None) switches on a named semantic bug inside the evaluation; the
registry's internal mutants use it (parity/mutants.py). No Triton, no counters: a report that used
these says so (candidate ``reference-f32``).
"""
import torch

from .bounds.core import dtype_name

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (any spelling ``bounds.core.dtype_name`` takes)."""
    return TORCH_DTYPES[dtype_name(name)]


def cdt(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype for inputs of ``dtype``, which is also the dtype states are returned in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_mutation(op: str, mutation, allowed: tuple) -> None:
    if mutation is not None and mutation not in allowed:
        raise ValueError(f"{op}: unknown mutation {mutation!r} (known: {allowed})")
