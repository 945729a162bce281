"""Sigmoid-routed mixture of experts (spec b.13, b.14), float64.

Conventions: ``T`` tokens, ``E`` experts, ``k_e`` experts per token, ``D`` hidden, ``F`` FFN
width. Expert weights follow the checkpoint: ``w1`` = gate ``[F, D]``, ``w3`` = up ``[F, D]``,
``w2`` = down ``[D, F]``.
"""
from __future__ import annotations

import numpy as np

from .elementwise import sigmoid, silu

COMBINE_RULES = ("unbiased", "biased")


def router_logits(x, weight):
    """Router logits ``x @ weight.T`` (the MoE gate's linear layer: no bias, no scale).

    x: [T, D]; weight: [E, D]. Returns [T, E] float64 (the input of ``router``).
    """
    x = np.asarray(x, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: expected x [T,D] and weight [E,D] with the same D, "
                         f"got x {x.shape}, weight {weight.shape}")
    return x @ weight.T


def router(logits, bias, *, top_k, num_groups=1, topk_groups=1, renormalize=True, scaling=1.0,
           combine="unbiased"):
    """noaux_tc-style routing. Returns ``(weights [T, k_e], ids [T, k_e])``.

    logits: [T, E] (``x @ gate.weight.T``); bias: [E] (``e_score_correction_bias``).

    1. ``scores = sigmoid(logits)``; ``selection = scores + bias``.
    2. Grouped top-k (``num_groups > 1``): the ``E`` experts form ``num_groups`` contiguous groups;
       a group's score is the sum of its top-2 selection scores (its top-1 for groups of one); the
       ``topk_groups`` best groups are kept, the other experts' selection set to -inf.
    3. ``ids`` = the ``top_k`` largest selection scores, in descending order; ties go to the
       **lower** expert index (a stable sort on ``-selection``), for groups too.
    4. ``combine``: ``"unbiased"`` weights = ``scores[ids]`` (vLLM, the transformers port);
       ``"biased"`` weights = ``scores[ids] + bias[ids]`` (the HF remote code's in-place aliasing,
       spec b.13 / e.1).
    5. If ``renormalize`` and ``top_k > 1``: ``w / sum(w)`` (no epsilon). Then ``w * scaling``.
    """
    logits = np.asarray(logits, dtype=np.float64)
    bias = np.asarray(bias, dtype=np.float64)
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine: expected one of {COMBINE_RULES}, got {combine!r}")
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [T,E], got {logits.shape}")
    T, E = logits.shape
    if bias.shape != (E,):
        raise ValueError(f"bias: expected [E] = ({E},), got {bias.shape}")
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"num_groups: expected a divisor of E = {E}, got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: expected 1..num_groups = {num_groups}, got {topk_groups}")
    if not 1 <= top_k <= topk_groups * (E // num_groups):
        raise ValueError(f"top_k: expected 1..{topk_groups * (E // num_groups)} (experts in the "
                         f"kept groups), got {top_k}")

    scores = sigmoid(logits)
    selection = scores + bias
    if num_groups > 1:
        selection = _mask_groups(selection, num_groups, topk_groups)
    ids = np.argsort(-selection, axis=-1, kind="stable")[:, :top_k]
    return route_weights(scores, bias, ids, renormalize=renormalize, scaling=scaling, combine=combine), ids


def route_weights(scores, bias, ids, *, renormalize=True, scaling=1.0, combine="unbiased"):
    """The combine weights ``[T, k_e]`` of the experts ``ids [T, k_e]`` (steps 4-5 of ``router``).

    scores: [T, E] sigmoid scores; bias: [E]. ``router`` calls it with its own top-k; the model
    calls it with given ids to replay another run's expert choices (``Model.forward(routing=...)``).
    """
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine: expected one of {COMBINE_RULES}, got {combine!r}")
    weights = np.take_along_axis(scores, ids, axis=-1)
    if combine == "biased":
        weights = weights + bias[ids]
    if renormalize and ids.shape[-1] > 1:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return weights * scaling


def _mask_groups(selection, num_groups, topk_groups):
    T, E = selection.shape
    grouped = selection.reshape(T, num_groups, E // num_groups)
    top2 = -np.sort(-grouped, axis=-1)[..., :2]  # two best per group (one if the group has one)
    group_score = np.sum(top2, axis=-1)  # [T, num_groups]
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_groups]
    keep = np.zeros((T, num_groups), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=-1)
    return np.where(keep[:, :, None], grouped, -np.inf).reshape(T, E)


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU MLP: ``(silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    x: [T, D]; w_gate, w_up: [F, D]; w_down: [D, F]. Returns [T, D]. The dense MLP, the shared
    expert and one routed expert (``swiglu(x, w1[e], w3[e], w2[e])``).
    """
    x, w_gate, w_up, w_down = (np.asarray(a, dtype=np.float64) for a in (x, w_gate, w_up, w_down))
    if x.ndim != 2:
        raise ValueError(f"x: expected [T,D], got {x.shape}")
    D = x.shape[1]
    if w_gate.ndim != 2 or w_gate.shape[1] != D:
        raise ValueError(f"w_gate: expected [F,D] with D = {D}, got {w_gate.shape}")
    F = w_gate.shape[0]
    if w_up.shape != (F, D):
        raise ValueError(f"w_up: expected [F,D] = {(F, D)}, got {w_up.shape}")
    if w_down.shape != (D, F):
        raise ValueError(f"w_down: expected [D,F] = {(D, F)}, got {w_down.shape}")
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def experts(x, weights, ids, w1, w2, w3):
    """Routed experts: ``y[t] = sum_k weights[t, k] * swiglu(x[t], w1[e], w3[e], w2[e])``, e = ids[t, k].

    x: [T, D]; weights, ids: [T, k_e] (from ``router``); w1, w3: indexable by expert id giving
    [F, D], w2 giving [D, F] (stacked [E, F, D] / [E, D, F] arrays, or lazy sequences that load one
    expert on access). Each expert is fetched once and run only on the tokens routed to it; the
    sum over k is taken in slot order. Returns [T, D].
    """
    x = np.asarray(x, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    ids = np.asarray(ids)
    if x.ndim != 2:
        raise ValueError(f"x: expected [T,D], got {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids: expected integer [T,k_e] with T = {x.shape[0]}, got "
                         f"{ids.dtype} {ids.shape}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights: expected [T,k_e] = {ids.shape}, got {weights.shape}")
    per_slot = np.zeros(ids.shape + (x.shape[1],))  # [T, k_e, D]
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        y = swiglu(x[tok], w1[int(e)], w3[int(e)], w2[int(e)])
        per_slot[tok, slot] = weights[tok, slot, None] * y
    return np.sum(per_slot, axis=1)
