"""Shared pieces of the derived-error-bound tests in tests/optimized: the device, the dtypes, unit
roundoffs, the rounding terms of the bound models, float64 conversions and the bound check.

u: unit roundoff (bf16 2^-8, fp16 2^-11, fp32 2^-24, fp64 2^-53). u_c: the compute dtype's (fp32 for
bf16/fp32 runs, fp64 for fp64). rho_triton: one rounding inside a Triton kernel from the compute dtype
to the output dtype (0 in fp32/fp64; bf16 2^-8 round-to-nearest, 2^-7 under an interpreter that
truncates). rho_torch: the rounding of a torch GEMM output to bf16 (torch rounds to nearest; else 0).
gamma_n = n u / (1 - n u).
"""
from __future__ import annotations

import numpy as np
import torch

from optimized.elementwise._precision import triton_bf16_cast_rounds_to_nearest

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on a GPU, else the interpreter
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def u_compute(dtype):
    return U[torch.float64] if dtype == torch.float64 else U[torch.float32]


def rho_triton(dtype):
    """Relative error of one in-kernel rounding from the compute dtype to ``dtype``."""
    if dtype in (torch.float32, torch.float64):
        return 0.0
    return U[dtype] * (1 if triton_bf16_cast_rounds_to_nearest() else 2)


def rho_torch(dtype):
    """Relative error of a torch GEMM output rounded to ``dtype`` (round-to-nearest)."""
    return U[dtype] if dtype == torch.bfloat16 else 0.0


def gamma(n, u):
    return n * u / (1 - n * u)


def d64(t):
    return t.detach().to(torch.float64).cpu()


def np64(t):
    return None if t is None else d64(t).numpy()


def assert_within(what, out, ref, bound):
    """Fail unless every |out - ref| <= bound; report the worst element. Returns max err/bound.

    Also fails on a shape mismatch, a differing NaN pattern, a non-finite output where the reference
    is finite, an infinite reference not matched exactly, and an all-zero output against a reference
    that is not all zero.
    """
    o = d64(out)
    assert o.shape == ref.shape, f"{what}: shape {tuple(o.shape)} vs reference {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(o), torch.isnan(ref)), f"{what}: NaN pattern differs"
    fin = torch.isfinite(ref)
    assert bool(torch.isfinite(o[fin]).all()), f"{what}: non-finite output where the reference is finite"
    inf = torch.isinf(ref)
    assert torch.equal(o[inf], ref[inf]), f"{what}: Inf pattern differs"
    if bool((ref[fin] != 0).any()):
        assert bool((o[fin] != 0).any()), f"{what}: degenerate output (all zeros)"
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(o)
    err = torch.where(fin, (o - ref).abs(), torch.zeros_like(o))
    bad = err > bound
    ratio = (err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item() if o.numel() else 0.0
    if bad.any():
        i = int((err - bound).flatten().argmax())
        idx = np.unravel_index(i, tuple(o.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {o.numel()} elements beyond the bound; worst at {idx}: "
            f"got {o.flatten()[i].item()!r}, reference {ref.flatten()[i].item()!r}, "
            f"error {err.flatten()[i].item():.3e}, bound {bound.flatten()[i].item():.3e}")
    return ratio
