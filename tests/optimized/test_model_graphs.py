"""CUDA-graph replay of the decode step (``optimized.load(..., cuda_graphs=...)``, ``optimized.graphs``).

On a GPU: the replayed logits are bitwise the eager ones (greedy decode of one sequence; a batch of
sequences of different lengths across a growth of the paged cache and changing batch sizes), the
kernel counters match the eager step's, and the warm-up, the capture and the replays leave every
slot and block they were not asked to touch bit-identical. On CPU (CI): the option's default and
its error."""
import numpy as np
import pytest
import torch

import optimized
from optimized import _counters
from reference.config import KimiConfig
from reference.synthetic import SyntheticSource

TINY = KimiConfig.from_name("tiny")
PROMPT = [1, 17, 300, 42, 5, 99, 256, 7]

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_source():
    return SyntheticSource(TINY, 0)


# -- CPU: the option -------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default and error")
def test_cuda_graphs_default_off_on_cpu_and_true_is_a_clear_error(tiny_source):
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device \(device is 'cpu'\)"):
        optimized.load(tiny_source, device="cpu", cuda_graphs=True)
    assert optimized.load(tiny_source, device="cpu").cuda_graphs is False
    assert optimized.load(tiny_source, device="cpu", cuda_graphs=False).cuda_graphs is False


def test_cuda_graphs_must_be_a_bool_or_none(tiny_source):
    with pytest.raises(ValueError, match="cuda_graphs: expected True, False or None"):
        optimized.load(tiny_source, cuda_graphs="yes")


@needs_gpu
def test_cuda_graphs_default_on_cuda_and_refused_with_a_reference_backend(tiny_source):
    assert optimized.load(tiny_source, device="cuda").cuda_graphs is True
    model = optimized.load(tiny_source, device="cuda", backends={"kda": "reference"})
    assert model.cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs=True needs every op family on Triton"):
        optimized.load(tiny_source, device="cuda", backends={"kda": "reference"}, cuda_graphs=True)


# -- GPU: replay == eager, bit for bit ---------------------------------------------------------------

def _models(source, dtype="bfloat16"):
    graphs = optimized.load(source, device="cuda", dtype=dtype, cuda_graphs=True)
    eager = optimized.load(source, device="cuda", dtype=dtype, cuda_graphs=False)
    assert graphs.cuda_graphs and not eager.cuda_graphs
    return graphs, eager


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_decode_by_graph_replay_is_bitwise_the_eager_decode(tiny_source, dtype):
    graphs, eager = _models(tiny_source, dtype)
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
def test_replay_records_the_kernel_counters_of_one_eager_step(tiny_source):
    graphs, eager = _models(tiny_source)
    cg, ce = graphs.prefill(PROMPT)[1], eager.prefill(PROMPT)[1]
    _counters.reset()
    eager.decode(3, ce)
    want = _counters.snapshot()
    for _ in range(2):  # the first call captures (warm-up and capture are not counted), then a replay
        _counters.reset()
        graphs.decode(3, cg)
        assert _counters.snapshot() == want


def _state(pool):
    """Every state tensor of a pool, cloned: KDA/conv per layer, the paged MLA store per layer."""
    out = {}
    for i, st in pool.kda.items():
        out[f"kda.{i}.conv"] = st.conv.clone()
        out[f"kda.{i}.state"] = st.state.clone()
    for i, c in pool.mla.items():
        out[f"mla.{i}"] = c.kv.clone()
    return out


@needs_gpu
def test_batched_decode_by_graph_replay_equals_eager_across_a_pool_growth(tiny_source):
    graphs, eager = _models(tiny_source)
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
def test_graph_capture_and_replay_leave_other_slots_and_blocks_bit_identical(tiny_source):
    graphs, eager = _models(tiny_source)
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
