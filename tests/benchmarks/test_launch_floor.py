"""benchmarks/launch_floor.py: its read kernel sums every row of the cache once (compiled on a GPU,
else under the interpreter)."""
import torch

from benchmarks import launch_floor
from tests.optimized._bounds import DEV


def test_read_kernel_sums_each_row_once():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, launch_floor.ROW, generator=g).to(torch.bfloat16)
    parts = launch_floor.read_sum(x.to(DEV), programs=3, block_rows=16).cpu()
    per = 24  # cdiv(70, 3) rows per program, the last program 22
    for p in range(3):
        rows = x[p * per:(p + 1) * per].double()
        # fp32 sums of <= 24 * 576 bf16 values: relative error below 2^-24 * terms
        tol = rows.numel() * 2.0 ** -24 * rows.abs().sum().item()
        assert abs(parts[p].item() - rows.sum().item()) <= tol
    # a mutant that skips the k_pe columns is caught
    assert abs(parts[0].item() - x[:per, :512].double().sum().item()) > 1e-3
