"""Long prompts: the MLA softmax runs over blocks (equal to the dense softmax, memory linear in the
prompt), a long prefill runs in segments with the same results, a call that cannot fit is refused
with one line before anything is allocated, and the model reports its per-layer progress.

Agreement measure: rel = max|a - b| / max|b| (normwise relative)."""
import dataclasses
import tracemalloc

import numpy as np
import pytest

import reference
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from reference import mla
from reference.executor import NUMPY
from reference.memory import call_bytes
from reference.model import DoesNotFit, Model

TINY = KimiConfig.from_name("tiny")
BIG = KimiConfig.from_name("kimi-linear-48b")


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def dense_attention(q, latent, k_pe, w_kvb, P, Vh):
    """The whole [B, N, T, S] softmax at once (what the blocked form must equal)."""
    B, T, N, _ = q.shape
    S = latent.shape[1]
    w = w_kvb.reshape(N, P + Vh, -1)
    k = latent[:, None] @ w[:, :P].transpose(0, 2, 1)  # [B, N, S, P]
    v = latent[:, None] @ w[:, P:].transpose(0, 2, 1)  # [B, N, S, Vh]
    qh = q.transpose(0, 2, 1, 3)  # [B, N, T, P+R]
    s = qh[..., :P] @ k.transpose(0, 1, 3, 2) + qh[..., P:] @ k_pe.transpose(0, 2, 1)[:, None]
    s = s * q.shape[-1] ** -0.5
    s = np.where(np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("B, N, T, S, blocks", [(1, 32, 520, 2600, (2, 2)), (1, 64, 200, 3000, (1, 2)),
                                                (1, 4, 1, 1000, (1, 1))])
def test_blocked_softmax_equals_the_dense_softmax_across_many_blocks(B, N, T, S, blocks):
    P, R, Vh, L = 4, 2, 3, 5
    tq, tk = mla.blocks(B, N, T)
    assert (-(-T // tq), -(-S // tk)) == blocks  # query and key blocks the blocked path runs over
    r = np.random.default_rng(T)
    q = 3 * r.standard_normal((B, T, N, P + R))  # large scores: the running max matters
    latent, k_pe = r.standard_normal((B, S, L)), r.standard_normal((B, S, R))
    w_kvb = r.standard_normal((N * (P + Vh), L))
    want = dense_attention(q, latent, k_pe, w_kvb, P, Vh)
    assert rel(mla.naive(q, latent, k_pe, w_kvb), want) < 1e-12
    assert rel(mla.absorbed(q, latent, k_pe, w_kvb), want) < 1e-12


def test_attention_memory_is_linear_in_the_prompt_not_quadratic():
    c = BIG
    args = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank)
    scores_at = lambda T: 8 * c.num_attention_heads * T * T  # noqa: E731  (a [1, H, T, T] float64)
    assert mla.attention_bytes(1, 32768, 32768, *args, form="naive") < scores_at(32768) / 30
    assert mla.attention_bytes(1, 1, 32768, *args, form="absorbed") < 2**30  # a decode step
    assert mla.attention_bytes(1, 32768, 32768, *args, form="naive") < 8 * 2**30  # 256 GiB dense
    ratio = mla.attention_bytes(1, 32768, 32768, *args, form="naive") / mla.attention_bytes(
        1, 4096, 4096, *args, form="naive")
    assert ratio < 9  # 8x the tokens: linear, with a constant block part


def test_a_32k_token_prefill_of_the_48b_model_is_estimated_to_fit_beside_the_optimized_model():
    need = call_bytes(BIG, 32768, logits="last") * 1.25
    assert need < (139 - 92) * 2**30  # an H200 less 98 GB of bf16 weights
    assert call_bytes(BIG, 32768) > 40 * 2**30  # [T, vocab] logits would not: "last" is needed


@dataclasses.dataclass(frozen=True)
class _TightExecutor(type(NUMPY)):
    """NumPy with a stated free memory: the environment a long prompt meets on a small machine."""
    free: int = 0

    def free_bytes(self):
        return self.free


def test_a_prompt_that_cannot_fit_is_refused_in_one_line_before_allocating():
    ex = _TightExecutor("numpy", "cpu", NUMPY.xp, free=256 << 20)
    model = Model(SyntheticSource(TINY, 0), executor=ex)
    ids = np.arange(200_000) % TINY.vocab_size
    tracemalloc.start()
    with pytest.raises(DoesNotFit) as info:
        model.prefill(ids)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    msg = str(info.value)
    assert "\n" not in msg and "200000 token(s)" in msg and "GiB free" in msg and "host memory" in msg
    assert peak < 16 << 20, peak  # refused before any activation: ids, not [T, D] arrays
    model.prefill(ids[:50])  # a prompt that fits runs on the same machine


def test_a_long_prefill_in_segments_equals_one_pass():
    src = SyntheticSource(TINY, 0)
    ids = np.random.default_rng(3).integers(0, TINY.vocab_size, 150)
    one, cache1 = reference.load(src).prefill(ids)
    seg, cache2 = Model(src, segment=64).prefill(ids)  # 3 segments: 64, 64, 22
    assert rel(seg, one) < 1e-13
    for a, b in zip(cache1.layers, cache2.layers, strict=True):
        for f in dataclasses.fields(a):
            assert rel(getattr(b, f.name), getattr(a, f.name)) < 1e-13, f.name
    with pytest.raises(ValueError, match="multiple of the KDA chunk"):
        Model(src, segment=100)


def test_last_only_logits_are_the_last_row_and_progress_is_reported_per_layer():
    model = reference.load(SyntheticSource(TINY, 0))
    events = []
    model.progress = events.append
    ids = [5, 6, 7, 8]
    full, _ = model.prefill(ids)
    last, _ = model.prefill(ids, logits="last")
    assert last.shape == (1, TINY.vocab_size) and rel(last, full[-1:]) < 1e-13
    layers = TINY.num_hidden_layers
    assert [e["layer"] for e in events] == list(range(1, layers + 1)) * 2
    assert all(e["layers"] == layers and e["tokens"] == 4 and e["call"] == "prefill" for e in events)
    with pytest.raises(ValueError, match="logits: expected one of"):
        model.prefill(ids, logits="first")
