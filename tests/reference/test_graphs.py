"""A decode step replayed as CUDA graphs has the eager step's bits, leaves its cache untouched,
and steps aside for what it cannot hold (a trace, several sequences). Graphs need a GPU: on the
CPU the model has none and these tests skip."""
import numpy as np
import pytest

import reference
from reference.executor import to_numpy

from .test_weights import _shared_small


def _pair(device):
    """Two models on one set of shared weights: one graphed, one eager."""
    src, views = _shared_small(device)
    graphed = reference.load(src, executor="torch", device=device, shared_weights=views)
    if graphed.graphs is None:
        pytest.skip("CUDA graphs need a GPU executor with shared weights")
    eager = reference.load(src, executor="torch", device=device, shared_weights=views)
    eager.graphs = None
    return graphed, eager


def _same_bits(a, b, what):
    a, b = to_numpy(a), to_numpy(b)
    assert a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64)), what


def _same_cache(a, b, what):
    for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        for f in la.__dataclass_fields__:
            _same_bits(getattr(la, f), getattr(lb, f), f"{what}: layer {i} {f}")


def test_decode_steps_eager_captured_and_replayed_have_the_eager_bits(parity_device):
    graphed, eager = _pair(parity_device)
    _, cache = eager.prefill([5, 6, 7, 8, 9])
    cg = ce = cache
    for step, token in enumerate([1, 2, 3, 4, 5]):  # eager, captured, then replayed
        lg, cg = graphed.decode(token, cg)
        le, ce = eager.decode(token, ce)
        _same_bits(lg, le, f"logits of step {step}")
        _same_cache(cg, ce, f"cache of step {step}")
    c = graphed.config
    parts = c.num_hidden_layers + len(c.full_attn_layers) + 1  # a KDA layer 1, an MLA layer 2, the head
    assert graphed.graphs.disabled is None and len(graphed.graphs) == parts


def test_a_replay_leaves_its_cache_untouched_and_a_trace_or_a_batch_runs_eagerly(parity_device):
    graphed, eager = _pair(parity_device)
    _, cache = eager.prefill([5, 6, 7])
    for token in (1, 2):  # eager, then captured
        _, cache = graphed.decode(token, cache)
    before = [to_numpy(a).copy() for lc in cache.layers for a in vars(lc).values()]
    first, _ = graphed.decode(3, cache)
    again, _ = graphed.decode(3, cache)  # the same cache twice: the replay wrote none of it
    _same_bits(first, again, "the same step twice")
    after = [to_numpy(a) for lc in cache.layers for a in vars(lc).values()]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    trace = {}
    traced, _ = graphed.decode(3, cache, trace=trace)  # a trace needs every part's values: eager
    _same_bits(traced, eager.decode(3, cache)[0], "a traced step")
    assert "layers.1.router.ids" in trace
    batch, _ = graphed.decode_batch([3, 3], [cache, cache])
    want, _ = eager.decode_batch([3, 3], [cache, cache])
    _same_bits(batch, want, "a batch of two")
