"""Errors the CLI reports as one line (exit 2), output files checked before a run and written as
input errors (:func:`check_outputs`, :func:`write_output`), and how running out of memory is
recognized and said in one line whichever library ran out."""
from __future__ import annotations

import re

from kimi.validate import InvalidInput, output_file, write_error


class InputError(Exception):
    """Unusable input: a missing or broken checkpoint, a bad argument. The message is one line
    that names the offending thing."""


def check_outputs(*flags: tuple[str, str | None]) -> None:
    """Each ``(flag, path)`` given on the command line is a usable output file
    (``kimi.validate.output_file``), checked before any work starts."""
    for flag, path in flags:
        try:
            output_file(flag, path)
        except InvalidInput as exc:
            raise InputError(str(exc)) from None


def write_output(path, write) -> None:
    """Call ``write()``; an OS error (disk full, permission) is an input error naming the file."""
    try:
        write()
    except OSError as exc:
        raise InputError(str(write_error(path, exc))) from None


class CandidateError(ValueError):
    """An implementation that cannot be certified as given (its module does not import, it is not
    callable, its signature or its outputs' count, shapes or dtypes are not the record's, its
    contract is unknown). The message is one line; the CLI exits 2 with it."""


class Unsupported(Exception):
    """Raised by an adapter for an input its implementation does not take (fla's Triton chunk_kda:
    chunk sizes 32 and 64 only): the input is skipped and counted in the certificate, not judged."""


class OutOfMemory(MemoryError):
    """Running out of memory where it was caught and could not be raised as it was (a certify
    worker's call): the message is already the one line (``memory_line``)."""


CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"  # torch's CPU allocator: a RuntimeError


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says a device ran out of memory: a ``MemoryError`` (NumPy's
    ``_ArrayMemoryError``, ``reference.DoesNotFit``, ``OutOfMemory``), ``torch.OutOfMemoryError``
    (CUDA, any device; matched by name, torch is not imported here) or torch's CPU allocator
    failing (a plain ``RuntimeError`` naming ``DefaultCPUAllocator``)."""
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    if any(c.__name__ == "OutOfMemoryError" and c.__module__.startswith("torch") for c in type(exc).__mro__):
        return True
    return CPU_ALLOCATOR in str(exc)


def memory_line(exc: BaseException, *, gpu: str | None = None) -> str:
    """One line for an ``is_out_of_memory`` error: where it ran out and how much was asked for
    (torch's multi-line messages cut to 'tried to allocate 2.00 GiB, 1.10 GiB free'); ``where``
    (set by the engine guard: ``engine optimized: prefill``) in front when the error carries it.
    ``gpu``: the device a GPU error is named by (torch's message numbers it, 'GPU 0')."""
    where = getattr(exc, "parity_where", None)
    head = f"{where}: " if where else ""
    if isinstance(exc, OutOfMemory) or type(exc).__name__ == "DoesNotFit":
        return head + _one(exc)
    text = str(exc)
    if isinstance(exc, RuntimeError) and CPU_ALLOCATOR in text:
        m = re.search(r"allocate (\d+) bytes", text)
        asked = f": tried to allocate {int(m.group(1)) / 2**30:.2f} GiB" if m else ""
        return f"{head}out of host memory{asked}"
    if isinstance(exc, RuntimeError):  # torch.OutOfMemoryError
        m = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", text)
        f = re.search(r"([\d.]+ [KMGT]iB) is free", text)
        parts = ([f"tried to allocate {m.group(1)}"] if m else []) + ([f"{f.group(1)} free"] if f else [])
        on = f" on {gpu}" if gpu and gpu != "cpu" else ""
        return f"{head}out of GPU memory{on}: " + (", ".join(parts) or _one(exc)[:200])
    return f"{head}out of host memory: " + (_one(exc)[:200] or type(exc).__name__)


def _one(exc: BaseException) -> str:
    return " ".join(str(exc).split())
