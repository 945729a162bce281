"""The float64 model: prefill/decode/forward agree to 1e-12 for logits and every carried state,
checkpoints reproduce their generator bit for bit, variants act where they should, bad input is
named, and weights stream (only the routed experts are read)."""
import numpy as np
import pytest

import reference
from kimi.checkpoint import WeightSource
from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path, write_fixture
from kimi.synthetic import SyntheticSource
from reference.model import KDACache, MLACache, ModelCache

TINY = KimiConfig.from_name("tiny")
SMALL = KimiConfig.from_name("small")


def rel(a, b):
    """Normwise relative difference max|a - b| / max|b|."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.abs(b).max()
    return np.abs(a - b).max() / scale if scale else np.abs(a).max()


def cache_arrays(cache: ModelCache):
    for i, lc in enumerate(cache.layers):
        names = ("conv_q", "conv_k", "conv_v", "state") if isinstance(lc, KDACache) else ("latent", "k_pe")
        for n in names:
            yield f"layers[{i}].{n}", getattr(lc, n)


def ids_for(config, T, seed):
    return np.random.default_rng(seed).integers(0, config.vocab_size, T)


@pytest.fixture(scope="module")
def tiny():
    return reference.load(SyntheticSource(TINY, 0))


def assert_prefill_then_decode_matches(model, ids, split):
    full_logits, full_cache = model.prefill(ids)
    np.testing.assert_array_equal(model.forward(ids), full_logits)
    logits, cache = model.prefill(ids[:split])
    assert rel(logits, full_logits[:split]) < 1e-12
    for t in range(split, len(ids)):
        step, cache = model.decode(int(ids[t]), cache)
        assert rel(step, full_logits[t]) < 1e-12, t
    assert cache.length == full_cache.length == len(ids)
    for (name, a), (_, b) in zip(cache_arrays(cache), cache_arrays(full_cache), strict=True):
        assert rel(a, b) < 1e-12, name


def test_prefill_then_teacher_forced_decode_equals_one_prefill_and_forward(tiny):
    # 70 tokens: the chunked KDA crosses a chunk boundary (64) before the split
    assert_prefill_then_decode_matches(tiny, ids_for(TINY, 73, 1), split=68)


def test_short_prefill_shorter_than_the_conv_window_then_decode(tiny):
    assert_prefill_then_decode_matches(tiny, ids_for(TINY, 6, 2), split=2)


def test_prefill_then_decode_on_the_small_preset_with_grouped_routing():
    model = reference.load(SyntheticSource(SMALL, 4), moe_combine="biased", kv_norm_eps=1e-5)
    assert_prefill_then_decode_matches(model, ids_for(SMALL, 20, 3), split=17)


def test_decoding_from_the_empty_cache_equals_prefill(tiny):
    ids = ids_for(TINY, 5, 4)
    logits, cache = tiny.prefill(ids)
    c = tiny.empty_cache()
    for t, tok in enumerate(ids):
        step, c = tiny.decode(tok, c)
        assert rel(step, logits[t]) < 1e-12
    for (name, a), (_, b) in zip(cache_arrays(c), cache_arrays(cache), strict=True):
        assert rel(a, b) < 1e-12, name


def test_decode_never_mutates_its_input_cache(tiny):
    _, cache = tiny.prefill(ids_for(TINY, 7, 5))
    before = {n: a.copy() for n, a in cache_arrays(cache)}
    _, new = tiny.decode(3, cache)
    _, new2 = tiny.decode(3, cache)
    for n, a in cache_arrays(cache):
        np.testing.assert_array_equal(a, before[n])
        assert not a.flags.writeable
    assert cache.length == 7 and new.length == new2.length == 8
    for (_, a), (_, b) in zip(cache_arrays(new), cache_arrays(new2)):
        np.testing.assert_array_equal(a, b)


def test_logits_are_order_one_and_the_trace_has_exactly_the_contract_keys(tiny):
    ids = ids_for(TINY, 9, 6)
    trace = {}
    logits = tiny.forward(ids, trace=trace)
    assert logits.shape == (9, TINY.vocab_size) and 0.3 < logits.std() < 3
    want = {"final_norm"}
    for i in range(TINY.num_hidden_layers):
        want |= {f"layers.{i}.mixer", f"layers.{i}.ffn", f"layers.{i}.hidden"}
        if TINY.is_moe_layer(i):
            want |= {f"layers.{i}.router.scores", f"layers.{i}.router.selection", f"layers.{i}.router.ids"}
    assert set(trace) == want
    E, k = TINY.num_experts, TINY.num_experts_per_token
    for i in range(1, TINY.num_hidden_layers):
        scores, sel, ids_ = (trace[f"layers.{i}.router.{n}"] for n in ("scores", "selection", "ids"))
        assert scores.shape == sel.shape == (9, E) and ids_.shape == (9, k)
        picked = np.take_along_axis(sel, ids_, axis=1)
        assert np.all(np.diff(picked, axis=1) <= 0)  # ids ordered by descending selection score
        assert np.all(picked[:, -1:] >= np.sort(sel, axis=1)[:, -k:-k + 1])  # and they are the top k
    np.testing.assert_array_equal(trace[f"layers.{TINY.num_hidden_layers - 1}.hidden"].shape, (9, TINY.hidden_size))
    step_trace = {}
    _, cache = tiny.prefill(ids[:-1])
    tiny.decode(int(ids[-1]), cache, trace=step_trace)
    assert set(step_trace) == want and step_trace["final_norm"].shape == (1, TINY.hidden_size)


def test_a_written_checkpoint_reproduces_its_generator_bit_for_bit(tmp_path):
    ids = ids_for(TINY, 12, 7)
    expect = reference.load(SyntheticSource(TINY, 11)).forward(ids)
    single = write_fixture("tiny", tmp_path / "single", seed=11)
    sharded = write_fixture("tiny", tmp_path / "sharded", seed=11, shards=3)
    np.testing.assert_array_equal(reference.load(single).forward(ids), expect)
    np.testing.assert_array_equal(reference.load(str(sharded)).forward(ids), expect)


def test_the_bundled_default_fixture_is_tiny_seed_0():
    path = default_checkpoint_path()
    model = reference.load(path)
    assert model.config == TINY
    assert sum(f.stat().st_size for f in path.iterdir()) < 5_000_000
    ids = ids_for(TINY, 5, 8)
    np.testing.assert_array_equal(model.forward(ids), reference.load(SyntheticSource(TINY, 0)).forward(ids))


def test_moe_combine_changes_only_the_moe_outputs(tiny):
    ids = ids_for(TINY, 8, 9)
    t_u, t_b = {}, {}
    unbiased = tiny.forward(ids, trace=t_u)
    biased = reference.load(tiny.source, moe_combine="biased").forward(ids, trace=t_b)
    assert reference.load(tiny.source, moe_combine="biased").variants == {"moe_combine": "biased", "kv_norm_eps": 1e-6,
                                                                        "kda_gate": "softplus"}
    assert rel(biased, unbiased) > 1e-3
    np.testing.assert_array_equal(t_b["layers.0.hidden"], t_u["layers.0.hidden"])  # dense layer 0
    np.testing.assert_array_equal(t_b["layers.1.mixer"], t_u["layers.1.mixer"])
    np.testing.assert_array_equal(t_b["layers.1.router.ids"], t_u["layers.1.router.ids"])  # same selection
    assert rel(t_b["layers.1.ffn"], t_u["layers.1.ffn"]) > 1e-3


def test_kv_norm_eps_changes_only_from_the_first_mla_layer(tiny):
    ids = ids_for(TINY, 8, 10)
    t6, t5 = {}, {}
    a = tiny.forward(ids, trace=t6)
    b = reference.load(tiny.source, kv_norm_eps=1e-5).forward(ids, trace=t5)
    mla = next(i for i in range(TINY.num_hidden_layers) if not TINY.is_kda_layer(i))
    np.testing.assert_array_equal(t5[f"layers.{mla - 1}.hidden"], t6[f"layers.{mla - 1}.hidden"])
    assert 0 < rel(t5[f"layers.{mla}.mixer"], t6[f"layers.{mla}.mixer"]) < 1e-3
    assert 0 < rel(a, b) < 1e-3


def test_replayed_routing_changes_only_the_rows_and_layers_it_differs_at(tiny):
    """``forward(routing=...)``: the model's own choices replayed give the same logits bit for bit;
    one token's experts swapped in one layer changes that layer's ffn at that token only, and the
    logits from that token on (causal)."""
    ids = ids_for(TINY, 12, 11)
    own = {}
    logits = tiny.forward(ids, trace=own)
    layer = next(i for i in range(TINY.num_hidden_layers) if TINY.is_moe_layer(i))
    chosen = {i: own[f"layers.{i}.router.ids"] for i in range(TINY.num_hidden_layers) if TINY.is_moe_layer(i)}
    np.testing.assert_array_equal(tiny.forward(ids, routing=chosen), logits)
    swapped = chosen[layer].copy()
    unused = np.setdiff1d(np.arange(TINY.num_experts), swapped[5])
    swapped[5, -1] = unused[0]
    t = {}
    forced = tiny.forward(ids, trace=t, routing={layer: swapped})
    np.testing.assert_array_equal(t[f"layers.{layer}.router.ids"], swapped)
    # other rows only within float64 rounding: an expert's GEMM sees another set of tokens
    change = np.abs(t[f"layers.{layer}.ffn"] - own[f"layers.{layer}.ffn"]).max(-1)
    scale = np.abs(own[f"layers.{layer}.ffn"]).max()
    np.testing.assert_array_equal(change > 1e-12 * scale, np.arange(12) == 5)
    change = np.abs(forced - logits).max(-1) / np.abs(logits).max()
    np.testing.assert_array_equal(change > 1e-12, np.arange(12) >= 5)
    # the same choice forced alone: rows of -1 keep the router's own choice, the same logits
    alone = np.full_like(swapped, -1)
    alone[5] = swapped[5]
    np.testing.assert_array_equal(tiny.forward(ids, routing={layer: alone}), forced)
    np.testing.assert_array_equal(tiny.forward(ids, routing={layer: np.full_like(swapped, -1)}), logits)


@pytest.mark.parametrize("routing, match", [
    ({0: np.zeros((12, 2), dtype=np.int64)}, "is not a MoE layer index"),
    ({1: np.zeros((11, 2), dtype=np.int64)}, "expected integer ids of shape"),
    ({1: np.full((12, 2), 1.0)}, "expected integer ids of shape"),
    ({1: np.full((12, 2), -2)}, "expert ids must be in"),
    ({1: np.array([[-1, 1]] * 12)}, "expert ids must be in"),   # -1 keeps the router's own: whole rows only
    ({1: np.zeros((12, 2), dtype=np.int64)}, "names the same expert twice"),
    ([1, 2], "expected a dict"),
])
def test_bad_routing_is_named(tiny, routing, match):
    assert TINY.num_experts_per_token == 2  # the shapes above
    with pytest.raises(ValueError, match=match):
        tiny.forward(ids_for(TINY, 12, 11), routing=routing)


@pytest.mark.parametrize("kw, match", [
    ({"moe_combine": "mean"}, "moe_combine: expected one of"),
    ({"kv_norm_eps": 0.0}, "kv_norm_eps: expected a positive"),
    ({"kv_norm_eps": -1e-6}, "kv_norm_eps"),
    ({"kv_norm_eps": float("nan")}, "kv_norm_eps"),
])
def test_unknown_variants_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        reference.load(SyntheticSource(TINY, 0), **kw)


@pytest.mark.parametrize("ids, match", [
    ([1, 2, 512], r"token id 512 at position 2 is outside the vocabulary \[0, 512\)"),
    ([-1], "token id -1 at position 0"),
    ([], "non-empty 1-D"),
    ([[1, 2]], "non-empty 1-D"),
    ([1.0, 2.0], "integer token ids"),
])
def test_invalid_token_ids_are_named(tiny, ids, match):
    with pytest.raises(ValueError, match=match):
        tiny.forward(ids)
    with pytest.raises(ValueError, match=match):
        tiny.prefill(ids)


def test_decode_rejects_bad_tokens_and_foreign_caches(tiny):
    _, cache = tiny.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="token_id: token id 9999"):
        tiny.decode(9999, cache)
    with pytest.raises(ValueError, match="one integer token id"):
        tiny.decode([1, 2], cache)
    with pytest.raises(ValueError, match="expected a reference ModelCache"):
        tiny.decode(1, {"layers": []})
    bad = ModelCache(cache.layers[:3] + (MLACache(np.zeros((2, 32)), np.zeros((2, 8))),), 3)
    with pytest.raises(ValueError, match=r"cache.layers\[3\]: expected a MLACache with latent \(3, 32\)"):
        tiny.decode(1, bad)


class CountingSource(WeightSource):
    """Wraps a source and records which tensors were read."""

    def __init__(self, inner):
        self.inner, self.config, self.read = inner, inner.config, []

    def names(self):
        return self.inner.names()

    def shape(self, name):
        return self.inner.shape(name)

    def storage_dtype(self, name):
        return self.inner.storage_dtype(name)

    def get_raw(self, name):
        self.read.append(name)
        return self.inner.get_raw(name)

    def describe(self):
        return "counting " + self.inner.describe()


def test_only_the_routed_experts_are_read():
    src = CountingSource(SyntheticSource(SMALL, 0))
    trace = {}
    reference.load(src).forward([5], trace=trace)
    for i in range(1, SMALL.num_hidden_layers):
        read = {int(n.split(".")[5]) for n in src.read if n.startswith(f"model.layers.{i}.block_sparse_moe.experts.")}
        assert read == set(trace[f"layers.{i}.router.ids"][0].tolist()), i
    assert len(src.read) == len(set(src.read))  # each tensor read once
