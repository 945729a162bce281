"""Launch configurations: each kernel family keeps a small frozen dataclass of its launch settings
(tile sizes, warps, stages) beside its kernels, with today's tuned values or a documented heuristic
as defaults. An op takes one through ``launch=`` (benchmarks and tuning tools pass their own);
no module global is read or written. Settings documented as bit-neutral change the speed only; the
others are part of a reduction order, and a new default for them is re-certified
(``parity certify --device cuda``)."""
from __future__ import annotations

import functools

import torch


def resolve(op: str, launch, default):
    """``launch`` when given (it must be of ``default``'s class), else ``default``."""
    if launch is None:
        return default
    if type(launch) is not type(default):
        cls = type(default)
        raise TypeError(f"{op}: launch: expected {cls.__qualname__} ({cls.__module__}), "
                        f"got {type(launch).__name__}")
    return launch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (1 elsewhere: the interpreter runs one program
    at a time), for heuristics that size a grid against the GPU."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    # cached: a launch asks on every call, and torch's query costs microseconds of host time
    return torch.cuda.get_device_properties(index).multi_processor_count
