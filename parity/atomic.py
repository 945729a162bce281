"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: str | Path, data: bytes | str | None = None, *, writer=None, fill=None,
                 durable: bool = True) -> Path:
    """Write ``data`` (or call ``writer(file)``, or ``fill(name)`` for a library that writes a file
    by its name) to a temporary file beside ``path``, then rename it over ``path``: a reader sees the
    old file or the whole new one, never half of it, and a failure leaves no partial file behind.
    ``durable``: the bytes are forced to the disk (fsync) before the rename, so that a crash of the
    machine, not only of the program, finds the old file or the new one."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if fill is not None:
                fill(tmp)
            elif writer is not None:
                writer(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
