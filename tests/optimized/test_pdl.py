"""Programmatic dependent launch (``optimized._pdl``) changes when a kernel starts, never a bit.

On a GPU (sm_90 and later): a batch of sequences decoded by CUDA-graph replay with PDL is bitwise
the eager decode without it, step after step, for the tiny and the medium preset (the real head
sizes). A kernel that read its predecessor's output before its ``pdl_wait`` would race with it and
fail here: with the wait of the expert gate/up GEMV deleted (it then reads the router's expert ids
as the router writes them), the tiny case failed with a CUDA error on the H200 (this file run
there with that wait deleted, when the decode ran the GEMV form). On CPU and under the interpreter PDL
is off."""
import numpy as np
import pytest
import torch

import optimized
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from optimized import _pdl


def test_pdl_is_off_on_cpu_and_when_switched_off(monkeypatch, parity_device):
    assert _pdl.enabled(torch.device("cpu")) is False
    monkeypatch.setenv(_pdl.ENV, "0")
    assert _pdl.enabled(torch.device(parity_device)) is False


@pytest.mark.parity_gpu
@pytest.mark.parametrize("preset", ["tiny", "medium"])
def test_graph_replay_with_pdl_is_bitwise_the_eager_decode_without_it(preset, monkeypatch, parity_device):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of sm_90 or later")
    config = KimiConfig.from_name(preset)
    source = SyntheticSource(config, 3)
    with_pdl = optimized.load(source, device=parity_device, dtype="bfloat16", cuda_graphs=True)
    without = optimized.load(source, device=parity_device, dtype="bfloat16", cuda_graphs=False)
    rng = np.random.default_rng(1)
    B = 5
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist() for n in rng.integers(2, 90, B)]
    pools = with_pdl.new_pool(B), without.new_pool(B)
    seqs = []
    for model, pool, on in ((with_pdl, pools[0], "1"), (without, pools[1], "0")):
        monkeypatch.setenv(_pdl.ENV, on)
        seqs.append([model.prefill(p, cache=pool.new_sequence())[1] for p in prompts])
    for step in range(24):
        rows = list(range(B)) if step % 3 else [step % B]  # other batch sizes: other graphs
        ids = rng.integers(0, config.vocab_size, len(rows)).tolist()
        monkeypatch.setenv(_pdl.ENV, "1")
        assert _pdl.enabled(torch.device(parity_device))
        got = with_pdl.decode_batch(ids, [seqs[0][r] for r in rows])[0]
        monkeypatch.setenv(_pdl.ENV, "0")
        want = without.decode_batch(ids, [seqs[1][r] for r in rows])[0]
        assert torch.isfinite(want).all(), step
        assert torch.equal(got, want), f"step {step}: {(got != want).sum().item()} logits differ"
