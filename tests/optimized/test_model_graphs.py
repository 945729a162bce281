"""CUDA-graph replay of the decode step (``optimized.load(..., cuda_graphs=...)``, ``optimized.graphs``).

On a GPU: the replayed logits are bitwise the eager ones (greedy decode of one sequence; a batch of
sequences of different lengths across a growth of the paged cache and changing batch sizes), the
kernel counters match the eager step's, and the warm-up, the capture and the replays leave every
slot and block they were not asked to touch bit-identical. On CPU (CI): the option's default and
its errors, and the replay plumbing (static inputs, keys, recapture after a pool growth, counters)
with a stand-in for the CUDA graph whose replay reruns the captured step."""
import numpy as np
import pytest
import torch

import optimized
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from optimized import _counters

TINY = KimiConfig.from_name("tiny")
PROMPT = [1, 17, 300, 42, 5, 99, 256, 7]

needs_gpu = pytest.mark.parity_gpu


@pytest.fixture(scope="module")
def tiny_source():
    return SyntheticSource(TINY, 0)


def _state(pool):
    """Every state tensor of a pool, cloned: KDA/conv per layer, the paged MLA store per layer."""
    out = {}
    for i, st in pool.kda.items():
        out[f"kda.{i}.conv"] = st.conv.clone()
        out[f"kda.{i}.state"] = st.state.clone()
    for i, c in pool.mla.items():
        out[f"mla.{i}"] = c.kv.clone()
    return out


# -- CPU: the option -------------------------------------------------------------------------------

@pytest.mark.parity_interpreter  # the CPU default and error
def test_cuda_graphs_default_off_on_cpu_and_true_is_a_clear_error(tiny_source, parity_device):
    with pytest.raises(ValueError, match=rf"cuda_graphs=True needs a CUDA device \(device is '{parity_device}'\)"):
        optimized.load(tiny_source, device=parity_device, cuda_graphs=True)
    assert optimized.load(tiny_source, device=parity_device).cuda_graphs is False
    assert optimized.load(tiny_source, device=parity_device, cuda_graphs=False).cuda_graphs is False


def test_cuda_graphs_must_be_a_bool_or_none(tiny_source):
    with pytest.raises(ValueError, match="cuda_graphs: expected True, False or None"):
        optimized.load(tiny_source, cuda_graphs="yes")


@needs_gpu
def test_cuda_graphs_default_on_cuda_and_refused_with_a_reference_backend(tiny_source, parity_device):
    assert optimized.load(tiny_source, device=parity_device).cuda_graphs is True
    model = optimized.load(tiny_source, device=parity_device, backends={"kda": "reference"})
    assert model.cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs=True needs every op family on Triton"):
        optimized.load(tiny_source, device=parity_device, backends={"kda": "reference"}, cuda_graphs=True)


# -- CPU: the replay plumbing, with a stand-in for the CUDA graph machinery -------------------------

class _StandInGraph:
    """A "graph" whose replay reruns the captured step on the static buffers: what a real replay
    computes, so the static inputs, the keys, the recapture and the counters are checked on CPU."""

    def replay(self):
        saved = _counters.snapshot()
        self.rerun()
        _counters.launches.clear()
        _counters.launches.update(saved)


@pytest.mark.parity_interpreter  # on a GPU the tests below run the real graphs
def test_replay_plumbing_with_a_stand_in_for_cuda_graphs(tiny_source, monkeypatch, parity_device):
    import contextlib
    import weakref

    from optimized import graphs as G

    class Stream:
        def wait_stream(self, other):
            pass

    captured = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    capture = G.DecodeGraphs._capture

    def recording_capture(self, step, pool, B, sig):
        g = capture(self, step, pool, B, sig)
        ref = weakref.ref(pool)
        g.graph.rerun = lambda: g.logits.copy_(step(g.ids, g.slots, g.batch, ref(), B))
        captured.append((B, sig[0]))
        return g

    monkeypatch.setattr(G.DecodeGraphs, "_capture", recording_capture)

    graphs = optimized.load(tiny_source, device=parity_device, dtype="bfloat16")
    eager = optimized.load(tiny_source, device=parity_device, dtype="bfloat16")
    graphs.cuda_graphs, graphs._graphs = True, G.DecodeGraphs(graphs.device, graphs.decode_tile)
    # blocks of 2 positions, 12 blocks: the store grows at step 2 (after the first capture)
    pg, pe = graphs.new_pool(3, block_size=2), eager.new_pool(3, block_size=2)
    prompts = [PROMPT, PROMPT[2:], PROMPT[:5]]
    sg = [graphs.prefill(p, cache=pg.new_sequence())[1] for p in prompts]
    se = [eager.prefill(p, cache=pe.new_sequence())[1] for p in prompts]
    idle_before = _state(pg)
    for k in range(4):
        _counters.reset()
        le, _ = eager.decode_batch([7 + k, 30 + k], se[:2])
        want = _counters.snapshot()
        _counters.reset()
        lg, _ = graphs.decode_batch([7 + k, 30 + k], sg[:2])
        assert _counters.snapshot() == want, k  # warm-up and capture not counted, a replay is
        assert torch.equal(lg, le), k
        if k == 0:  # the capture (all padding) and the first replay left the idle slots alone
            after = _state(pg)
            for name in after:
                if name.startswith("kda"):
                    assert torch.equal(after[name][[2]], idle_before[name][[2]]), name
                else:
                    assert torch.equal(after[name][sg[2].blocks], idle_before[name][sg[2].blocks]), name
    assert captured == [(2, 12), (2, 24)]  # recaptured on the grown store
    lg, _ = graphs.decode_batch([11], sg[2:])  # another batch size: another graph of the pool
    le, _ = eager.decode_batch([11], se[2:])
    assert torch.equal(lg, le) and captured[-1] == (1, 24) and set(graphs._graphs.pools[pg]) == {1, 2}
    a, b = _state(pg), _state(pe)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    del sg, pg, _  # the pool's graphs go with it
    assert len(graphs._graphs.pools) == 0


# -- GPU: replay == eager, bit for bit ---------------------------------------------------------------

def _models(source, device, dtype="bfloat16"):
    graphs = optimized.load(source, device=device, dtype=dtype, cuda_graphs=True)
    eager = optimized.load(source, device=device, dtype=dtype, cuda_graphs=False)
    assert graphs.cuda_graphs and not eager.cuda_graphs
    return graphs, eager


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_decode_by_graph_replay_is_bitwise_the_eager_decode(tiny_source, dtype, parity_device):
    graphs, eager = _models(tiny_source, parity_device, dtype)
    lg, cg = graphs.prefill(PROMPT)
    le, ce = eager.prefill(PROMPT)
    assert torch.equal(lg, le)
    token = int(le[-1].argmax())
    for step in range(20):
        sg, cg = graphs.decode(token, cg)
        se, ce = eager.decode(token, ce)
        assert torch.equal(sg, se), step
        token = int(se.argmax())
    assert cg.length == ce.length == len(PROMPT) + 20
    # the trace path runs eagerly on a graphs model, and agrees too
    trace = {}
    st, cg = graphs.decode(token, cg, trace=trace)
    se, ce = eager.decode(token, ce)
    assert torch.equal(st, se) and "final_norm" in trace


@needs_gpu
def test_replay_records_the_kernel_counters_of_one_eager_step(tiny_source, parity_device):
    graphs, eager = _models(tiny_source, parity_device)
    cg, ce = graphs.prefill(PROMPT)[1], eager.prefill(PROMPT)[1]
    _counters.reset()
    eager.decode(3, ce)
    want = _counters.snapshot()
    for _ in range(2):  # the first call captures (warm-up and capture are not counted), then a replay
        _counters.reset()
        graphs.decode(3, cg)
        assert _counters.snapshot() == want


@needs_gpu
def test_batched_decode_by_graph_replay_equals_eager_across_a_pool_growth(tiny_source, parity_device):
    graphs, eager = _models(tiny_source, parity_device)
    rng = np.random.default_rng(0)
    lengths = [3, 17, 9, 30, 12]
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]
    # small blocks and a small store: the decode below outgrows it (the pool grows, the graphs recapture)
    pg = graphs.new_pool(5, block_size=4, num_blocks=None)
    pe = eager.new_pool(5, block_size=4, num_blocks=None)
    sg = [graphs.prefill(p, cache=pg.new_sequence())[1] for p in prompts]
    se = [eager.prefill(p, cache=pe.new_sequence())[1] for p in prompts]
    # all five, then subsets (other batch sizes: other graphs of the same pool), then all five again;
    # the store grows at the first step (before any capture) and again at step 19 (after captures)
    plan = [list(range(5))] * 6 + [[1, 3], [0, 2, 4], [4]] * 2 + [list(range(5))] * 14
    for k, rows in enumerate(plan):
        ids = rng.integers(0, TINY.vocab_size, len(rows)).tolist()
        lg, _ = graphs.decode_batch(ids, [sg[b] for b in rows])
        le, _ = eager.decode_batch(ids, [se[b] for b in rows])
        assert torch.equal(lg, le), (k, rows)
        if k == 0:
            blocks0 = pg.num_blocks
    assert pg.num_blocks > blocks0, "the pool did not grow after the first capture: decode longer"
    assert pg.num_blocks == pe.num_blocks
    # and the carried states are the same bits
    a, b = _state(pg), _state(pe)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # a graph per batch size used since the growth, each captured on the grown storage
    held = graphs._graphs.pools[pg]
    assert set(held) <= {1, 2, 3, 5} and 5 in held
    assert all(g.batch.block_tables.shape[1] == pg.num_blocks for g in held.values())


@needs_gpu
def test_graph_capture_and_replay_leave_other_slots_and_blocks_bit_identical(tiny_source, parity_device):
    graphs = optimized.load(tiny_source, device=parity_device, dtype="bfloat16")  # cuda_graphs by default
    assert graphs.cuda_graphs
    pool = graphs.new_pool(4, block_size=4)
    seqs = [graphs.prefill(p, cache=pool.new_sequence())[1] for p in (PROMPT, PROMPT[:5], PROMPT[2:])]
    idle = seqs[2]  # prefilled, never decoded; slot 3 stays free
    before = _state(pool)
    idle_blocks = list(idle.blocks)
    for k in range(6):  # the first call captures (warm-up + capture on all-padding rows), then replays
        graphs.decode_batch([5 + k, 9 + k], seqs[:2])
    after = _state(pool)
    untouched = [idle.slot, 3]
    for i in pool.kda:
        for part in ("conv", "state"):
            name = f"kda.{i}.{part}"
            assert torch.equal(after[name][untouched], before[name][untouched]), name
    for i in pool.mla:
        name = f"mla.{i}"
        assert torch.equal(after[name][idle_blocks], before[name][idle_blocks]), name
        # blocks no sequence owns stay as they were (zeros)
        owned = {blk for s in seqs for blk in s.blocks}
        free = [blk for blk in range(pool.num_blocks) if blk not in owned and blk < before[name].shape[0]]
        assert torch.equal(after[name][free], before[name][free]), name
    # the decoded sequences did advance
    assert [s.length for s in seqs] == [len(PROMPT) + 6, 5 + 6, len(PROMPT) - 2]
