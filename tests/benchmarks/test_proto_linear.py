"""benchmarks/proto_linear.py: its kernel runs under the interpreter and keeps rows independent of M."""
import torch

from benchmarks import proto_linear


def test_linear_prototype_matches_torch_and_rows_do_not_depend_on_m():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g), torch.randn(40, 64, generator=g)
    y = proto_linear.linear(x, w, 16, 32, 4, 3)
    exact = x.double() @ w.double().T
    # fp32 products and sums over K = 64: gamma_K(2^-24) * |x| |w|^T bounds the error
    bound = 64 * 2.0 ** -24 / (1 - 64 * 2.0 ** -24) * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - exact).abs() <= bound).all()
    assert proto_linear.rows_invariant()
