"""``replay.replay_batch``: the decode steps of B prompts replayed together give each prompt, bit for
bit, the ``ReplayCall`` its own ``Replay.add`` gives (every ``OpError`` array, the router flips), on
the bundled checkpoint with ragged prompt lengths, on NumPy, NumPy streaming its weights and torch
float64 on the CPU; the router weights the judge reads cross to the host once per layer.

The engine is the float64 NumPy model decoding the prompts through ``decode_batch``, its trace split
per prompt as the corpus splits it (``split_trace``), then blurred (each value times ``1 + 1e-3 n``,
stored float32, so every op has an error and a lossy input) and one expert id swapped (a router
flip). Cost on a 2-core CPU: a few seconds."""
from collections import Counter
from dataclasses import asdict

import numpy as np
import pytest

import reference
from kimi.fixtures import default_checkpoint_path
from parity.bounds.core import precision_for
from parity.diff.replay import HostWeights, Replay, ReplayCall, replay_batch, riders
from reference.batch import split_trace
from reference.executor import to_numpy

# ragged: shorter than the conv window, one token, longer prompts
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40], [3, 3, 3, 3, 3, 3, 9, 200, 17, 4, 4, 80]]
TOKENS = [[11, 12, 500, 14], [7, 7, 7, 7], [300, 2, 90, 41]]  # per decode step, one per prompt
FLIP = (1, 2, "layers.3.router.ids")  # (step, prompt, entry): one expert id swapped there
EXECUTORS = {"numpy": {}, "numpy-streamed": {"weight_cache_bytes": 0}, "torch": {"executor": "torch"}}
PRECISION = precision_for("bfloat16")


def _blurred(trace: dict, rng) -> dict:
    """The engine's trace as a bf16 engine's differs from the reference: every float value moved by
    about 1e-3 and stored float32, the router's selection its blurred scores plus the bias (router
    ids kept)."""
    out = {}
    for key, value in trace.items():
        a = to_numpy(value)
        out[key] = a if a.dtype.kind != "f" else (a * (1 + 1e-3 * rng.standard_normal(a.shape))).astype(np.float32)
    for key in [k for k in trace if k.endswith(".router.selection")]:
        scores = key.replace("selection", "scores")
        bias = to_numpy(trace[key]) - to_numpy(trace[scores])
        out[key] = (out[scores] + bias).astype(np.float32)
    return out


def _swap_expert(ids: np.ndarray, experts: int) -> np.ndarray:
    """``ids [1, k_e]`` with its last expert replaced by the first one it does not hold."""
    ids = ids.copy()
    ids[0, -1] = next(e for e in range(experts) if e not in ids[0])
    return ids


@pytest.fixture(scope="module")
def engine_calls():
    """``(prefills, steps)``: each prompt's ``(ids, trace)`` of its prefill; per decode step, the
    prompts' tokens and their own traces of the engine's batched call."""
    engine = reference.load(default_checkpoint_path())
    rng = np.random.default_rng(0)
    prefills, caches = [], []
    for p in PROMPTS:
        trace: dict = {}
        _, cache = engine.prefill(p, trace=trace)
        prefills.append((p, _blurred(trace, rng)))
        caches.append(cache)
    steps = []
    for s, tokens in enumerate(TOKENS):
        trace = {}
        _, caches = engine.decode_batch(tokens, caches, trace=trace)
        traces = [_blurred(t, rng) for t in split_trace(trace, len(PROMPTS))]
        if s == FLIP[0]:
            t = traces[FLIP[1]]
            t[FLIP[2]] = _swap_expert(t[FLIP[2]], engine.config.num_experts)
        steps.append((tokens, traces))
    return prefills, steps


def _replays(model, n: int, host=None) -> list[Replay]:
    return [Replay(model, model.config, u=PRECISION.u, ua=PRECISION.ua, host=host) for _ in range(n)]


def assert_same_call(got: ReplayCall, want: ReplayCall, where: str) -> None:
    assert [(o.name, o.layer, o.op) for o in got.ops] == [(o.name, o.layer, o.op) for o in want.ops], where
    for g, w in zip(got.ops, want.ops):
        for field in ("err", "err_in", "amp"):
            a, b = getattr(g, field), getattr(w, field)
            assert a.shape == b.shape and a.dtype == b.dtype, (where, g.name, field, a.shape, b.shape)
            assert np.array_equal(a, b), (f"{where}: {g.name}.{field}: {np.count_nonzero(a != b)} of {a.size} "
                                          f"differ; batched {a}, own {b}")
    assert [asdict(f) for f in got.flips] == [asdict(f) for f in want.flips], where


@pytest.mark.parametrize("ride", [False, True], ids=["own-ffn", "riding"])
@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_a_batched_replay_gives_each_prompt_the_calls_of_its_own_replay(executor, ride, engine_calls):
    # riding: each layer's FFN replay runs along with the reference's own prefill or decode_batch
    # of the call (``riders``), and is read from there
    prefills, steps = engine_calls
    model = reference.load(default_checkpoint_path(), **EXECUTORS[executor])
    own = _replays(model, len(PROMPTS))
    batched = _replays(model, len(PROMPTS), HostWeights(model))
    caches = []
    for b, (ids, trace) in enumerate(prefills):
        want = own[b].add(ids, trace)
        riding = riders([batched[b]], [ids], [trace]) if ride else None
        caches.append(model.prefill(ids, riders=riding)[1])
        assert_same_call(batched[b].add(ids, trace, riders=riding), want, f"{executor}: prompt {b}")
    flips = 0
    for s, (tokens, traces) in enumerate(steps, start=1):
        want = [r.add([t], trace) for r, t, trace in zip(own, tokens, traces)]
        riding = None
        if ride:
            riding = riders(batched, [[t] for t in tokens], traces)
            _, caches = model.decode_batch(tokens, caches, riders=riding)
            model.ffn = lambda *a, **k: pytest.fail("a ridden FFN replayed again")
        try:
            got = replay_batch(batched, tokens, traces, riders=riding)
        finally:
            model.__dict__.pop("ffn", None)
        assert len(got) == len(PROMPTS)
        for b, (g, w) in enumerate(zip(got, want)):
            assert_same_call(g, w, f"{executor}: step {s}, prompt {b}")
            # every op has an error to compare (the blur), nothing is trivially zero
            assert all(np.all(o.err > 0) for o in g.ops if o.op != "router"), (s, b)
            flips += len(g.flips)
    assert flips >= 1  # the swapped expert: the flips are compared too
    assert [r.position for r in batched] == [r.position for r in own] == [len(p) + len(steps) for p in PROMPTS]
    assert not model.trace_kda_core  # set for the replay only, as Replay.add does


def test_where_rows_are_not_bitwise_a_batched_replay_agrees_with_each_prompts_own_to_1e12(engine_calls):
    # the GPU forms (one product a weight for the batch), run on torch's CPU: the same ops, flips
    # and positions, every number within 1e-12 of the prompt's own replay
    prefills, steps = engine_calls
    model = reference.load(default_checkpoint_path(), executor="torch")
    model.bitwise_rows = False
    own, batched = _replays(model, len(PROMPTS)), _replays(model, len(PROMPTS), HostWeights(model))
    for b, (ids, trace) in enumerate(prefills):
        own[b].add(ids, trace)
        batched[b].add(ids, trace)
    flips = 0
    for s, (tokens, traces) in enumerate(steps, start=1):
        want = [r.add([t], trace) for r, t, trace in zip(own, tokens, traces)]
        for b, (g, w) in enumerate(zip(replay_batch(batched, tokens, traces), want)):
            assert [(o.name, o.op) for o in g.ops] == [(o.name, o.op) for o in w.ops]
            for go, wo in zip(g.ops, w.ops):
                for field in ("err", "err_in", "amp"):
                    np.testing.assert_allclose(getattr(go, field), getattr(wo, field), rtol=1e-12,
                                               err_msg=f"step {s}, prompt {b}: {go.name}.{field}")
            assert [(f.layer, f.position, f.swapped_in, f.swapped_out) for f in g.flips] == \
                [(f.layer, f.position, f.swapped_in, f.swapped_out) for f in w.flips]
            for gf, wf in zip(g.flips, w.flips):
                np.testing.assert_allclose([gf.margin, gf.bound], [wf.margin, wf.bound], rtol=1e-12)
            flips += len(g.flips)
    assert flips >= 1


def test_the_router_weights_cross_to_the_host_once_per_layer(engine_calls, monkeypatch):
    """Every weight the replays read through ``model.weight`` (the router's, for its judge) is read
    once per layer for a batch's replays over all their calls, not per prompt and call."""
    prefills, steps = engine_calls
    model = reference.load(default_checkpoint_path())
    seen: Counter = Counter()
    weight = model.weight
    monkeypatch.setattr(model, "weight", lambda name: seen.update([name]) or weight(name))
    replays = _replays(model, len(PROMPTS), HostWeights(model))
    for r, (ids, trace) in zip(replays, prefills):
        r.add(ids, trace)
    for tokens, traces in steps:
        replay_batch(replays, tokens, traces)
    moe = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    assert len(seen) == 3 * len(moe) and set(seen.values()) == {1}, seen


def test_a_batched_replay_takes_decode_steps_of_one_model_only(engine_calls):
    prefills, steps = engine_calls
    model = reference.load(default_checkpoint_path())
    fresh = _replays(model, 2)
    tokens, traces = steps[0]
    with pytest.raises(ValueError, match="decode steps only"):
        replay_batch(fresh, tokens[:2], traces[:2])
    other = _replays(reference.load(default_checkpoint_path()), 1)
    for r, (ids, trace) in zip(fresh[:1] + other, prefills):
        r.add(ids, trace)
    with pytest.raises(ValueError, match="of one model"):
        replay_batch(fresh[:1] + other, tokens[:2], traces[:2])
    with pytest.raises(ValueError, match="riders that no reference call ran"):
        replay_batch(fresh[:1], tokens[:1], traces[:1], riders=riders(fresh[:1], [tokens[:1]], traces[:1]))


@pytest.mark.parametrize("executor", ["numpy", "torch"])
def test_a_decode_steps_readout_amplification_from_its_new_state_is_the_recurrences(executor):
    # the step form reads the state the layer returns; the prompt form replays the recurrence from
    # the state the call started at: the same kappa up to rounding, for every sequence of a batch
    from parity.diff.replay import readout_amplification, readout_amplification_step

    model = reference.load(default_checkpoint_path(), **EXECUTORS[executor])
    caches = [model.prefill(p)[1] for p in PROMPTS]
    model.trace_kda_core = True
    trace: dict = {}
    _, new = model.decode_batch(TOKENS[0], caches, trace=trace)
    layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_kda_layer(i)]
    for i in layers:
        got = readout_amplification_step(trace, i, [c.layers[i].state for c in new])
        want = [readout_amplification(t, i)[0] for t in split_trace(trace, len(PROMPTS))]
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert np.all(got >= 1.0) and np.ptp(got) > 0  # per sequence, not one value for all
        stale = readout_amplification_step(trace, i, [c.layers[i].state for c in caches])
        assert not np.allclose(stale, want, rtol=1e-6)  # the state before the token is not the read-out's
