"""optimized.kda at the model's shapes on a GPU (H = 32, K = V = 128; T = 1000, ragged against the
chunk, and 4096 in bf16; fp64 varlen at K != V): within the registry's bounds and run-to-run bitwise.
Apart from tests/optimized/test_kda.py so that the float64 reference at these sizes (a minute of
NumPy) runs beside that file's compiles, not after them. Too slow for the interpreter: GPU only."""
from __future__ import annotations

import pytest
import torch

from parity.testing import assert_parity

from .test_kda import case, inputs, run


@pytest.mark.parity_gpu
@pytest.mark.parametrize("T, dtype", [(1000, "bfloat16"), (1000, "float32"), (4096, "bfloat16")])
def test_gpu_fused_chunked_real_shapes(T, dtype, parity_device):
    c = case(1, T, 32, 32, 128, 128, seed=T, op="fused_chunked")
    j = assert_parity("kda.fused_chunked", c, dtype=dtype, device=parity_device)
    print(f"fused_chunked {dtype} T={T}: err/bound {j.ratio:.3g}")
    if T == 1000:
        c = case(1, T, 32, 32, 128, 128, seed=T, op="fused_recurrent")
        print(f"fused_recurrent {dtype} T={T}: err/bound "
              f"{assert_parity('kda.fused_recurrent', c, dtype=dtype, device=parity_device).ratio:.3g}")
    d = inputs("fused_chunked", c, dtype)
    a, b = run("fused_chunked", d), run("fused_chunked", d)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parity_gpu
@pytest.mark.parametrize("op", ["chunked", "recurrent"])
def test_gpu_fp64_varlen(op, parity_device):
    c = case(1, 1000, 4, 8, 128, 64, seed=2, op=op, cu_seqlens=[0, 1, 300, 301, 1000])
    print(f"fp64 varlen {op}: err/bound {assert_parity(f'kda.{op}', c, dtype='float64', device=parity_device).ratio:.3g}")
