"""The optimized model on a CUDA GPU (skipped without one): what is too slow for the Triton
interpreter. 64 greedy decode steps at bf16 (incremental == recompute token for token but for
near-ties, logits within the bf16 bound of the reference), the medium preset (the real head sizes)
at float32, batched decode with the 64-row decode tile, and the synthetic weights generated on the
device bit for bit.

Bounds and helpers: ``test_model_parity`` (same directory)."""
import copy

import numpy as np
import pytest
import torch

import optimized
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from .test_model_parity import (PROMPT, TINY, _float32_parity, check_bf16_run, check_greedy_agrees_with_recompute,
                                traced_rerun)

pytestmark = pytest.mark.parity_gpu

MEDIUM = KimiConfig.from_name("medium")
STEPS = 64


@pytest.mark.parametrize("preset", ["tiny", "medium"])
def test_bf16_64_greedy_steps_equal_the_recompute_path_and_stay_within_the_bound(preset, parity_device):
    config = KimiConfig.from_name(preset)
    source = SyntheticSource(config, 0)
    model = optimized.load(source, device=parity_device, dtype="bfloat16")
    logits, cache = model.prefill(PROMPT)
    steps, tokens = [logits[-1]], [int(logits[-1].argmax())]
    for _ in range(STEPS - 1):
        step, cache = model.decode(tokens[-1], cache)
        steps.append(step)
        tokens.append(int(step.argmax()))
    check_greedy_agrees_with_recompute(config, source, PROMPT, tokens, model.forward(PROMPT + tokens[:-1]))
    steps = torch.stack(steps)
    check_bf16_run(config, source, PROMPT, tokens, logits, steps, traced_rerun(model, PROMPT, tokens, logits, steps))


def test_float32_medium_preset_matches_the_reference_on_the_gpu():
    source = SyntheticSource(MEDIUM, 1)
    worst = _float32_parity(source, decode_steps=2, split=5)  # default device: the GPU here
    assert max(worst.values()) < 1.0, worst


def test_bf16_batched_decode_equals_alone_with_the_64_row_tile(parity_device):
    model = optimized.load(SyntheticSource(TINY, 2), device=parity_device, dtype="bfloat16")
    assert model.decode_tile == 64
    rng = np.random.default_rng(0)
    B = 9
    prompts = [rng.integers(0, TINY.vocab_size, int(n)).tolist() for n in rng.integers(1, 70, B)]
    pool = model.new_pool(B)
    seqs = [model.prefill(p, cache=pool.new_sequence())[1] for p in prompts]
    pool_alone, seqs_alone = copy.deepcopy((pool, seqs))
    nxt = rng.integers(0, TINY.vocab_size, (3, B)).tolist()
    batched = [model.decode_batch(nxt[k], seqs)[0] for k in range(3)]
    for b, seq in enumerate(seqs_alone):
        for k in range(3):
            alone, _ = model.decode(nxt[k][b], seq)
            assert torch.equal(alone, batched[k][b]), (b, k)


@pytest.mark.parametrize("preset", ["tiny", "medium"])
def test_synthetic_weights_generated_on_the_gpu_equal_the_numpy_ones(preset, parity_device):
    from optimized.synthetic import DeviceGenerator
    from optimized.weights import raw_to_torch

    source = SyntheticSource(KimiConfig.from_name(preset), 7)
    gen = DeviceGenerator(source, parity_device)
    for name in source.names():
        want = raw_to_torch(source.get_raw(name), source.storage_dtype(name))
        got = gen(name).cpu()
        bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), name


def test_synthetic_48b_tensors_generated_on_the_gpu_equal_the_numpy_ones(parity_device):
    from optimized.synthetic import DeviceGenerator
    from optimized.weights import raw_to_torch

    source = SyntheticSource(KimiConfig.from_name("kimi-linear-48b"), 0)
    gen = DeviceGenerator(source, parity_device)
    for name in ["model.layers.3.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.5.block_sparse_moe.experts.255.w2.weight",
                 "model.layers.26.block_sparse_moe.gate.e_score_correction_bias"]:
        want = raw_to_torch(source.get_raw(name), source.storage_dtype(name))
        got = gen(name).cpu()
        bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), name
