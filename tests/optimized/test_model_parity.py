"""The optimized model (optimized.load) against the float64 reference model, on CPU.

Logits are judged against parity.bounds.model's logit bound (derived from the arithmetic: every op
on the deepest path rounds once and accumulates in its arithmetic dtype; docs/error-bounds.md),
never a fixed tolerance; router flips are judged by parity.diff.router (a flip must be a near-tie),
then the reference replays the optimized run's expert choices. Measured at fp32 the worst logit sits
at ~0.05 of the bound, at bf16 ~0.2; a wrong op misses it by orders of magnitude.

CPU time is dear (the Triton interpreter): short prompts, 8 decode steps at bf16 (the GPU tests run
64), module-scoped runs shared by the tests that read them.
"""
import copy

import numpy as np
import pytest
import torch

import optimized
import reference
from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path
from kimi.synthetic import SyntheticSource
from optimized import _counters
from optimized.backends import FAMILIES
from parity.bounds.core import precision_for
from parity.bounds.model import hidden_rel_bound, logit_bound
from parity.diff.replay import Replay
from parity.metrics import compare
from parity.platform import store_rounding

TINY = KimiConfig.from_name("tiny")
SMALL = KimiConfig.from_name("small")
PROMPT = [1, 17, 300, 42, 5, 99, 256, 7]
BF16_STEPS = 8


def assert_within(opt, ref, bound, what: str) -> float:
    """Every element within its bound; finite; not degenerate (parity.metrics.compare). Returns the
    worst error / bound."""
    c = compare(what, ref, opt, bound)
    assert c.passed, c.report()
    return c.ratio


def lm_head_weight(source) -> np.ndarray:
    c = source.config
    return source.get("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")


def check_logits(config, source, opt, ref, ref_final_norm, positions, dtype, what):
    bound = logit_bound(config, np.asarray(positions) + 1, np.atleast_2d(ref_final_norm),
                        lm_head_weight(source), dtype)
    return assert_within(torch.as_tensor(opt).reshape(bound.shape), np.atleast_2d(ref), bound, what)


# -- shared runs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_source():
    return SyntheticSource(TINY, 0)


@pytest.fixture(scope="module")
def bf16_run(tiny_source):
    """Prefill PROMPT then BF16_STEPS greedy decode steps at bf16 (tokens, logits, the model)."""
    model = optimized.load(tiny_source, dtype="bfloat16")
    logits, cache = model.prefill(PROMPT)
    steps = [logits[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(BF16_STEPS - 1):
        step, cache = model.decode(tokens[-1], cache)
        steps.append(step)
        tokens.append(int(step.argmax()))
    return {"model": model, "prefill": logits, "steps": torch.stack(steps), "tokens": tokens, "cache": cache}


# -- weights -------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_device_generator_equals_the_numpy_synthetic_source_bit_for_bit(preset, parity_device):
    from optimized.synthetic import DeviceGenerator
    from optimized.weights import raw_to_torch

    source = SyntheticSource(KimiConfig.from_name(preset), seed=12345)
    gen = DeviceGenerator(source, parity_device)
    for name in source.names():
        want = raw_to_torch(source.get_raw(name), source.storage_dtype(name))
        got = gen(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits).cpu(), want.view(bits)), name


def test_bundled_checkpoint_is_resident_bit_for_bit_as_its_synthetic_source(parity_device):
    from optimized.weights import load_weights

    from kimi.checkpoint import open_source

    a = load_weights(open_source(default_checkpoint_path()), device=torch.device(parity_device), dtype=torch.bfloat16)
    b = load_weights(SyntheticSource(TINY, 0), device=torch.device(parity_device), dtype=torch.bfloat16)
    ta, tb = [], []
    for w, out in ((a, ta), (b, tb)):
        def walk(obj, out=out):
            if isinstance(obj, torch.Tensor):
                out.append(obj)
            elif isinstance(obj, list):
                for o in obj:
                    walk(o)
            elif hasattr(obj, "__dataclass_fields__"):
                for f in obj.__dataclass_fields__:
                    walk(getattr(obj, f))
        walk(w)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and torch.equal(x, y)
    # the small fp32 parameters stay fp32 in a bf16 model; experts are stacked [E, F, D] / [E, D, F]
    moe = a.layers[1].ffn
    assert moe.bias.dtype == moe.router.dtype == a.layers[0].mixer.A_log.dtype == torch.float32
    E, F, D = TINY.num_experts, TINY.moe_intermediate_size, TINY.hidden_size
    assert moe.w1.shape == moe.w3.shape == (E, F, D) and moe.w2.shape == (E, D, F)


# -- float32: tight parity with the reference --------------------------------------------------------

def _float32_parity(source, *, decode_steps: int, forward: bool = True, split: int | None = None):
    """forward (optional), prefill (in two parts when ``split``: the second continues the cache)
    and ``decode_steps`` decode steps, each against the reference within the float32 bound; then
    the carried state against the reference cache."""
    config = source.config
    ref = reference.load(source)
    model = optimized.load(source, dtype="float32")
    assert model.variants["dtype"] == "float32"
    ids = PROMPT + [3, 77, 501][:decode_steps]
    T0 = len(PROMPT)
    trace = {}
    ref_full = ref.forward(ids, trace=trace)
    positions = np.arange(len(ids))
    worst = {}
    opt_trace = {}
    if forward:
        worst["forward"] = check_logits(config, source, model.forward(ids, trace=opt_trace), ref_full,
                                        trace["final_norm"], positions, "float32", "forward")
        assert set(opt_trace) == set(trace)
    if split:
        first, cache = model.prefill(PROMPT[:split])
        rest, cache = model.prefill(PROMPT[split:], cache=cache)
        logits = torch.cat([first, rest])
    else:
        logits, cache = model.prefill(PROMPT)
    assert logits.dtype == torch.float32 and logits.shape == (T0, config.vocab_size)
    worst["prefill"] = check_logits(config, source, logits, ref_full[:T0], trace["final_norm"][:T0],
                                    positions[:T0], "float32", "prefill")
    ref_logits, ref_cache = ref.prefill(PROMPT)
    for t in range(T0, len(ids)):
        step_trace = {}
        step, cache = model.decode(ids[t], cache)
        ref_step, ref_cache = ref.decode(ids[t], ref_cache, trace=step_trace)
        assert step.shape == (config.vocab_size,)
        worst[f"decode {t}"] = check_logits(config, source, step, ref_step, step_trace["final_norm"],
                                            [t], "float32", f"decode at position {t}")
    # the carried state (KDA, conv, MLA latents) converts to the reference layout and agrees
    bound = hidden_rel_bound(config, len(ids), "float32")
    got = cache.to_reference()
    assert got.length == ref_cache.length == len(ids)
    for i, (a, b) in enumerate(zip(got.layers, ref_cache.layers)):
        for name in ("conv_q", "conv_k", "conv_v", "state", "latent", "k_pe"):
            if hasattr(b, name):
                x, y = getattr(a, name), getattr(b, name)
                assert x.shape == y.shape, (i, name)
                assert np.abs(x - y).max() <= bound * max(np.abs(y).max(), 1e-300), (i, name)
    return worst


def test_float32_bundled_checkpoint_matches_the_reference_forward_prefill_and_decode():
    from kimi.checkpoint import open_source

    # prefill in two parts: the second continues the first's cache (chunked prefill)
    worst = _float32_parity(open_source(default_checkpoint_path()), decode_steps=2, split=5)
    assert max(worst.values()) < 1.0, worst


def test_float32_small_preset_matches_the_reference():
    # grouped routing (4 groups, keep 2), MLA in the middle of the stack, 6 layers
    worst = _float32_parity(SyntheticSource(SMALL, 3), decode_steps=1, forward=False)
    assert max(worst.values()) < 1.0, worst


def test_float64_matches_the_reference_to_the_float64_bound(tiny_source):
    # every kernel runs in float64 too (Triton fp64 arithmetic and tl.dot): the lifted model run
    ref, model = reference.load(tiny_source), optimized.load(tiny_source, dtype="float64")
    ids = PROMPT[:5]
    trace = {}
    want = ref.forward(ids, trace=trace)
    logits, cache = model.prefill(ids[:4])
    assert logits.dtype == torch.float64
    step, cache = model.decode(ids[4], cache)
    check_logits(TINY, tiny_source, torch.cat([logits, step[None]]), want, trace["final_norm"],
                 np.arange(5), "float64", "float64 prefill + decode")


# -- bf16: incremental == recompute, bound vs reference, bytes -----------------------------------------

def check_greedy_agrees_with_recompute(config, source, prompt, tokens, recompute_logits) -> list[int]:
    """The recompute path (one forward over prompt + tokens[:-1]) picks the incremental path's greedy
    token at every step, except at near-ties: two bf16 paths that each round differently can split
    an (often exact, in bf16) tie at the top. A split is benign only if the reference margin between
    the two tokens is within the sum of their logit bounds (either path may then pick either token);
    anything wider is a bug. Returns the split steps."""
    ids = list(prompt) + list(tokens[:-1])
    S0 = len(prompt) - 1
    recompute = recompute_logits[S0:].argmax(-1).tolist()
    split = [s for s, (a, b) in enumerate(zip(tokens, recompute)) if a != b]
    if not split:
        return split
    trace = {}
    ref = np.asarray(reference.load(source).forward(ids, trace=trace))
    bound = logit_bound(config, np.array(split) + S0 + 1, np.asarray(trace["final_norm"])[np.array(split) + S0],
                        lm_head_weight(source), "bfloat16")
    for k, s in enumerate(split):
        a, b = tokens[s], recompute[s]
        margin, flip = abs(ref[S0 + s, a] - ref[S0 + s, b]), bound[k, a] + bound[k, b]
        assert margin <= flip, (f"step {s}: incremental token {a}, recompute token {b}, reference margin "
                                f"{margin:.4g} past the flip bound {flip:.4g}: not a near-tie")
    return split


def test_bf16_greedy_decode_equals_the_recompute_path_token_for_token(bf16_run, tiny_source):
    # the recompute path: one forward over the whole generated sequence; row p predicts token p+1
    model, tokens = bf16_run["model"], bf16_run["tokens"]
    full = model.forward(PROMPT + tokens[:-1])
    check_greedy_agrees_with_recompute(TINY, tiny_source, PROMPT, tokens, full)


def test_the_recompute_check_accepts_a_near_tie_split_and_rejects_a_wide_one(tiny_source):
    model, tokens, S0 = reference.load(tiny_source), [], len(PROMPT) - 1
    for _ in range(3):  # the reference's own greedy tokens: its rows pick them (causal: later ids don't matter)
        ref = torch.as_tensor(np.asarray(model.forward(PROMPT + tokens)))
        tokens.append(int(ref[-1].argmax()))
    assert check_greedy_agrees_with_recompute(TINY, tiny_source, PROMPT, tokens, ref) == []
    tied, wide = ref.clone(), ref.clone()
    second = int(ref[S0 + 1].topk(2).indices[1])
    tied[S0 + 1, second] = ref[S0 + 1].max() + 1e-3  # the runner-up, nudged past the top
    assert check_greedy_agrees_with_recompute(TINY, tiny_source, PROMPT, tokens, tied) == [1]
    wide[S0 + 1, int(ref[S0 + 1].argmin())] = ref[S0 + 1].max() + 1e-3  # the worst token
    with pytest.raises(AssertionError, match="not a near-tie"):
        check_greedy_agrees_with_recompute(TINY, tiny_source, PROMPT, tokens, wide)


def traced_rerun(model, prompt, tokens, prefill_logits, steps) -> dict:
    """The router decisions behind a prefill + greedy decode run, one row per position: the run
    again, traced, reproducing the given logits bit for bit (run to run deterministic; a traced
    decode runs eagerly, and graph replay == eager is tested in test_model_graphs). Not a forward
    over the whole sequence: its GEMMs see other row counts, and on a GPU their rounding, so its
    router can split a near-tie the checked run did not (seen on the H200)."""
    pt = {}
    logits, cache = model.prefill(prompt, trace=pt)
    assert torch.equal(logits, prefill_logits), "the traced rerun of the prefill differs"
    rows = {key: [val] for key, val in pt.items() if key.startswith("layers.")}  # the replay reads them all
    for s, token in enumerate(tokens[:-1]):
        st = {}
        step, cache = model.decode(token, cache, trace=st)
        assert torch.equal(step, steps[s + 1]), f"the traced rerun of decode step {s + 1} differs"
        for key in rows:
            rows[key].append(st[key][:1])
    return {key: torch.cat(val) for key, val in rows.items()}


def check_bf16_run(config, source, prompt, tokens, prefill_logits, steps, chosen):
    """Logits of a bf16 prefill + greedy decode within the bound of the reference at every row. A
    router top-k flip is a discontinuity no smooth bound covers: each flip must be a near-tie
    (parity.diff.router: the margin of the float64 router, replayed on the optimized run's own
    input, between the swapped experts within its derived noise bound); then the reference replays the optimized run's expert choices (``chosen``, from
    ``traced_rerun``) so what is left between the two, at every row, is smooth arithmetic error."""
    ids = list(prompt) + list(tokens[:-1])
    trace = {}
    ref_model = reference.load(source)
    ref = ref_model.forward(ids, trace=trace)
    p = precision_for("bfloat16", rounding=store_rounding("bfloat16", next(iter(chosen.values())).device.type))
    flips = Replay(ref_model, config, u=p.u, ua=p.ua).add(ids, chosen).flips  # on the engine's own inputs
    for f in flips:
        assert f.within_noise, f"router flip {f.describe()}: not within the selection noise"
    if flips:
        trace = {}
        routing = {i: chosen[f"layers.{i}.router.ids"].cpu().numpy() for i in range(config.num_hidden_layers)
                   if config.is_moe_layer(i)}
        ref = ref_model.forward(ids, trace=trace, routing=routing)
    T0, S0 = len(prompt), len(prompt) - 1
    check_logits(config, source, prefill_logits.cpu(), ref[:T0], trace["final_norm"][:T0],
                 np.arange(T0), "bfloat16", "bf16 prefill")
    check_logits(config, source, steps.cpu(), ref[S0:], trace["final_norm"][S0:],
                 np.arange(S0, len(ids)), "bfloat16", "bf16 decode steps")
    return flips


@pytest.fixture(scope="module")
def bf16_chosen(bf16_run):
    """The router decisions behind bf16_run."""
    return traced_rerun(bf16_run["model"], PROMPT, bf16_run["tokens"], bf16_run["prefill"], bf16_run["steps"])


def test_bf16_logits_stay_within_the_bf16_bound_of_the_reference(bf16_run, bf16_chosen, tiny_source):
    check_bf16_run(TINY, tiny_source, PROMPT, bf16_run["tokens"], bf16_run["prefill"], bf16_run["steps"],
                   bf16_chosen)


@pytest.mark.parametrize("mutant", ["step_off_by_one", "prefill_row_off_by_one", "sign", "zeros", "nan",
                                    "wide_router_flip"])
def test_the_bf16_check_fails_on_wrong_logits_and_on_a_router_flip_past_a_tie(bf16_run, bf16_chosen,
                                                                               tiny_source, mutant):
    """The model-level bound is a worst-case forward analysis (0.14 relative through the tiny preset's
    four bf16 layers; measured errors sit near 1% of it): it catches a row from the wrong position
    (about 5 bound units), a sign or a scale off by more than about 30%, not a 5% scale error (0.18
    units; the per-op certificates hold each op to its own, far tighter, bound)."""
    prefill, steps = bf16_run["prefill"].clone(), bf16_run["steps"].clone()
    chosen = {key: val.clone() for key, val in bf16_chosen.items()}
    if mutant == "step_off_by_one":
        steps[5] = steps[6]
    elif mutant == "prefill_row_off_by_one":
        prefill[3] = prefill[4]
    elif mutant == "sign":
        steps[7] = -steps[7]
    elif mutant == "zeros":
        steps.zero_()
    elif mutant == "nan":
        steps[5, 7] = float("nan")
    else:  # the expert the reference ranks last at position 3 of the first MoE layer, in place of its first
        layer = next(i for i in range(TINY.num_hidden_layers) if TINY.is_moe_layer(i))
        trace = {}
        reference.load(tiny_source).forward(PROMPT, trace=trace)
        ids = chosen[f"layers.{layer}.router.ids"]
        ids[3, 0] = int(np.argmin(trace[f"layers.{layer}.router.selection"][3]))
    with pytest.raises(AssertionError, match="past the bound|non-finite|degenerate|not within the selection noise"):
        check_bf16_run(TINY, tiny_source, PROMPT, bf16_run["tokens"], prefill, steps, chosen)


def test_bf16_run_to_run_outputs_are_bitwise_identical(bf16_run, tiny_source):
    model = optimized.load(tiny_source, dtype="bfloat16")
    logits, cache = model.prefill(PROMPT)
    assert torch.equal(logits, bf16_run["prefill"])
    for k in range(2):
        step, cache = model.decode(bf16_run["tokens"][k], cache)
        assert torch.equal(step, bf16_run["steps"][k + 1]), k


def test_a_prefill_that_grows_the_paged_cache_decodes_as_one_that_fits(bf16_run):
    """70 prompt tokens outgrow a fresh pool's 4 blocks of 16 inside the prefill: the first MLA
    layer's rows must land in the grown store (they once went to the replaced one, past its end),
    so the next decode step equals, bit for bit, that of a pool that never grew."""
    model = bf16_run["model"]
    prompt = (PROMPT * 9)[:70]
    grown, fits = model.new_pool(1, block_size=16), model.new_pool(1, block_size=16, num_blocks=8)
    caches = {i: c for i, c in grown.mla.items()}
    blocks0 = grown.num_blocks
    a = model.prefill(prompt, cache=grown.new_sequence())[1]
    b = model.prefill(prompt, cache=fits.new_sequence())[1]
    assert grown.num_blocks > blocks0 and all(grown.mla[i] is c for i, c in caches.items())
    for i in grown.mla:
        assert torch.equal(grown.mla_gather(i, a, 70)[0], fits.mla_gather(i, b, 70)[0]), i
    assert torch.equal(model.decode(5, a)[0], model.decode(5, b)[0])


def test_bf16_decode_of_a_sequence_is_bitwise_the_same_alone_or_batched(bf16_run):
    """The logits, the traces (each sequence's rows: ``reference.batch.split_trace``) and the
    states after the steps."""
    from reference.batch import split_trace

    model = bf16_run["model"]
    # four: a whole CPU tile, where torch's sigmoid of the router scores runs in vector lanes
    prompts = [PROMPT[:5], [9, 8, 7], [300], PROMPT[2:9]]
    pool = model.new_pool(len(prompts))
    seqs = [model.prefill(p, cache=pool.new_sequence())[1] for p in prompts]
    pool_alone, seqs_alone = copy.deepcopy((pool, seqs))
    nxt = [[11, 400], [23, 5], [1, 2], [70, 71]]
    batched, traces = [], []
    for k in range(2):
        traces.append({})
        logits, _ = model.decode_batch([n[k] for n in nxt], seqs, trace=traces[-1])
        batched.append(logits)
    for b, seq in enumerate(seqs_alone):
        for k in range(2):
            own = {}
            alone, _ = model.decode(nxt[b][k], seq, trace=own)
            assert torch.equal(alone, batched[k][b]), (b, k)
            rows = split_trace(traces[k], len(prompts))[b]
            assert sorted(rows) == sorted(own) and all(torch.equal(rows[n], own[n]) for n in own), (b, k)
    # and the pools hold the same states afterwards
    for i in pool.kda:
        assert torch.equal(pool.kda[i].state, pool_alone.kda[i].state)
        assert torch.equal(pool.kda[i].conv, pool_alone.kda[i].conv)
    for b in range(len(prompts)):
        for i in pool.mla:
            a = pool.mla_gather(i, seqs[b], seqs[b].length)
            z = pool_alone.mla_gather(i, seqs_alone[b], seqs_alone[b].length)
            assert torch.equal(a[0], z[0]) and torch.equal(a[1], z[1])


def test_greedy_gives_the_tokens_and_states_of_the_decode_batch_loop(bf16_run):
    """``greedy`` (inputs built up front, argmax fed back on the device) against ``decode_batch``
    called step by step with the argmax read back: same tokens, same carried state, and the next
    step's logits bitwise equal; its positions reserved up front grow a small pool."""
    model = bf16_run["model"]
    pool = model.new_pool(2, block_size=1)  # 8 blocks of 1: the prompts fill it, greedy must grow it
    seqs = [model.prefill(p, cache=pool.new_sequence())[1] for p in (PROMPT[:5], [9, 8, 7])]
    pool_loop, seqs_loop = copy.deepcopy((pool, seqs))
    first, steps = [11, 23], 3
    blocks0 = pool.num_blocks
    got = model.greedy(first, seqs, steps)
    assert got.shape == (2, steps) and got.dtype == torch.int64 and pool.num_blocks > blocks0
    want, toks = [], first
    for _ in range(steps):
        logits, _ = model.decode_batch(toks, seqs_loop)
        toks = logits.argmax(-1).tolist()
        want.append(toks)
    assert got.T.tolist() == want
    assert [s.length for s in seqs] == [s.length for s in seqs_loop] == [5 + steps, 3 + steps]
    nxt = got[:, -1].tolist()
    a, _ = model.decode_batch(nxt, seqs)
    b, _ = model.decode_batch(nxt, seqs_loop)
    assert torch.equal(a, b)
    for i in pool.kda:
        assert torch.equal(pool.kda[i].state, pool_loop.kda[i].state)
        assert torch.equal(pool.kda[i].conv, pool_loop.kda[i].conv)


def test_greedy_refuses_bad_arguments_by_name(bf16_run):
    model = bf16_run["model"]
    seq = model.prefill([1, 2, 3])[1]
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        model.greedy([4], [seq], 0)
    with pytest.raises(ValueError, match="2 token ids for 1 caches"):
        model.greedy([4, 5], [seq], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.greedy([TINY.vocab_size], [seq], 2)
    assert seq.length == 3  # nothing ran


# -- the backend switch ------------------------------------------------------------------------------

TRITON_OPS = {  # the kernels each family runs in a forward + decode (optimized._counters names)
    "embed": ["embed.embedding", "embed.lm_head"],
    "norm": ["norm.rms_norm", "norm.add_rms_norm", "norm.gated_rms_norm"],
    "conv": ["conv.short_conv", "conv.short_conv_step_"],
    "kda": ["kda.fused_chunked", "kda.fused_recurrent_decode"],
    "mla": ["mla.naive", "mla.paged_decode", "mla.PagedLatentCache.write"],
    "moe": ["moe.router_logits", "moe.router", "moe.experts", "moe.swiglu"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_backend_switch_runs_the_reference_for_one_family_and_the_kernels_for_the_rest(family, tiny_source):
    model = optimized.load(tiny_source, dtype="float32", backends={family: "reference"})
    assert model.variants["backends"][family] == "reference"
    assert all(v == "triton" for f, v in model.variants["backends"].items() if f != family)
    _counters.reset()
    ids = PROMPT[:3]
    logits, cache = model.prefill(ids)
    step, cache = model.decode(4, cache)
    ran = _counters.snapshot()
    for f, names in TRITON_OPS.items():
        for name in names:
            if f == family:
                assert ran[name] == 0, f"{name} ran although {family} is swapped to the reference"
            else:
                assert ran[name] > 0, f"{name} did not run"
    assert any(k.startswith(f"reference.{family}.") and v > 0 for k, v in ran.items()), ran
    # the swapped model still computes the model: within the float32 bound of the reference
    ref = reference.load(tiny_source)
    trace = {}
    want = ref.forward(ids + [4], trace=trace)
    check_logits(TINY, tiny_source, logits, want[:3], trace["final_norm"][:3], np.arange(3), "float32",
                 f"prefill with {family}=reference")
    check_logits(TINY, tiny_source, step, want[3], trace["final_norm"][3], [3], "float32",
                 f"decode with {family}=reference")


# -- variants, errors -----------------------------------------------------------------------------

def test_variants_report_what_ran(tiny_source, parity_device):
    model = optimized.load(tiny_source, device=parity_device, dtype="float32", moe_combine="biased", kv_norm_eps=1e-5)
    v = model.variants
    assert v["moe_combine"] == "biased" and v["kv_norm_eps"] == 1e-5
    assert v["dtype"] == "float32"
    assert v["device"] == parity_device
    assert v["backends"] == {f: "triton" for f in FAMILIES}
    assert model.config == TINY


def test_token_ids_outside_the_vocabulary_are_refused_with_the_id_and_position(bf16_run):
    model, cache = bf16_run["model"], bf16_run["cache"]
    V = TINY.vocab_size
    for call in (lambda: model.forward([1, V, 2]), lambda: model.prefill([1, 2, -1])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            call()
    length = cache.length
    with pytest.raises(ValueError, match=f"token id {V} is outside the vocabulary"):
        model.decode(V, cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.decode_batch([V + 5], [cache])
    assert cache.length == length  # nothing ran
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.forward([])
    with pytest.raises(ValueError, match="integer"):
        model.forward([1.5, 2.0])
    with pytest.raises(ValueError, match="one integer token id"):
        model.decode([1, 2], cache)


def test_bad_load_arguments_are_named(tiny_source):
    with pytest.raises(ValueError, match="unknown op family 'attention'"):
        optimized.load(tiny_source, backends={"attention": "reference"})
    with pytest.raises(ValueError, match=r"backends\['kda'\]: unknown backend 'cuda'"):
        optimized.load(tiny_source, backends={"kda": "cuda"})
    with pytest.raises(ValueError, match="elementwise"):
        optimized.load(tiny_source, backends={"elementwise": "reference"})
    with pytest.raises(ValueError, match="dtype"):
        optimized.load(tiny_source, dtype="float16")
    with pytest.raises(ValueError, match="moe_combine"):
        optimized.load(tiny_source, moe_combine="mean")
    with pytest.raises(ValueError, match="kv_norm_eps"):
        optimized.load(tiny_source, kv_norm_eps=0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_source):
    with pytest.raises(ValueError, match="no CUDA device is available"):
        optimized.load(tiny_source, device="cuda")


def test_decode_batch_refuses_caches_of_different_pools_and_duplicates(bf16_run):
    model = bf16_run["model"]
    a, b = model.new_pool(1).new_sequence(), model.new_pool(1).new_sequence()
    with pytest.raises(ValueError, match="prefilled"):
        model.decode(1, a)
    with pytest.raises(ValueError, match="different pools"):
        model.decode_batch([1, 2], [a, b])
    with pytest.raises(ValueError, match="twice"):
        model.decode_batch([1, 2], [a, a])
