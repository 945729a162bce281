"""benchmarks/candidates_kda.py: each registered candidate, swapped into the chunked KDA, keeps its
bits where it must (the interpreter here; the script checks the device) and stays within test_kda's
bound where it need not; the bit comparison has teeth: a helper that computes something else
(ablate_kda.py's stand-in) changes the output."""
import pytest
import torch

from benchmarks import ablate_kda, candidates_kda
from optimized import interpreting
from optimized.kda import chunk
from tests.optimized.test_kda import check, make_inputs, run

# a helper swapped into the module is seen by the interpreter at the next call; a compiled kernel
# keeps its cached build, so on a GPU the swap would not take effect (the script itself rebuilds)
pytestmark = pytest.mark.skipif(not interpreting(), reason="swaps @triton.jit helpers: interpreter only "
                                "(benchmarks/candidates_kda.py checks them on the device)")


def _inputs():
    return make_inputs(1, 40, 1, 1, 32, 32, torch.bfloat16, seed=5, h0=True)


@pytest.mark.parametrize("name", sorted(candidates_kda.CANDIDATES))
def test_candidate(name, monkeypatch):
    d = _inputs()
    o, s = run("fused_chunked", d)
    swaps, exact = candidates_kda.CANDIDATES[name]
    for attr, fn in swaps:
        monkeypatch.setattr(chunk, attr, fn)
    o2, s2 = run("fused_chunked", d)
    if exact:
        assert torch.equal(o, o2) and torch.equal(s, s2), f"{name} changes the bits"
    else:
        check(f"candidate {name}", d, o2, s2, fused=True)
        d = make_inputs(1, 100, 1, 2, 32, 32, torch.float32, seed=8, strong=True, h0=True)
        check(f"candidate {name}, strong decay", d, *run("fused_chunked", d), fused=True)


def test_the_comparison_can_fail(monkeypatch):
    d = _inputs()
    o, _ = run("fused_chunked", d)
    monkeypatch.setattr(chunk, "_diag_block", ablate_kda._diag_stand_in)
    o3, _ = run("fused_chunked", d)
    assert not torch.equal(o, o3), "a different diagonal left the output unchanged"
