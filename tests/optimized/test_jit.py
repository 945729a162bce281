"""optimized._jit: every kernel launch asks for floating-point fusion unless it names its own choice
(the certificates were made with it; Triton 3.10 turns its default off)."""
from triton.runtime.jit import JITFunction

from optimized.kda import chunk


def test_a_launch_asks_for_fp_fusion_unless_it_chooses(monkeypatch, parity_device):
    seen = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: seen.append(kw))
    chunk._state_output_t_kernel.run(grid=(1,), warmup=False, num_warps=4)
    chunk._state_output_t_kernel.run(grid=(1,), warmup=False, enable_fp_fusion=False)
    assert [kw.get("enable_fp_fusion") for kw in seen] == [True, False]
    assert seen[0]["num_warps"] == 4
