"""The code digest: what a GPU run (docs/runs/gpu-check.json) was run on.

sha256 over every ``*.py`` under kimi/, optimized/, parity/, reference/ and tests/ (``__pycache__``
skipped), in sorted path order (POSIX paths relative to the repository root), of
``path + "\\0" + sha256(file bytes)``. A gpu-check.json whose digest is not this one was not run on
this code.

    python3 benchmarks/code_digest.py            # prints the hex digest
"""
from __future__ import annotations

import hashlib
import pathlib

PACKAGES = ("kimi", "optimized", "parity", "reference", "tests")


def code_digest(root: str | pathlib.Path = ".") -> str:
    """Hex sha256 of the repository's Python code under ``root`` (module docstring)."""
    root = pathlib.Path(root)
    files = sorted(p.relative_to(root) for d in PACKAGES for p in (root / d).rglob("*.py")
                   if "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for p in files:
        h.update(p.as_posix().encode() + b"\0" + hashlib.sha256((root / p).read_bytes()).digest())
    return h.hexdigest()


if __name__ == "__main__":
    print(code_digest(pathlib.Path(__file__).resolve().parent.parent))
