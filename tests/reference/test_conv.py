"""Short conv reference: tap orientation, state convention, and that prefill at once, prefill in
pieces with a carried state and token-by-token steps agree (bit for bit: same summation order)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.conv import short_conv, short_conv_step
from reference.elementwise import silu


def test_taps_by_hand():
    # weight[:, W-1] multiplies the current token, weight[:, 0] the token W-1 steps back
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0]).reshape(1, 5, 1)
    w = np.array([[1000.0, 100.0, 10.0, 1.0]])
    y, state = short_conv(x, w)
    pre = np.array([1, 12, 123, 1234, 2345], dtype=float)
    np.testing.assert_array_equal(y[0, :, 0], silu(pre))
    np.testing.assert_array_equal(state[0, 0], [3.0, 4.0, 5.0])  # oldest first


def test_short_sequence_state_is_left_padded_with_zeros():
    x = np.array([[[7.0, -1.0]]])  # B=1, T=1 < W-1, C=2
    w = np.ones((2, 4))
    _, state = short_conv(x, w)
    np.testing.assert_array_equal(state, [[[0.0, 0.0, 7.0], [0.0, 0.0, -1.0]]])
    _, state = short_conv(x, w, initial_state=np.arange(6.0).reshape(1, 2, 3))
    np.testing.assert_array_equal(state, [[[1.0, 2.0, 7.0], [4.0, 5.0, -1.0]]])


def test_checkpoint_weight_layout_is_accepted():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 6, 3)), rng.standard_normal((3, 4))
    for a, b in zip(short_conv(x, w), short_conv(x, w[:, None, :])):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 20), C=st.integers(1, 5), W=st.integers(1, 5),
       cuts=st.lists(st.integers(0, 20), max_size=3), seed=st.integers(0, 2**32 - 1),
       with_state=st.booleans())
def test_at_once_equals_pieces_equals_steps(B, T, C, W, cuts, seed, with_state):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((B, T, C)), rng.standard_normal((C, W))
    s0 = rng.standard_normal((B, C, W - 1)) if with_state else None
    y, s = short_conv(x, w, initial_state=s0)

    bounds = [0] + sorted(min(c, T) for c in cuts) + [T]
    state, pieces = s0, []
    for a, b in zip(bounds[:-1], bounds[1:]):  # pieces may be empty or shorter than W-1
        yp, state = short_conv(x[:, a:b], w, initial_state=state)
        pieces.append(yp)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), y)
    np.testing.assert_array_equal(state, s)

    state = np.zeros((B, C, W - 1)) if s0 is None else s0
    steps = []
    for t in range(T):
        yt, state = short_conv_step(x[:, t], w, state)
        steps.append(yt)
    np.testing.assert_array_equal(np.stack(steps, axis=1), y)
    np.testing.assert_array_equal(state, s)


def test_shape_errors_name_the_argument():
    w = np.zeros((3, 4))
    with pytest.raises(ValueError, match=r"x: expected \[B,T,C\]"):
        short_conv(np.zeros((1, 5, 2)), w)
    with pytest.raises(ValueError, match=r"initial_state: expected \[B,C,W-1\]"):
        short_conv(np.zeros((1, 5, 3)), w, initial_state=np.zeros((1, 3, 4)))
    with pytest.raises(ValueError, match=r"state: expected \[B,C,W-1\]"):
        short_conv_step(np.zeros((1, 3)), w, np.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match=r"weight: expected \[C,W\]"):
        short_conv(np.zeros((1, 5, 3)), np.zeros((3, 2, 4)))
