"""Inputs of the MoE ops (hypothesis strategies of :class:`parity.registry.Case`).

The router's inputs are built so that its discrete decisions are well defined: selection scores
``sigmoid(logit) + bias`` sit on separated levels (grouped runs: each group a band of levels, so
group scores are separated too), and every token has one exact tie (two experts with the same
logit and bias) at or inside the top-k boundary, where the contract's "lower index wins" decides.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from parity.registry import Case
from parity.strategies import WIDE_ELEMENTS, bucket, normal, rng, seeds, wide_rows

# (T, E, top_k, num_groups, topk_groups)
ROUTER_SHAPES = [(5, 8, 2, 1, 1), (6, 16, 4, 4, 2), (9, 16, 3, 1, 1)]


def router_logits(r, T, E, top_k, G, KG):
    """(logits [T, E], bias [E]) with banded, separated selection levels and one exact tie per token."""
    b = r.uniform(-0.15, 0.15, size=2)
    bias = np.where(np.arange(E) % 2 == 0, b[0], b[1])
    EG = E // G
    gap = 0.5 / (E + G)
    logits = np.zeros((T, E))
    for t in range(T):
        order = []                                   # experts by rank, band by band
        for g in r.permutation(G):
            order += list(g * EG + r.permutation(EG))
        level = np.array([0.8 - gap * (j + j // EG) for j in range(E)])   # an extra gap between bands
        j = top_k - 1 if (top_k - 1) // EG == top_k // EG else top_k - 2   # tie pair (j, j+1), one band
        if r.random() < 0.5 and j > 0:
            j -= 1                                   # sometimes inside the top-k (only the order shows it)
        band = range((j // EG) * EG, (j // EG + 1) * EG)
        mate = [i for i in band if i != j and order[i] % 2 == order[j] % 2][0]
        order[j + 1], order[mate] = order[mate], order[j + 1]
        level[j] = level[j + 1]
        for rank, e in enumerate(order):
            p = level[rank] - bias[e]
            logits[t, e] = np.log(p / (1 - p))
    return logits, bias


@st.composite
def router_cases(draw):
    T, E, top_k, G, KG = draw(bucket(ROUTER_SHAPES))
    combine = draw(bucket(["unbiased", "biased"]))
    renorm = draw(bucket([True, False]))
    scaling = draw(bucket([2.446, 1.0]))
    r = rng(draw(seeds()))
    logits, bias = router_logits(r, T, E, top_k, G, KG)
    kw = {"top_k": top_k, "num_groups": G, "topk_groups": KG, "renormalize": renorm, "scaling": scaling,
          "combine": combine}
    return Case({"logits": logits, "bias": bias}, kw,
                label=f"T={T} E={E} k={top_k} groups={G}/{KG} {combine}{' renorm' if renorm else ''}")


def swiglu_case(T, D, F, seed) -> Case:
    r = rng(seed)
    return Case({"x": normal(r, (T, D)), "w_gate": normal(r, (F, D), D ** -0.5),
                 "w_up": normal(r, (F, D), D ** -0.5), "w_down": normal(r, (D, F), F ** -0.5)},
                label=f"T={T} D={D} F={F}")


@st.composite
def swiglu_cases(draw):
    T, D, F = draw(bucket([(1, 48, 16), (4, 32, 48), (9, 64, 100)]))
    return swiglu_case(T, D, F, draw(seeds()))


@st.composite
def experts_cases(draw):
    T, D, F, E, k = draw(bucket([(3, 32, 16, 4, 2), (2, 32, 24, 6, 3), (9, 48, 40, 8, 2)]))
    r = rng(draw(seeds()))
    ids = np.stack([r.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64)
    w = r.uniform(0.1, 1.0, size=(T, k))
    w = 2.446 * w / w.sum(1, keepdims=True)
    return Case({"x": normal(r, (T, D)), "weights": w, "ids": ids,
                 "w1": normal(r, (E, F, D), D ** -0.5), "w2": normal(r, (E, D, F), F ** -0.5),
                 "w3": normal(r, (E, F, D), D ** -0.5)}, label=f"T={T} D={D} F={F} E={E} k={k}")


def router_logits_case(T, D, E, seed) -> Case:
    r = rng(seed)
    return Case({"x": normal(r, (T, D)), "weight": normal(r, (E, D), D ** -0.5)}, label=f"T={T} D={D} E={E}")


@st.composite
def router_logits_cases(draw):
    T, D, E = draw(bucket([(5, 64, 16), (1, 128, 48), (3, 96, 32)]))
    return router_logits_case(T, D, E, draw(seeds()))


@st.composite
def wide_swiglu_cases(draw, space="full"):
    """Any token count, hidden and FFN width (parity search)."""
    T, D = draw(wide_rows(space, dims=(1, 7, 16, 64, 100, 256, 1000), max_rows=16))
    F = draw(bucket([f for f in (1, 7, 16, 60, 128, 1024) if f * D <= WIDE_ELEMENTS[space]] or [1]))
    return swiglu_case(T, D, F, draw(seeds()))


@st.composite
def wide_router_logits_cases(draw, space="full"):
    """Any token count, hidden width and expert count (parity search)."""
    T, D = draw(wide_rows(space, dims=(1, 7, 16, 64, 100, 256, 2304), max_rows=16))
    E = draw(bucket([e for e in (1, 7, 16, 64, 256) if e * D <= WIDE_ELEMENTS[space]] or [1]))
    return router_logits_case(T, D, E, draw(seeds()))
