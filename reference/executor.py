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

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import array_api_compat
import numpy as np

EXECUTORS = ("numpy", "torch", "array-api-strict")
API_VERSION = "2024.12"  # the standard the ops are written against (take_along_axis, scalar operands)

_SCALARS = (bool, int, float, complex, list, tuple)


def namespace(*arrays):
    """The array API namespace of ``arrays`` (None and Python scalars/lists ignored; NumPy when
    nothing else is given). Mixing two libraries is a ``TypeError`` naming both."""
    arrays = [a for a in arrays if a is not None and not isinstance(a, _SCALARS)]
    if not arrays:
        return array_api_compat.array_namespace(np.empty(0))
    return array_api_compat.array_namespace(*arrays)


def device_of(x):
    """The device of array ``x`` (for ``zeros(..., device=)``)."""
    return array_api_compat.device(x)


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


# -- bf16 -> float64 on the host: every core, an integer shift per element ------------------------

_CONVERT_BLOCK = 1 << 20  # elements per task at most: 4 MB of uint32 + 8 MB of float64, cache-friendly
_MIN_BLOCK = 1 << 16  # and at least (a task costs ~10 us to hand out)
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=cpu_count(), thread_name_prefix="reference-bf16")
    return _POOL


def parallel_blocks(fn, n: int, block: int) -> None:
    """``fn(lo, hi)`` for the blocks of ``range(n)``, on every core (for NumPy work on disjoint
    slices of an output: NumPy's loops release the GIL, so threads scale)."""
    if n <= block or cpu_count() == 1:
        for lo in range(0, n, block):
            fn(lo, min(n, lo + block))
        return
    jobs = [_pool().submit(fn, lo, min(n, lo + block)) for lo in range(0, n, block)]
    for j in jobs:
        j.result()


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of a float NumPy array is finite: block sums on every core (a sum of
    finite storage values, |x| < 3.5e38 each, cannot overflow float64, so it is finite exactly
    when they all are)."""
    flat = a.reshape(-1)
    size = _block(flat.size)
    if flat.size <= size:
        return math.isfinite(float(np.sum(flat)))
    ok = [True] * (-(-flat.size // size))

    def block(lo, hi):
        ok[lo // size] = math.isfinite(float(np.sum(flat[lo:hi])))

    parallel_blocks(block, flat.size, size)
    return all(ok)


def _bf16_block(src: np.ndarray, dst: np.ndarray) -> None:
    # bf16 is the top half of a float32: shift the 16 bits up, reinterpret, widen (all exact)
    dst[...] = np.left_shift(src, np.uint32(16), dtype=np.uint32).view(np.float32)


def bf16_bits_to_float64(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (``uint16``) -> float64, exactly; blocks of 1M elements on every core
    (NumPy's ufuncs release the GIL), so a 48B layer converts at memory speed."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {bits.dtype}")
    out = np.empty(bits.shape, dtype=np.float64)
    if bits.size <= _block(bits.size):
        _bf16_block(bits, out)
        return out
    src, dst = bits.reshape(-1), out.reshape(-1)  # reshape(-1) of a non-contiguous view copies: fine
    parallel_blocks(lambda lo, hi: _bf16_block(src[lo:hi], dst[lo:hi]), src.size, _block(src.size))
    return out


def _block(n: int) -> int:
    """Elements per task: at most ``_CONVERT_BLOCK``, and small enough that a tensor of ``n`` (one
    48B expert matrix is 2.4M) gives every core two tasks."""
    return max(_MIN_BLOCK, min(_CONVERT_BLOCK, -(-n // (2 * cpu_count()))))


# float dtypes that hold every value of a storage dtype exactly (a shared tensor may be wider)
_HOLDS_EXACTLY = {"bfloat16": ("bfloat16", "float32", "float64"),
                  "float16": ("float16", "float32", "float64"), "float32": ("float32", "float64"),
                  "float64": ("float64",)}


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
            import torch

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
        import torch

        if isinstance(raw, np.ndarray) and not (raw.flags.c_contiguous and raw.flags.writeable):
            raw = raw.copy()
        if isinstance(raw, torch.Tensor):
            exact = _HOLDS_EXACTLY[storage]
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

    def round_to_storage(self, values, storage: str):
        """float32 values (this executor's array) rounded to ``storage`` (nearest even), as float64:
        what a checkpoint written from them holds (the synthetic weights)."""
        if self.name == "torch":
            import torch

            dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
            return values.to(dtypes[storage]).to(torch.float64)
        from .checkpoint import raw_to_float64, to_storage

        return self.asarray(raw_to_float64(to_storage(to_numpy(values), storage), storage))

    # -- device ---------------------------------------------------------------------------------
    def oom_errors(self) -> tuple:
        """What running out of this executor's memory raises (NumPy's ArrayMemoryError is a
        MemoryError; torch's OutOfMemoryError is not)."""
        if self.name == "torch":
            import torch

            return (MemoryError, torch.OutOfMemoryError)
        return (MemoryError,)

    def synchronize(self) -> None:
        if self.name == "torch" and self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int | None:
        """Memory an allocation may still take on the device: free GPU memory plus what torch's
        allocator holds unused, or the host's MemAvailable; None when unknown."""
        if self.name == "torch" and self.device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(self.device)
            reserved = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return int(free + reserved)
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def describe(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name} on {self.device}"

    def info(self) -> dict:
        """For reports: ``{"executor", "device", "device_name", "library"}``."""
        out = {"executor": self.name, "device": self.device, "device_name": "cpu",
               "library": f"numpy {np.__version__}"}
        if self.name == "torch":
            import torch

            out["library"] = f"torch {torch.__version__}"
            if self.device.startswith("cuda"):
                out["device_name"] = torch.cuda.get_device_name(self.device)
            out["threads"] = torch.get_num_threads()
        elif self.name == "array-api-strict":
            import array_api_strict

            out["library"] = f"array-api-strict {array_api_strict.__version__}"
        else:
            out["threads"] = cpu_count()
        return out


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
        import array_api_strict

        return Executor("array-api-strict", "cpu", array_api_strict)
    try:
        import torch
    except ImportError:
        raise ValueError("executor torch: torch is not installed") from None
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"reference device {device}: no CUDA device is available on this machine")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"reference device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    return Executor("torch", device, array_api_compat.array_namespace(torch.empty(0)))


NUMPY = Executor("numpy", "cpu", array_api_compat.array_namespace(np.empty(0)))
