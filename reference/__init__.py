"""Float64 reference of Kimi-Linear: every op and the full model, written once against the array
API standard and run on NumPy (default) or torch float64 on a CPU or GPU (``reference.executor``).
Imports numpy and array-api-compat only (plus ``kimi``, the model's files it reads, and
threadpoolctl to hold BLAS at one thread inside the streamed products); torch only
when a torch executor is asked for (``reference.load(src, device="cuda")``); never triton.

``reference.load``, the cache classes and the weight sources (``kimi``'s) are imported lazily on
first use, so ``import reference`` stays cheap and does not pull in the model."""
import importlib

from kimi.config import PRESETS, ConfigError, KimiConfig

_LAZY = {
    "load": ".model", "Model": ".model", "ModelCache": ".cache", "KDACache": ".cache", "MLACache": ".cache",
    "open_source": "kimi.checkpoint", "save_checkpoint": "kimi.checkpoint", "WeightSource": "kimi.checkpoint",
    "CheckpointError": "kimi.checkpoint",
    "SyntheticSource": "kimi.synthetic",
    "expected_tensors": "kimi.tensors",
    "get_executor": ".executor", "Executor": ".executor", "DoesNotFit": ".memory",
}

__all__ = ["PRESETS", "ConfigError", "KimiConfig", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reference' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
