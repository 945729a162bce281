"""``Model.decode_batch``: B sequences of any lengths, one token each, every row bit for bit the
sequence's own ``decode`` (logits, new caches, trace), on NumPy, on NumPy streaming its weights from
their storage bits, and on torch float64; over several steps; with bad arguments named.

Why the products run row by row (``reference.streamed.linear_rows``): a ``[B, D] @ W.T`` GEMM
need not give a row the bits of its own ``[1, D]`` product (a BLAS runs one row as a GEMV and
several as a GEMM, which sum in other orders). With x ``[5, D]`` and W ``[N, D]`` for (N, D) in
(16, 32), (64, 64), (256, 128), (512, 512), 3531 of the 4240 output elements differ from the
rows' own products under NumPy (OpenBLAS 0.3.31), 3078 under torch (MKL 2024.2), on a 2-core AMD
EPYC with AVX-512."""
import numpy as np
import pytest

import reference
from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path
from kimi.synthetic import SyntheticSource
from reference.batch import split_trace
from reference.cache import KDACache
from reference.executor import to_numpy
from reference.model import ModelCache
from reference.streamed import linear_rows

# ragged: a prompt shorter than the conv window, one decoded a few steps past its prefill, an
# empty cache (decode from nothing), longer prompts
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], None, [40], [3, 3, 3, 3, 3, 3, 9, 200, 17, 4, 4, 80]]
TOKENS = [11, 12, 500, 14, 1]
EXECUTORS = {"numpy": {}, "numpy-streamed": {"weight_cache_bytes": 0}, "torch": {"executor": "torch"}}


@pytest.fixture(scope="module", params=list(EXECUTORS))
def model(request):
    return reference.load(default_checkpoint_path(), **EXECUTORS[request.param])


@pytest.fixture(scope="module")
def caches(model):
    out = []
    for p in PROMPTS:
        if p is None:
            out.append(model.empty_cache())
            continue
        _, cache = model.prefill(p)
        if len(p) == 9:
            for t in (8, 7, 6):
                _, cache = model.decode(t, cache)
        out.append(cache)
    return out


def arrays_of(cache: ModelCache):
    for lc in cache.layers:
        names = ("conv_q", "conv_k", "conv_v", "state") if isinstance(lc, KDACache) else ("latent", "k_pe")
        yield from (to_numpy(getattr(lc, n)) for n in names)


def assert_same_bits(a, b, what):
    a, b = to_numpy(a), to_numpy(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
    assert np.array_equal(a, b), f"{what}: {np.count_nonzero(a != b)} of {a.size} elements differ"


def assert_cache_bits(got: ModelCache, want: ModelCache, what):
    assert got.length == want.length, what
    for k, (a, b) in enumerate(zip(arrays_of(got), arrays_of(want), strict=True)):
        assert_same_bits(a, b, f"{what} array {k}")


@pytest.mark.parametrize("B", [1, 2, 5])
def test_each_row_of_a_batch_is_bit_for_bit_the_sequences_own_decode(model, caches, B):
    model.trace_kda_core = True  # the KDA core's entries split too
    try:
        trace = {}
        logits, new = model.decode_batch(TOKENS[:B], caches[:B], trace=trace)
        assert tuple(logits.shape) == (B, model.config.vocab_size) and len(new) == B
        for b, (tr, token, cache) in enumerate(zip(split_trace(trace, B), TOKENS, caches[:B])):
            own = {}
            want, want_cache = model.decode(token, cache, trace=own)
            assert_same_bits(logits[b], want, f"row {b} logits")
            assert_cache_bits(new[b], want_cache, f"row {b} cache")
            assert sorted(tr) == sorted(own)
            for key in own:
                assert_same_bits(tr[key], own[key], f"row {b} trace {key}")
    finally:
        model.trace_kda_core = False


def test_a_batch_decoded_for_several_steps_stays_bit_for_bit_each_sequences_own_run(model, caches):
    batch, alone = list(caches), list(caches)
    tokens = list(TOKENS)
    for step in range(3):
        logits, batch = model.decode_batch(tokens, batch)
        for b in range(len(caches)):
            want, alone[b] = model.decode(tokens[b], alone[b])
            assert_same_bits(logits[b], want, f"step {step} row {b}")
            assert_cache_bits(batch[b], alone[b], f"step {step} row {b}")
        tokens = [int(np.argmax(to_numpy(row))) for row in logits]


def test_a_batch_leaves_its_caches_untouched_and_may_hold_one_cache_twice(model, caches):
    before = [[a.copy() for a in arrays_of(c)] for c in caches[:2]]
    logits, _ = model.decode_batch([TOKENS[0], TOKENS[0], TOKENS[1]], [caches[0], caches[0], caches[1]])
    assert_same_bits(logits[0], logits[1], "the same sequence twice")
    for c, saved in zip(caches[:2], before):
        for a, b in zip(arrays_of(c), saved, strict=True):
            assert np.array_equal(a, b)


def test_grouped_routing_batches_bit_for_bit_on_the_small_preset():
    model = reference.load(SyntheticSource(KimiConfig.from_name("small"), 0))
    caches = [model.prefill(p)[1] for p in ([5, 6, 7, 8], [9], [100, 3, 2, 1, 0, 7, 7])]
    logits, new = model.decode_batch([1, 2, 3], caches)
    for b, (token, cache) in enumerate(zip([1, 2, 3], caches)):
        want, want_cache = model.decode(token, cache)
        assert_same_bits(logits[b], want, f"row {b}")
        assert_cache_bits(new[b], want_cache, f"row {b}")


def _riders(model, n: int, seed: int = 0) -> dict:
    """A rider on every layer: ``n`` rows of a stream and, in MoE layers, expert ids of their own."""
    from reference.batch import Rider

    c, rng = model.config, np.random.default_rng(seed)
    return {i: Rider(mid=rng.standard_normal((n, c.hidden_size)),
                     ids=np.stack([rng.choice(c.num_experts, c.num_experts_per_token, replace=False) for _ in range(n)])
                     if c.is_moe_layer(i) else None)
            for i in range(c.num_hidden_layers)}


def test_riders_leave_the_batchs_bits_and_get_the_ffn_of_their_own_expert_ids(model, caches):
    # each layer's FFN runs the batch's rows and the riders' in one call: the batch's rows keep
    # their bits (row by row), the riders' outputs are the layer's FFN on their own ids
    want, want_new = model.decode_batch(TOKENS, caches)
    riders = _riders(model, 2)
    got, got_new = model.decode_batch(TOKENS, caches, riders=riders)
    assert_same_bits(got, want, "the batch's logits beside riders")
    for b in range(len(caches)):
        assert_cache_bits(got_new[b], want_new[b], f"row {b} cache beside riders")
    with model.row_by_row():
        for i, r in riders.items():
            routing = None if r.ids is None else model.executor.ints(r.ids)
            assert_same_bits(r.out, model.ffn(i, model.executor.asarray(r.mid), routing=routing), f"layer {i} rider")


def test_riders_of_a_prefill_leave_its_bits_and_get_the_ffn_of_their_own_expert_ids(model):
    # a prefill's products are whole GEMMs: where rows are bitwise each rider runs as its own call
    prompt = PROMPTS[-1]
    want, want_cache = model.prefill(prompt)
    riders = _riders(model, 4, seed=2)
    got, got_cache = model.prefill(prompt, riders=riders)
    assert_same_bits(got, want, "the prefill's logits beside riders")
    assert_cache_bits(got_cache, want_cache, "the prefill's cache beside riders")
    for i, r in riders.items():
        routing = None if r.ids is None else model.executor.ints(r.ids)
        assert_same_bits(r.out, model.ffn(i, model.executor.asarray(r.mid), routing=routing), f"layer {i} rider")


@pytest.mark.parametrize("call", ["decode_batch", "prefill"])
def test_where_rows_need_not_be_bitwise_riders_agree_with_their_own_ffn_to_1e_12(call, parity_device):
    src, views = _shared_small(parity_device)
    model = reference.load(src, executor="torch", device=parity_device, shared_weights=views)
    model.bitwise_rows = False
    caches = [model.prefill(p)[1] for p in ([5, 6, 7, 8], [9])]
    run = (lambda **kw: model.decode_batch([1, 2], caches, **kw)) if call == "decode_batch" else \
        (lambda **kw: model.prefill([5, 6, 7, 8, 9, 10], **kw))
    want, _ = run()
    riders = _riders(model, 3, seed=1)
    got, _ = run(riders=riders)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=0, atol=1e-12 * float(np.abs(to_numpy(want)).max()))
    for i, r in riders.items():
        routing = None if r.ids is None else model.executor.ints(r.ids)
        own = to_numpy(model.ffn(i, model.executor.asarray(r.mid), routing=routing))
        np.testing.assert_allclose(to_numpy(r.out), own, rtol=0, atol=1e-12 * float(np.abs(own).max()))


def test_bad_riders_are_named(caches):
    from reference.batch import Rider

    model = reference.load(default_checkpoint_path())
    moe_layer = next(i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i))
    D, k = model.config.hidden_size, model.config.num_experts_per_token
    cases = [({99: Rider(np.zeros((1, D)))}, r"riders\[99\]: expected a Rider of a layer"),
             ({0: Rider(np.zeros((1, D + 1)))}, r"riders\[0\]: mid of shape \(1, %d\)" % (D + 1)),
             ({moe_layer: Rider(np.zeros((1, D)))}, "needs integer expert ids"),
             ({moe_layer: Rider(np.zeros((1, D)), np.full((1, k), 10**6))}, "needs integer expert ids")]
    for riders, match in cases:
        with pytest.raises(ValueError, match=match):
            model.decode_batch([1], caches[:1], riders=riders)


def test_bad_batches_are_named(caches):
    model = reference.load(default_checkpoint_path())
    _, cache = model.prefill([1, 2])
    cases = [(([1, 2], [cache]), "2 token ids for 1 caches"),
             (([], []), "non-empty 1-D sequence of token ids"),
             (([1, 9999], [cache, cache]), "token id 9999 at position 1"),
             (([1, 2], [cache, {"layers": []}]), r"caches\[1\]: cache: expected a reference ModelCache"),
             (([1], cache), "expected a sequence of B reference ModelCaches"),
             (([1.5], [cache]), "integer token ids")]
    for (ids, cs), match in cases:
        with pytest.raises(ValueError, match=match):
            model.decode_batch(ids, cs)


def test_a_batch_step_is_estimated_as_b_tokens_after_the_longest_cache_plus_every_new_mla_cache():
    from reference.memory import call_bytes, step_bytes

    c = KimiConfig.from_name("tiny")
    assert step_bytes(c, [7]) == call_bytes(c, 1, cached=7)
    one_mla_row = 1 * (c.kv_lora_rank + c.qk_rope_head_dim) * 8  # the tiny preset has one MLA layer
    # the new caches hold 8 + 4 positions; a call on 2 tokens after 7 counts 9 of them
    assert step_bytes(c, [7, 3]) == call_bytes(c, 2, cached=7) + 3 * one_mla_row


def test_a_trace_that_is_not_b_sequences_entries_does_not_split():
    with pytest.raises(ValueError, match=r"trace x: \(3, 4\) is not 2 sequences' entries"):
        split_trace({"x": np.zeros((3, 4))}, 2)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_row_by_row_products_give_each_row_its_own_bits(library):
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((48, 64)), rng.standard_normal((5, 64))
    if library == "torch":
        import torch

        w, x = torch.from_numpy(w), torch.from_numpy(x)
    rows = linear_rows(x, w)
    for t in range(5):
        assert_same_bits(rows[t:t + 1], x[t:t + 1] @ w.T, f"row {t}")


def _shared_small(device):
    """The small preset's source and the optimized model's resident bf16 weights on ``device``."""
    import optimized
    from optimized.weights import named_views

    src = SyntheticSource(KimiConfig.from_name("small"), 0)
    return src, named_views(optimized.load(src, device=device, dtype="bfloat16").weights, src.config)


def test_where_rows_need_not_be_bitwise_a_batch_runs_as_one_within_1e_12_of_each_decode(monkeypatch, parity_device):
    # bitwise_rows False is a GPU's default (its kernels depend on shapes anyway): the B rows'
    # products, the B sequences' stacked KDA states and the routed experts gathered in groups
    from reference import moe

    src, views = _shared_small(parity_device)
    exact = reference.load(src, executor="torch", device=parity_device)
    model = reference.load(src, executor="torch", device=parity_device, shared_weights=views)
    model.bitwise_rows = False
    groups = []
    real = moe.experts
    monkeypatch.setattr(moe, "experts", lambda *a, group=None: groups.append(group) or real(*a, group=group))
    caches = [exact.prefill(p)[1] for p in ([5, 6, 7, 8], [9], [100, 3, 2, 1, 0, 7, 7])]
    tokens = [1, 2, 3]
    model.trace_kda_core = exact.trace_kda_core = True
    trace = {}
    logits, new = model.decode_batch(tokens, caches, trace=trace)
    assert groups and set(groups) == {model.expert_group} and model.expert_group > 1
    for b, (tr, token, cache) in enumerate(zip(split_trace(trace, 3), tokens, caches)):
        own = {}
        want, want_cache = exact.decode(token, cache, trace=own)
        scale = float(np.abs(to_numpy(want)).max())
        np.testing.assert_allclose(to_numpy(logits[b]), to_numpy(want), rtol=0, atol=1e-12 * scale)
        for got, ref in zip(arrays_of(new[b]), arrays_of(want_cache), strict=True):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12 * max(1.0, float(np.abs(ref).max())))
        assert sorted(tr) == sorted(own)
        for key in own:
            assert tuple(tr[key].shape) == tuple(own[key].shape), key
    groups.clear()
    model.bitwise_rows = True
    model.decode_batch(tokens, caches)
    assert set(groups) == {None}  # row by row: one expert at a time, each row its own products


def test_shared_weights_are_checked_finite_once_and_a_non_finite_expert_is_named(parity_device):
    import torch

    from kimi.checkpoint import CheckpointError

    src, views = _shared_small(parity_device)
    model = reference.load(src, executor="torch", device=parity_device, shared_weights=views)
    model.bitwise_rows = False
    _, cache = model.prefill([5, 6, 7])
    before = set(model._w.checked)
    assert any(".experts." in n for n in before) and "model.norm.weight" in before

    class Queue(list):
        def append(self, entry):
            queued.extend(entry[0])
            super().append(entry)

    queued, model._w.pending = [], Queue()
    model._w._lru.clear()  # every weight fetched again: none of those checked is summed again
    model.decode(1, cache)
    assert queued and not set(queued) & before
    bad = {n: (torch.full_like(t, float("nan")) if ".experts." in n and n.endswith("w1.weight") else t)
           for n, t in views.items()}
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.w1\.weight.*non-finite"):
        reference.load(src, executor="torch", device=parity_device, shared_weights=bad).forward([5, 6, 7])
