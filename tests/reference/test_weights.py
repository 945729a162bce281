"""The float64 weights: experts gathered by device ids from the shared stacked view give the
host-listed gather's bits, the stack is checked finite once, and a non-finite expert is named."""
import numpy as np
import pytest

import reference
from kimi.checkpoint import CheckpointError
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from kimi.tensors import expert_name
from reference.executor import get_executor, to_numpy


def _shared_small(device, poison=None):
    """The small preset's source and the optimized model's resident bf16 weights as named views;
    ``poison``: (layer, expert) whose w1 gets a NaN in the stacked tensor before the views."""
    import optimized
    from optimized.weights import named_views

    src = SyntheticSource(KimiConfig.from_name("small"), 0)
    weights = optimized.load(src, device=device, dtype="bfloat16").weights
    if poison is not None:
        layer, e = poison
        weights.layers[layer].ffn.w1[e, 0, 0] = float("nan")
    return src, named_views(weights, src.config)


def test_stacked_view_is_the_stack_the_views_came_from_and_none_for_anything_else():
    import torch

    ex = get_executor("cpu", "torch")
    stack = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3)
    view = ex.stacked_view([stack[e] for e in range(4)])
    assert view is not None and torch.equal(view, stack) and view.data_ptr() == stack.data_ptr()
    assert torch.equal(ex.stacked_view([stack[e] for e in (1, 2, 3)]), stack[1:])
    assert ex.stacked_view([stack[e] for e in (0, 2, 3)]) is None  # not equally spaced
    assert ex.stacked_view([stack[e].clone() for e in range(4)]) is None  # separate buffers
    assert ex.stacked_view([stack[e, :, :2] for e in range(4)]) is None  # not contiguous
    assert get_executor("cpu", "numpy").stacked_view([np.zeros(3)] * 2) is None


def test_experts_by_device_ids_are_the_gather_of_their_names_and_the_stack_is_checked_once(parity_device):
    src, views = _shared_small(parity_device)
    model = reference.load(src, executor="torch", device=parity_device, shared_weights=views)
    w, ex = model._w, model.executor
    E = src.config.num_experts
    ids = ex.ints(np.array([7, 0, 15, 3]))
    for which in ("w1", "w2", "w3"):
        got = w.gather_ids(1, which, E, ids)
        want = w.gather([expert_name(1, e, which) for e in (7, 0, 15, 3)])
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    w.verify()
    assert {expert_name(1, e, "w2") for e in range(E)} <= w.checked  # all of them, not only the four
    queued = len(w.pending)
    w.gather_ids(1, "w2", E, ids)
    assert len(w.pending) == queued  # checked once


def test_a_non_finite_expert_in_the_shared_stack_is_named_by_a_decode_step(parity_device):
    src, views = _shared_small(parity_device, poison=(2, 5))
    model = reference.load(src, executor="torch", device=parity_device, shared_weights=views)
    model.bitwise_rows = False  # one token's experts by device ids, as on a GPU
    cache = model.empty_cache()
    with pytest.raises(CheckpointError, match=r"layers\.2\.block_sparse_moe\.experts\.5\.w1\.weight.*non-finite"):
        model.decode(3, cache)
