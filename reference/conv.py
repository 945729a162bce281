"""Causal depthwise short convolution followed by SiLU (KDA ``*_conv1d``, spec b.5), float64, on
any array API executor.

Conventions: ``x [B, T, C]`` (C channels), ``weight [C, W]`` (the checkpoint's ``[C, 1, W]`` is
accepted and squeezed). Tap ``weight[:, W-1]`` multiplies the current token and ``weight[:, 0]``
the token ``W-1`` steps back (PyTorch ``Conv1d`` cross-correlation with left padding ``W-1``).
The streaming state ``[B, C, W-1]`` holds the last ``W-1`` **pre-conv** inputs, oldest first;
no state means zero history.
"""
from __future__ import annotations

from .elementwise import silu
from .executor import device_of, namespace


def _weight(xp, weight):
    weight = xp.asarray(weight, dtype=xp.float64)
    if weight.ndim == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if weight.ndim != 2 or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [C,W] or [C,1,W], got {tuple(weight.shape)}")
    return weight


def _check_state(name, state, B, C, W):
    if tuple(state.shape) != (B, C, W - 1):
        raise ValueError(f"{name}: expected [B,C,W-1] = {(B, C, W - 1)}, got {tuple(state.shape)}")


def short_conv(x, weight, *, initial_state=None):
    """Prefill (or continue) a sequence: ``y = silu(causal depthwise conv(x))``.

    x: [B, T, C]; weight: [C, W] or [C, 1, W]; initial_state: [B, C, W-1] or None (zeros).
    Returns ``(y [B, T, C], final_state [B, C, W-1])``, the final state being the last ``W-1``
    inputs of ``cat(initial_state, x)`` along time (so it is valid for any ``T``, also ``T < W-1``).
    """
    xp = namespace(x, weight, initial_state)
    x = xp.asarray(x, dtype=xp.float64)
    weight = _weight(xp, weight)
    if x.ndim != 3 or x.shape[2] != weight.shape[0]:
        raise ValueError(f"x: expected [B,T,C] with C = {weight.shape[0]}, got {tuple(x.shape)}")
    B, T, C = x.shape
    W = weight.shape[1]
    if initial_state is None:
        initial_state = xp.zeros((B, C, W - 1), dtype=xp.float64, device=device_of(x))
    initial_state = xp.asarray(initial_state, dtype=xp.float64)
    _check_state("initial_state", initial_state, B, C, W)

    # history followed by the new tokens: [B, W-1+T, C]; output t sees rows t .. t+W-1
    xp_ = xp.concat([xp.permute_dims(initial_state, (0, 2, 1)), x], axis=1)
    acc = xp.zeros((B, T, C), dtype=xp.float64, device=device_of(x))
    for j in range(W):
        acc = acc + weight[:, j] * xp_[:, j : j + T, :]
    final_state = xp.asarray(xp.permute_dims(xp_[:, T:, :], (0, 2, 1)), copy=True)
    return silu(acc), final_state


def short_conv_step(x, weight, state):
    """One decode token: ``y = silu(sum_j weight[:, j] * cat(state, x)[:, :, j])``.

    x: [B, C]; weight: [C, W] or [C, 1, W]; state: [B, C, W-1] (oldest first).
    Returns ``(y [B, C], new_state [B, C, W-1])`` with the state shifted left by one and ``x``
    appended. Identical to ``short_conv`` with T = 1.
    """
    xp = namespace(x, weight, state)
    x = xp.asarray(x, dtype=xp.float64)
    weight = _weight(xp, weight)
    if x.ndim != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"x: expected [B,C] with C = {weight.shape[0]}, got {tuple(x.shape)}")
    B, C = x.shape
    W = weight.shape[1]
    state = xp.asarray(state, dtype=xp.float64)
    _check_state("state", state, B, C, W)
    window = xp.concat([state, x[:, :, None]], axis=2)  # [B, C, W]
    acc = xp.zeros((B, C), dtype=xp.float64, device=device_of(x))
    for j in range(W):  # same summation order as short_conv, so the two agree bit for bit
        acc = acc + weight[:, j] * window[:, :, j]
    return silu(acc), xp.asarray(window[:, :, 1:], copy=True)
