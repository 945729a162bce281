"""Test harness: hypothesis profiles, and a faithful Triton interpreter on CPU."""
import os

import pytest

try:  # optimized/ needs torch; the reference tests run without it
    import optimized  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU)
    from optimized import install_faithful_bf16_dot, interpreting

    if interpreting():
        install_faithful_bf16_dot()
except ImportError:
    pass
