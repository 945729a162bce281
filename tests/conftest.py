"""Test harness: hypothesis profiles, and a faithful Triton interpreter on CPU."""
import os

import pytest

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # pytest-xdist: each worker gets its share of the cores, not torch's whole pool each
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

try:  # optimized/ needs torch; the reference tests run without it
    import optimized  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU)
    from optimized import install_faithful_bf16_dot, interpreting

    if interpreting():
        install_faithful_bf16_dot()
except ImportError:
    pass
