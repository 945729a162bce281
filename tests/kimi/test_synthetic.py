"""SyntheticSource: the counter-based hash recipe (as documented, in pure Python and in torch),
determinism, on-demand rows, storage rounding and realistic scales."""
import math
import zlib

import numpy as np
import pytest

from kimi.config import KimiConfig
from kimi.storage import bf16_bits_to_float64, float_to_bf16_bits
from kimi.synthetic import SyntheticSource, synthetic_values

TINY = KimiConfig.from_name("tiny")
M = 0xFFFFFFFF


def recipe_in_python(seed, name, i, mean, std):
    """The docstring of synthetic_values, transcribed with Python ints and floats."""
    def mix32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x5BD1E995) & M
        return x ^ (x >> 16)

    k1 = mix32(mix32(seed) ^ zlib.crc32(name.encode()))
    k2 = mix32(k1 ^ 0x9E3779B9)
    h = mix32(mix32((i + k1) & M) ^ k2)
    z = (2 * (h >> 9) + 1 - 2 ** 23) * 2.0 ** -23
    return np.float32(z * (std * math.sqrt(3)) + mean)


def test_values_follow_the_documented_recipe_exactly():
    name, mean, std = "model.layers.2.self_attn.q_proj.weight", 0.25, 0.125
    idx = [0, 1, 2, 1000, 2 ** 31 + 7, 2 ** 32 - 1]
    for seed in (0, 1, 2 ** 32 - 1):
        for i in idx:
            got = synthetic_values(seed, name, 1, start=i, mean=mean, std=std)[0]
            assert got == recipe_in_python(seed, name, i, mean, std), (seed, i)


def test_torch_int64_arithmetic_reproduces_the_values():
    torch = pytest.importorskip("torch")

    def mix32(x):  # int64 tensors, masked: what the optimized side runs on the GPU
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & M
        x = x ^ (x >> 15)
        x = (x * 0x5BD1E995) & M
        return x ^ (x >> 16)

    seed, name, count, start, mean, std = 7, "lm_head.weight", 3000, 2 ** 32 - 3000, -0.5, 0.03
    k1 = int(mix32(torch.tensor(seed)) ^ zlib.crc32(name.encode()))
    k1 = int(mix32(torch.tensor(k1)))
    k2 = int(mix32(torch.tensor(k1 ^ 0x9E3779B9)))
    i = torch.arange(start, start + count, dtype=torch.int64)
    h = mix32(mix32((i + k1) & M) ^ k2)
    z = (2 * (h >> 9) + 1 - 2 ** 23).double() * 2.0 ** -23
    ours = (z * (std * math.sqrt(3)) + mean).float().numpy()
    np.testing.assert_array_equal(ours, synthetic_values(seed, name, count, start=start, mean=mean, std=std))


def test_values_depend_on_seed_and_name_and_are_uniform():
    a = synthetic_values(0, "x", 200_000)
    assert np.array_equal(a, synthetic_values(0, "x", 200_000))
    assert not np.array_equal(a, synthetic_values(1, "x", 200_000))
    assert not np.array_equal(a, synthetic_values(0, "y", 200_000))
    np.testing.assert_array_equal(synthetic_values(0, "x", 50, start=1000), a[1000:1050])
    assert abs(a.mean()) < 0.01 and abs(a.std() - 1) < 0.01 and abs(a).max() < math.sqrt(3)
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.01


def test_bad_seeds_and_ranges_are_rejected():
    with pytest.raises(ValueError, match="seed"):
        SyntheticSource(TINY, -1)
    with pytest.raises(ValueError, match="seed"):
        synthetic_values(2 ** 32, "x", 1)
    with pytest.raises(ValueError, match="start"):
        synthetic_values(0, "x", 2, start=2 ** 32 - 1)


def test_tensors_are_rounded_to_their_storage_dtype_and_generated_fresh():
    s = SyntheticSource(TINY, 0)
    q = "model.layers.0.self_attn.q_proj.weight"
    raw = s.get_raw(q)
    assert raw.dtype == np.uint16 and raw.shape == (64, 64)
    np.testing.assert_array_equal(s.get(q), bf16_bits_to_float64(raw))
    assert s.get_raw("model.layers.0.self_attn.A_log").dtype == np.float32
    a = s.get(q)
    a[:] = 0  # nothing is cached: the next get regenerates it
    assert np.count_nonzero(s.get(q)) > 4000
    rows = [63, 0, 17]
    np.testing.assert_array_equal(s.get_rows(q, rows), s.get(q)[rows])


def test_rows_of_the_48b_embedding_are_generated_without_the_whole_table():
    s = SyntheticSource(KimiConfig.from_name("kimi-linear-48b"), 0)
    name = "model.embed_tokens.weight"
    rows = s.get_rows(name, [163839, 7])
    assert rows.shape == (2, 2304)
    expect = synthetic_values(0, name, 2304, start=163839 * 2304, mean=0.0, std=1.0)
    np.testing.assert_array_equal(rows[0], bf16_bits_to_float64(float_to_bf16_bits(expect)))


def test_scales_look_like_a_trained_model():
    s = SyntheticSource(KimiConfig.from_name("small"), 0)
    for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight",
                 "model.layers.0.self_attn.o_norm.weight", "model.layers.2.self_attn.kv_a_layernorm.weight"):
        w = s.get(name)
        assert abs(w.mean() - 1) < 0.02 and 0.02 < w.std() < 0.1, name
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w2.weight", "lm_head.weight"):
        w = s.get(name)
        assert abs(w.std() * math.sqrt(w.shape[-1]) - 1) < 0.05, name


def test_kda_decays_span_half_to_nearly_one_per_step():
    cfg = KimiConfig.from_name("small")
    s = SyntheticSource(cfg, 0)
    alphas = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kda_layer(i):
            A_log = s.get(f"model.layers.{i}.self_attn.A_log").reshape(-1, 1)  # [H, 1]
            dt_bias = s.get(f"model.layers.{i}.self_attn.dt_bias").reshape(A_log.shape[0], -1)
            assert np.all(A_log <= 0) and np.all(A_log >= -math.log(16) - 1e-6)
            alphas.append(np.exp(-np.exp(A_log) * np.log1p(np.exp(dt_bias))).ravel())  # at g_raw = 0
    alpha = np.concatenate(alphas)
    assert alpha.min() < 0.6 and alpha.max() > 0.99 and 0.9 < np.median(alpha) < 0.99


def test_router_bias_is_nonzero_and_comparable_to_the_score_spread():
    cfg = KimiConfig.from_name("small")
    s = SyntheticSource(cfg, 0)
    x = np.random.default_rng(0).standard_normal((64, cfg.hidden_size))  # ~ normed hidden states
    bias, scores = [], []
    for i in range(1, cfg.num_hidden_layers):
        bias.append(s.get(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"))
        scores.append(1 / (1 + np.exp(-x @ s.get(f"model.layers.{i}.block_sparse_moe.gate.weight").T)))
    bias, scores = np.concatenate(bias), np.concatenate(scores)
    assert np.count_nonzero(bias) == bias.size
    assert 0.25 < bias.std() / scores.std() < 1
