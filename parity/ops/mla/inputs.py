"""Inputs of the MLA attention ops (hypothesis strategies of :class:`parity.registry.Case`): the
latent is kv_a_layernorm's output, and each case keeps the raw projection it was normed from (its
``aux``: the ``latent_not_normed`` mutant substitutes it)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from parity.registry import Case
from parity.strategies import bucket, normal, rng, seeds

# (B, T, S, N, P, R, L, Vh)
SHAPES = [(2, 4, 4, 2, 32, 8, 32, 32), (2, 3, 19, 2, 16, 8, 32, 16), (1, 1, 33, 3, 16, 16, 64, 32)]


def _latent(r, shape, L):
    """(normed latent, raw latent): kv_a_layernorm of a raw projection whose rms is far from 1."""
    raw = normal(r, shape, 3.0)
    w = 1.0 + 0.2 * normal(r, (L,))
    normed = raw / np.sqrt(np.mean(raw * raw, axis=-1, keepdims=True) + 1e-6) * w
    return normed, raw


def attention_case(B, T, S, N, P, R, L, Vh, seed, *, w_scale=1.0) -> Case:
    """An input of the contiguous forms (naive, absorbed): T queries at the end of S positions;
    ``w_scale`` scales w_kvb (larger: sharper softmax)."""
    r = rng(seed)
    lat, raw = _latent(r, (B, S, L), L)
    a = {"q": normal(r, (B, T, N, P + R)), "latent": lat, "k_pe": normal(r, (B, S, R)),
         "w_kvb": normal(r, (N * (P + Vh), L), w_scale * L ** -0.5)}
    return Case(a, aux={"latent_raw": raw}, label=f"B={B} T={T} S={S} N={N} P={P} R={R} L={L} Vh={Vh}")


@st.composite
def absorbed_cases(draw):
    B, T, S, N, P, R, L, Vh = draw(bucket(SHAPES))
    return attention_case(B, T, S, N, P, R, L, Vh, draw(seeds()))


@st.composite
def wide_attention_cases(draw, space="full"):
    """The contiguous forms over wider shapes (parity search): 1 to 8 heads, head dims 8 to 128,
    latent ranks 16 to 512 (the model's 576-wide latent keys), T queries at the end of S positions
    up to the space's cap, and sharper softmaxes (``w_kvb`` scaled up to 4x)."""
    cap = {"cheap": 1 << 14, "full": 1 << 20, "buckets": 1 << 22}[space]
    N = draw(bucket([1, 2, 4, 8]))
    P, R, Vh = (draw(bucket([8, 16, 64, 128])) for _ in range(3))
    L = draw(bucket([16, 64, 128, 512]))
    B = draw(bucket([1, 2]))
    S = draw(st.integers(1, max(1, min(512, cap // (B * (L + R + N * (P + Vh)))))))
    T = draw(st.integers(1, S))
    return attention_case(B, T, S, N, P, R, L, Vh, draw(seeds()), w_scale=draw(bucket([1.0, 2.0, 4.0])))


@st.composite
def decode_cases(draw):
    B, S, N, P, R, L, Vh, bs = draw(bucket([(2, 20, 3, 16, 16, 64, 32, 8), (3, 40, 2, 16, 8, 32, 16, 16)]))
    r = rng(draw(seeds()))
    lat, raw = _latent(r, (B, S, L), L)
    lengths = np.array([S] + [int(x) for x in r.integers(2, S + 1, size=B - 1)], dtype=np.int64)
    a = {"q": normal(r, (B, N, P + R)), "latent": lat, "k_pe": normal(r, (B, S, R)),
         "w_kvb": normal(r, (N * (P + Vh), L), L ** -0.5), "lengths": lengths}
    return Case(a, {"block_size": bs, "seed": int(r.integers(0, 2**31))}, aux={"latent_raw": raw},
                label=f"B={B} S<={S} N={N} P={P} R={R} L={L} Vh={Vh} block={bs}")


def dirty_decode(case: Case, fill: str) -> Case:
    """``case`` with the paged cache's memory holding ``fill`` before the sequences are written."""
    return Case(dict(case.arrays), dict(case.kwargs, cache_fill=fill), dict(case.aux), case.label, case.source)
