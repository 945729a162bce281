"""Where the float64 reference runs: an array library and a device behind the array API standard.

The ops in ``reference/`` are written once against the array API standard (2024.12): each takes
the namespace of its inputs (``namespace(*arrays)``, array-api-compat's ``array_namespace``, as
SciPy and scikit-learn do), so the same source runs on

- ``numpy`` (the default, and all CI needs): plain ``numpy.ndarray`` in and out;
- ``torch`` float64 on ``cpu`` or ``cuda[:N]``: the GPU executor. Chosen over CuPy because the
  optimized model is torch: one caching allocator for both in one process (two allocators each
  keeping freed blocks would split one H200's memory between them), the optimized model's bf16
  weights are shared without a copy, and torch float64 also runs on CPU, so CI checks the
  agreement of the two executors on every push without a GPU;
- ``array-api-strict`` (tests only): proves the ops call nothing outside the standard.

An ``Executor`` is the plumbing the standard leaves out: turning storage bits (bf16 as ``uint16``)
into float64 on the device, and float32 values into their storage rounding (the standard has no
bfloat16 and no bit casts), copying results back to NumPy, freezing cache arrays, synchronizing,
free memory. torch is imported only when a torch executor is asked for.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import array_api_compat
import numpy as np

from kimi.storage import HOLDS_EXACTLY, bf16_bits_to_float64, cpu_count, raw_to_float64, to_storage

EXECUTORS = ("numpy", "torch", "array-api-strict")
API_VERSION = "2024.12"  # the standard the ops are written against (take_along_axis, scalar operands)

_SCALARS = (bool, int, float, complex, list, tuple)


_BY_TYPE: dict = {}  # array type -> its namespace: every op asks, thousands of times a decode step


def namespace(*arrays):
    """The array API namespace of ``arrays`` (None and Python scalars/lists ignored; NumPy when
    nothing else is given). Mixing two libraries is a ``TypeError`` naming both."""
    arrays = [a for a in arrays if a is not None and not isinstance(a, _SCALARS)]
    if not arrays:
        arrays = [np.empty(0)]
    kind = type(arrays[0])
    if all(type(a) is kind for a in arrays):
        xp = _BY_TYPE.get(kind)
        if xp is None:
            xp = _BY_TYPE[kind] = _library_namespace(arrays[0])
        return xp
    return array_api_compat.array_namespace(*arrays)


def _library_namespace(a):
    """array-api-compat's namespace of ``a``; for torch with ``take`` and ``take_along_axis`` as
    one kernel each. array-api-compat first maps negative indices, which torch rejects, at the
    cost of two more kernels per call: about 550 of the 5.8k in a 48B decode step. The reference
    never passes negative indices, and torch still rejects one, so nothing is read wrongly."""
    xp = array_api_compat.array_namespace(a)
    if not array_api_compat.is_torch_namespace(xp):
        return xp
    import torch  # why: optional: the array-API reference runs without torch

    ns = types.ModuleType(xp.__name__, xp.__doc__)
    ns.__dict__.update(vars(xp))

    def take(x, indices, /, *, axis=None):
        if axis is None and x.ndim != 1:
            raise ValueError("axis must be specified when ndim > 1")
        if axis in (None, 0, -x.ndim) and indices.ndim == 1:
            # whole rows: aten's index copies them in wide vectors; index_select's kernel for few
            # indices reads a few elements per thread (a 48B step's expert gathers: 5.9 ms)
            return x[indices]
        return torch.index_select(x, 0 if axis is None else axis, indices)

    def take_along_axis(x, indices, /, *, axis=-1):
        return torch.take_along_dim(x, indices, dim=axis)
    ns.take, ns.take_along_axis = take, take_along_axis
    return ns


def device_of(x):
    """The device of array ``x`` (for ``zeros(..., device=)``)."""
    return array_api_compat.device(x)


def to_numpy(x) -> np.ndarray:
    """A NumPy array of any executor's array (copied to the host when it lives on a GPU)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    try:
        return np.from_dlpack(x)
    except (TypeError, RuntimeError, BufferError, AttributeError):
        return np.asarray(x)


def upload(ints: np.ndarray, like):
    """Host integers ``ints`` as int64 on the device of ``like`` (an array of the same library).
    torch on a GPU copies them from pinned memory without waiting for the device: a copy from
    pageable memory first waits for everything queued before it."""
    xp = namespace(like)
    ints = np.ascontiguousarray(ints, dtype=np.int64)
    dev = device_of(like)
    if getattr(dev, "type", None) == "cuda":
        import torch  # why: optional: the array-API reference runs without torch

        return torch.from_numpy(ints).pin_memory().to(dev, non_blocking=True)
    return xp.asarray(ints, device=dev)


# -- executors ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Executor:
    """An array library (``name``) on a ``device``; ``xp`` its array API namespace."""

    name: str
    device: str
    xp: object = field(repr=False, compare=False)

    # -- arrays ---------------------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        """``x`` (a NumPy array, list, scalar or this library's array) as float64 (or ``dtype``)
        on this executor's device."""
        xp = self.xp
        dtype = xp.float64 if dtype is None else dtype
        if self.name == "torch":
            import torch  # why: optional: the array-API reference runs without torch

            if isinstance(x, np.ndarray):  # a writable contiguous copy only where needed
                x = torch.from_numpy(x if x.flags.c_contiguous and x.flags.writeable else x.copy())
            return torch.as_tensor(x, device=self.device).to(dtype)
        return xp.asarray(x, dtype=dtype)

    def ints(self, x):
        """Integer ids as int64 on the device."""
        return self.asarray(np.asarray(to_numpy(x), dtype=np.int64), dtype=self.xp.int64)

    def to_numpy(self, x) -> np.ndarray:
        return to_numpy(x)

    def freeze(self, a):
        """A cache array nobody may write: read-only for NumPy; the other libraries have no such
        flag, and no reference op writes its inputs."""
        if isinstance(a, np.ndarray):
            a.setflags(write=False)
        return a

    # -- storage ----------------------------------------------------------------------------------
    def from_storage(self, raw, storage: str):
        """Storage values -> float64 on the device, exactly. ``raw``: the host bits of
        ``WeightSource.get_raw`` (``uint16`` for bf16, ``float16``, ``float32``, ``float64``), or (torch) a tensor
        already on the device in the storage dtype or a wider float dtype holding the same values."""
        if self.name == "torch":
            return self._torch_from_storage(raw, storage)
        if storage == "bfloat16":
            return self.asarray(bf16_bits_to_float64(raw))
        return self.asarray(np.asarray(raw))

    def _torch_from_storage(self, raw, storage: str):
        import torch  # why: optional: the array-API reference runs without torch

        if isinstance(raw, np.ndarray) and not (raw.flags.c_contiguous and raw.flags.writeable):
            raw = raw.copy()
        if isinstance(raw, torch.Tensor):
            exact = HOLDS_EXACTLY[storage]
            if str(raw.dtype).removeprefix("torch.") not in exact:
                raise TypeError(f"a {raw.dtype} tensor cannot hold {storage} weights exactly "
                                f"(expected one of {', '.join(exact)})")
        elif isinstance(raw, np.ndarray):
            if storage == "bfloat16":
                if raw.dtype != np.uint16:
                    raise TypeError(f"bf16 storage expected as uint16 bits, got {raw.dtype}")
                raw = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
            else:
                raw = torch.from_numpy(raw)
        return raw.to(self.device, non_blocking=False).to(torch.float64)

    def stacked_view(self, arrays: list):
        """``arrays`` (one shape, dtype and layout) as one ``[n, ...]`` array whose row ``e`` is
        ``arrays[e]``'s memory, when they are equally spaced contiguous views of one buffer (the
        optimized model's stacked experts, shared as one view per expert): rows are then gathered
        by device ids; else None (and always for libraries other than torch)."""
        if self.name != "torch" or not arrays:
            return None
        import torch  # why: optional: the array-API reference runs without torch

        a0 = arrays[0]
        if not all(isinstance(a, torch.Tensor) and a.is_contiguous() and a.dtype == a0.dtype
                   and a.shape == a0.shape and a.device == a0.device for a in arrays):
            return None
        if any(a.untyped_storage().data_ptr() != a0.untyped_storage().data_ptr() for a in arrays):
            return None
        offset = a0.storage_offset()
        step = arrays[1].storage_offset() - offset if len(arrays) > 1 else a0.numel()
        if step < a0.numel() or any(a.storage_offset() != offset + e * step for e, a in enumerate(arrays)):
            return None
        return torch.as_strided(a0, (len(arrays), *a0.shape), (step, *a0.stride()), offset)

    def round_to_storage(self, values, storage: str):
        """float32 values (this executor's array) rounded to ``storage`` (nearest even), as float64:
        what a checkpoint written from them holds (the synthetic weights)."""
        if self.name == "torch":
            import torch  # why: optional: the array-API reference runs without torch

            dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
            return values.to(dtypes[storage]).to(torch.float64)
        return self.asarray(raw_to_float64(to_storage(to_numpy(values), storage), storage))

    # -- device ---------------------------------------------------------------------------------
    def oom_errors(self) -> tuple:
        """What running out of this executor's memory raises (NumPy's ArrayMemoryError is a
        MemoryError; torch's OutOfMemoryError is not)."""
        if self.name == "torch":
            import torch  # why: optional: the array-API reference runs without torch

            return (MemoryError, torch.OutOfMemoryError)
        return (MemoryError,)

    def synchronize(self) -> None:
        if self.name == "torch" and self.device.startswith("cuda"):
            import torch  # why: optional: the array-API reference runs without torch

            torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int | None:
        """Memory an allocation may still take on the device (``free_bytes``)."""
        return free_bytes(self.device if self.name == "torch" else "cpu")

    def describe(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name} on {self.device}"

    def info(self) -> dict:
        """For reports: ``{"executor", "device", "device_name", "library"}``."""
        out = {"executor": self.name, "device": self.device, "device_name": "cpu",
               "library": f"numpy {np.__version__}"}
        if self.name == "torch":
            import torch  # why: optional: the array-API reference runs without torch

            out["library"] = f"torch {torch.__version__}"
            if self.device.startswith("cuda"):
                out["device_name"] = torch.cuda.get_device_name(self.device)
            out["threads"] = torch.get_num_threads()
        elif self.name == "array-api-strict":
            import array_api_strict  # why: optional: the strict array API of the tests

            out["library"] = f"array-api-strict {array_api_strict.__version__}"
        else:
            out["threads"] = cpu_count()
        return out


def free_bytes(device: str) -> int | None:
    """Memory an allocation may still take on ``device``: on ``cuda[:i]`` the GPU's free memory
    plus what torch's allocator holds unused, elsewhere the host's MemAvailable; None when unknown."""
    if str(device).startswith("cuda"):
        import torch  # why: optional: the array-API reference runs without torch

        free, _ = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + reserved)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def get_executor(device: str | None = None, executor: str | None = None) -> Executor:
    """The executor of ``device`` (``"cpu"`` default, ``"cuda"``, ``"cuda:N"``) and library
    ``executor`` (default: numpy on cpu, torch on cuda). ``ValueError`` for an unknown name, a
    library that cannot use the device, or a CUDA device that is not there."""
    device = "cpu" if device is None else str(device)
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}")
    if executor is None:
        executor = "numpy" if device == "cpu" else "torch"
    if executor not in EXECUTORS:
        raise ValueError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor != "torch" and device != "cpu":
        raise ValueError(f"executor {executor} runs on cpu only, not {device}; use torch for {device}")
    if executor == "numpy":
        return Executor("numpy", "cpu", array_api_compat.array_namespace(np.empty(0)))
    if executor == "array-api-strict":
        import array_api_strict  # why: optional: the strict array API of the tests

        return Executor("array-api-strict", "cpu", array_api_strict)
    try:
        import torch  # why: optional: the array-API reference runs without torch
    except ImportError:
        raise ValueError("executor torch: torch is not installed") from None
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"reference device {device}: no CUDA device is available on this machine")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"reference device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    return Executor("torch", device, namespace(torch.empty(0)))


NUMPY = Executor("numpy", "cpu", array_api_compat.array_namespace(np.empty(0)))
