"""benchmarks/launch_floor.py: its read kernel sums every row of the cache once (compiled on a GPU,
else under the interpreter)."""
import torch

from benchmarks import launch_floor


def test_read_kernel_sums_each_row_once(parity_device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, launch_floor.ROW, generator=g).to(torch.bfloat16)
    parts = launch_floor.read_sum(x.to(parity_device), programs=3, block_rows=16).cpu()
    per = 24  # cdiv(70, 3) rows per program, the last program 22
    tols = []
    for p in range(3):
        rows = x[p * per:(p + 1) * per].double()
        # fp32 sums of n <= 24 * 576 bf16 values: error below n 2^-24 sum |x|
        tols.append(rows.numel() * 2.0 ** -24 * rows.abs().sum().item())
        assert abs(parts[p].item() - rows.sum().item()) <= tols[p]
    # the check has teeth: a kernel that skipped the k_pe columns would miss by far more
    assert abs(x[:per, :512].double().sum().item() - x[:per].double().sum().item()) > tols[0]
