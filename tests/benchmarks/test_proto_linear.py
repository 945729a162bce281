"""benchmarks/proto_linear.py: its kernel (compiled on a GPU, else under the interpreter) keeps rows
independent of M."""
import torch

from benchmarks import proto_linear

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU, else interpreted


def test_linear_prototype_matches_torch_and_rows_do_not_depend_on_m():
    g = torch.Generator().manual_seed(1)
    # bf16, the prototype's dtype (a GPU would take float32 operands as tf32)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    y = proto_linear.linear(x.to(DEV), w.to(DEV), 16, 32, 4, 3).cpu().double()
    exact = x.double() @ w.double().T
    # bf16 products are exact in fp32; fp32 sums over K = 64 add gamma_K(2^-24) |x| |w|^T, and the
    # bf16 output rounds the result once more (unit roundoff 2^-8)
    a = x.double().abs() @ w.double().abs().T
    acc_bound = 64 * 2.0 ** -24 / (1 - 64 * 2.0 ** -24) * a
    bound = acc_bound + 2.0 ** -8 * (exact.abs() + acc_bound)
    assert ((y - exact).abs() <= bound).all()
    assert not ((y * 0 - exact).abs() <= bound).all()  # an all-zero output fails the check
    assert proto_linear.rows_invariant(device=DEV)
