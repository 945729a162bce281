"""benchmarks/candidates_kda.py: each registered candidate, swapped into the chunked KDA, keeps its
bits (the interpreter here; the script checks the device), and the comparison has teeth: a helper
that computes something else (ablate_kda.py's stand-in) changes the output."""
import pytest
import torch

from benchmarks import ablate_kda, candidates_kda
from optimized.kda import chunk
from tests.optimized.test_kda import make_inputs, run


def _inputs():
    return make_inputs(1, 40, 1, 1, 32, 32, torch.bfloat16, seed=5, h0=True)


@pytest.mark.parametrize("name", sorted(candidates_kda.CANDIDATES))
def test_candidate_keeps_the_bits(name, monkeypatch):
    d = _inputs()
    o, s = run("fused_chunked", d)
    monkeypatch.setattr(chunk, *candidates_kda.CANDIDATES[name])
    o2, s2 = run("fused_chunked", d)
    assert torch.equal(o, o2) and torch.equal(s, s2), f"{name} changes the bits"


def test_the_comparison_can_fail(monkeypatch):
    d = _inputs()
    o, _ = run("fused_chunked", d)
    monkeypatch.setattr(chunk, "_diag_block", ablate_kda._diag_stand_in)
    o3, _ = run("fused_chunked", d)
    assert not torch.equal(o, o3), "a different diagonal left the output unchanged"
