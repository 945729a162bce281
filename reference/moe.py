"""Sigmoid-routed mixture of experts (spec b.13, b.14), float64.

Conventions: ``T`` tokens, ``E`` experts, ``k_e`` experts per token, ``D`` hidden, ``F`` FFN
width. Expert weights follow the checkpoint: ``w1`` = gate ``[F, D]``, ``w3`` = up ``[F, D]``,
``w2`` = down ``[D, F]``. Written against the array API standard (``reference.executor``).
"""
from __future__ import annotations

import numpy as np

from .elementwise import sigmoid, silu
from .executor import device_of, namespace, to_numpy, upload
from .streamed import StreamedWeight, arrays, linear

COMBINE_RULES = ("unbiased", "biased")


def router_logits(x, weight):
    """Router logits ``x @ weight.T`` (the MoE gate's linear layer: no bias, no scale).

    x: [T, D]; weight: [E, D]. Returns [T, E] float64 (the input of ``router``).
    """
    xp = namespace(x, weight)
    x = xp.asarray(x, dtype=xp.float64)
    weight = xp.asarray(weight, dtype=xp.float64)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: expected x [T,D] and weight [E,D] with the same D, "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
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
    xp = namespace(logits, bias)
    logits = xp.asarray(logits, dtype=xp.float64)
    bias = xp.asarray(bias, dtype=xp.float64)
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine: expected one of {COMBINE_RULES}, got {combine!r}")
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [T,E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if tuple(bias.shape) != (E,):
        raise ValueError(f"bias: expected [E] = ({E},), got {tuple(bias.shape)}")
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
        selection = _mask_groups(xp, selection, num_groups, topk_groups)
    ids = xp.argsort(-selection, axis=-1, stable=True)[:, :top_k]
    return route_weights(scores, bias, ids, renormalize=renormalize, scaling=scaling, combine=combine), ids


def route_weights(scores, bias, ids, *, renormalize=True, scaling=1.0, combine="unbiased"):
    """The combine weights ``[T, k_e]`` of the experts ``ids [T, k_e]`` (steps 4-5 of ``router``).

    scores: [T, E] sigmoid scores; bias: [E]. ``router`` calls it with its own top-k; the model
    calls it with given ids to replay another run's expert choices (``Model.forward(routing=...)``).
    """
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine: expected one of {COMBINE_RULES}, got {combine!r}")
    xp = namespace(scores, bias, ids)
    weights = xp.take_along_axis(scores, ids, axis=-1)
    if combine == "biased":
        weights = weights + xp.reshape(xp.take(bias, xp.reshape(ids, (-1,))), ids.shape)
    if renormalize and ids.shape[-1] > 1:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return weights * scaling


def _mask_groups(xp, selection, num_groups, topk_groups):
    T, E = selection.shape
    grouped = xp.reshape(selection, (T, num_groups, E // num_groups))
    top2 = xp.sort(grouped, axis=-1, descending=True)[..., :2]  # two best per group (one if the group has one)
    group_score = xp.sum(top2, axis=-1)  # [T, num_groups]
    kept = xp.argsort(-group_score, axis=-1, stable=True)[:, :topk_groups]  # [T, topk_groups]
    groups = xp.arange(num_groups, device=device_of(kept))
    keep = xp.any(kept[:, :, None] == groups[None, None, :], axis=1)  # [T, num_groups]
    return xp.reshape(xp.where(keep[:, :, None], grouped, -xp.inf), (T, E))


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU MLP: ``(silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    x: [T, D]; w_gate, w_up: [F, D]; w_down: [D, F] (each an array or a
    ``streamed.StreamedWeight``). Returns [T, D]. The dense MLP, the shared expert and one routed
    expert (``swiglu(x, w1[e], w3[e], w2[e])``).
    """
    xp = namespace(x, *arrays(w_gate, w_up, w_down))
    x = xp.asarray(x, dtype=xp.float64)
    w_gate, w_up, w_down = (w if isinstance(w, StreamedWeight) else xp.asarray(w, dtype=xp.float64)
                            for w in (w_gate, w_up, w_down))
    if x.ndim != 2:
        raise ValueError(f"x: expected [T,D], got {tuple(x.shape)}")
    D = x.shape[1]
    if w_gate.ndim != 2 or w_gate.shape[1] != D:
        raise ValueError(f"w_gate: expected [F,D] with D = {D}, got {tuple(w_gate.shape)}")
    F = w_gate.shape[0]
    if tuple(w_up.shape) != (F, D):
        raise ValueError(f"w_up: expected [F,D] = {(F, D)}, got {tuple(w_up.shape)}")
    if tuple(w_down.shape) != (D, F):
        raise ValueError(f"w_down: expected [D,F] = {(D, F)}, got {tuple(w_down.shape)}")
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def experts(x, weights, ids, w1, w2, w3, *, group=None):
    """Routed experts: ``y[t] = sum_k weights[t, k] * swiglu(x[t], w1[e], w3[e], w2[e])``, e = ids[t, k].

    x: [T, D]; weights, ids: [T, k_e] (from ``router``); w1, w3: indexable by expert id giving
    [F, D], w2 giving [D, F] (stacked [E, F, D] / [E, D, F] arrays, or lazy sequences that load one
    expert on access, as an array or a ``streamed.StreamedWeight``). Only the experts in ``ids``
    are fetched, each once, and run on the tokens routed to it (in token order); the sum over k is
    taken in slot order. Returns [T, D].

    ``group``: None runs one expert at a time; an integer runs up to ``group`` experts as one
    batched product each (``_grouped``: their weights gathered into ``[n, F, D]`` arrays, each
    expert's tokens padded to the group's largest count; the slots summed in one reduction), for
    a GPU, where an expert's three products are too small to keep it busy and each launch costs
    more than its arithmetic. The same float64 products either way (the sums may round in another
    order). One token (a decode step) is grouped by device ids alone (``_one_token``): nothing
    waits for the device.

    Gathers only (no scatter, which the standard lacks): the (token, slot) pairs are sorted by
    expert, each expert's outputs are concatenated in that order, and slot ``k`` of token ``t``
    is read back at its sorted position.
    """
    xp = namespace(x, weights, ids)
    x = xp.asarray(x, dtype=xp.float64)
    weights = xp.asarray(weights, dtype=xp.float64)
    ids = xp.asarray(ids)
    if x.ndim != 2:
        raise ValueError(f"x: expected [T,D], got {tuple(x.shape)}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or not xp.isdtype(ids.dtype, "integral"):
        raise ValueError(f"ids: expected integer [T,k_e] with T = {x.shape[0]}, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights: expected [T,k_e] = {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if group is not None and (int(group) != group or group < 1):
        raise ValueError(f"group: expected a positive number of experts or None, got {group!r}")
    T, k = ids.shape
    if T == 0 or k == 0:
        return xp.zeros((T, x.shape[1]), dtype=xp.float64, device=device_of(x))
    flat = xp.reshape(ids, (-1,))
    if group is not None and T > 1:  # the bookkeeping on the host: one wait for the device
        y, where = _grouped(x, to_numpy(flat), k, w1, w2, w3, int(group))
    else:
        order = xp.argsort(flat, stable=True)  # pairs grouped by expert, token order within an expert
        if group is not None:
            y = _one_token(x, xp.take(flat, order), w1, w2, w3, int(group))
        else:
            y = _one_at_a_time(x, order, flat, k, w1, w2, w3)
        where = xp.argsort(order, stable=True)  # sorted position of pair (t, slot), row-major
    if group is not None:  # the k slots in one reduction (three launches, not 3 k)
        picked = xp.reshape(xp.take(y, where, axis=0), (T, k, x.shape[1]))
        return xp.sum(weights[:, :, None] * picked, axis=1)
    where = xp.reshape(where, (T, k))
    out = xp.zeros((T, x.shape[1]), dtype=xp.float64, device=device_of(x))
    for slot in range(k):
        out = out + weights[:, slot:slot + 1] * xp.take(y, where[:, slot], axis=0)
    return out


def _one_at_a_time(x, order, flat, k, w1, w2, w3):
    """``[T*k_e, D]``: each (token, slot) pair's expert output, pairs in expert order (``order``,
    the stable argsort of the flat ids ``flat``), one expert at a time."""
    xp = namespace(x, order)
    token = order // k
    experts_, counts = (to_numpy(a).tolist() for a in xp.unique_counts(xp.take(flat, order)))
    ys, start = [], 0
    for e, n in zip(experts_, counts):
        rows = token[start:start + n]
        ys.append(swiglu(xp.take(x, rows, axis=0), _expert(w1, e), _expert(w3, e), _expert(w2, e)))
        start += n
    return xp.concat(ys, axis=0)


def _one_token(x, chosen, w1, w2, w3, group):
    """``[k_e, D]``: one token ``x [1, D]`` through each of its experts ``chosen [k_e]`` (device
    ids, ascending: its pairs in expert order), ``group`` experts per batched product: the products
    of ``_grouped`` for one token (every count is 1 there: the groups take the experts in
    ascending order, each a ``[1, D]`` row), without reading the ids on the host, so nothing
    waits for the device and a CUDA graph can hold it. (A token routed twice to one expert, which
    no router does, gets that expert's output for each pair.)"""
    xp = namespace(x, chosen)
    D, k = x.shape[1], chosen.shape[0]
    ys = []
    for lo in range(0, k, group):
        ids = chosen[lo:lo + group]
        n = ids.shape[0]
        xg = xp.reshape(xp.take(x, xp.zeros((n,), dtype=ids.dtype, device=device_of(x)), axis=0), (n, 1, D))
        g1, g3, g2 = (_gather_ids(w, ids, xp) for w in (w1, w3, w2))
        h = silu(xg @ xp.matrix_transpose(g1)) * (xg @ xp.matrix_transpose(g3))
        ys.append(xp.reshape(h @ xp.matrix_transpose(g2), (n, D)))
    return ys[0] if len(ys) == 1 else xp.concat(ys, axis=0)


def _grouped(x, flat: np.ndarray, k: int, w1, w2, w3, group: int):
    """Each (token, slot) pair's expert output, ``group`` experts per batched product: ``(y,
    where)``, pair ``(t, slot)``'s output being row ``where[t * k + slot]`` of ``y``.

    ``flat``: the ``[T*k_e]`` expert ids on the host (the one wait for the device). The pairs are
    sorted by expert (stable: token order within an expert), and experts are taken in order of
    their counts. A group pads its tokens to its largest count; padding rows read a zero row
    appended to ``x``. Every index (the rows of each group, then ``where``) is worked out on the
    host and goes to the device in one upload.
    """
    xp = namespace(x)
    T, D = x.shape
    # O(T k_e) in whole-array steps: a stable radix sort of the ids (narrowed: NumPy radix-sorts
    # 16-bit integers), counts by bincount, each pair's padded row computed at once
    small = flat.astype(np.uint16) if flat.size and 0 <= flat.min() and flat.max() <= 0xFFFF else flat
    order = np.argsort(small, kind="stable")
    counts = np.bincount(flat, minlength=1)
    experts_ = np.flatnonzero(counts)
    counts = counts[experts_]
    n_e = experts_.size
    by_count = np.argsort(-counts, kind="stable")  # experts by descending count, ties ascending
    rank = np.empty(n_e, dtype=np.int64)
    rank[by_count] = np.arange(n_e)
    heads = np.arange(0, n_e, group)
    m = counts[by_count[heads]]  # each group's rows per expert: its first (largest) count
    size = np.minimum(group, n_e - heads) * m
    offset = np.concatenate([[0], np.cumsum(size)[:-1]])
    expert = np.repeat(np.arange(n_e), counts)  # of each pair, in expert order
    within = np.arange(flat.size) - np.repeat(np.cumsum(counts) - counts, counts)
    g = rank[expert] // group
    placed = offset[g] + (rank[expert] % group) * m[g] + within  # pair (expert order) -> row of y
    rows = np.full(int(size.sum()), T, dtype=np.int64)  # T: the zero row appended to x
    rows[placed] = order // k
    where = np.empty_like(placed)  # pair (t, slot) -> row of y: placed at the inverse of order
    where[order] = placed
    dev = device_of(x)
    indices = upload(np.concatenate([rows, where]), x)
    x_pad = xp.concat([x, xp.zeros((1, D), dtype=xp.float64, device=dev)], axis=0)
    ys = []
    for i, lo in enumerate(heads):
        chosen = experts_[by_count[lo:lo + group]].tolist()
        n = len(chosen)
        xg = xp.reshape(xp.take(x_pad, indices[offset[i]:offset[i] + size[i]], axis=0), (n, int(m[i]), D))
        g1, g3, g2 = (_gather(w, chosen, xp, dev) for w in (w1, w3, w2))
        h = silu(xg @ xp.matrix_transpose(g1)) * (xg @ xp.matrix_transpose(g3))
        ys.append(xp.reshape(h @ xp.matrix_transpose(g2), (int(size[i]), D)))
    return (ys[0] if len(ys) == 1 else xp.concat(ys, axis=0)), indices[rows.size:]


def _gather_ids(w, ids, xp):
    """Experts at the device ids ``ids [n]`` of ``w`` as one float64 array ``[n, ., .]``: a lazy
    sequence's own ``gather_ids`` (``reference.weights.Experts``), rows of a stacked array, else
    ``_gather`` of the ids read on the host."""
    if hasattr(w, "gather_ids"):
        return w.gather_ids(ids)
    if hasattr(w, "ndim"):
        return xp.take(xp.asarray(w, dtype=xp.float64), ids, axis=0)
    return _gather(w, to_numpy(ids).tolist(), xp, device_of(ids))


def _gather(w, experts_: list[int], xp, dev):
    """Experts ``experts_`` of ``w`` as one float64 array ``[n, ., .]``: a lazy sequence's own
    ``gather_experts`` (``reference.weights.Experts``), else rows of a stacked array."""
    if hasattr(w, "gather_experts"):
        return w.gather_experts(experts_)
    if hasattr(w, "ndim"):
        return xp.take(xp.asarray(w, dtype=xp.float64), xp.asarray(experts_, device=dev), axis=0)
    return xp.stack([xp.asarray(w[e], dtype=xp.float64) for e in experts_], axis=0)


def _expert(w, e):
    """Expert ``e`` of a stacked ``[E, ., .]`` array (``w[e, ...]``) or a lazy sequence (``w[e]``)."""
    return w[int(e), ...] if hasattr(w, "ndim") else w[int(e)]
