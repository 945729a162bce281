"""Inputs of the embedding and the LM head (hypothesis strategies of :class:`parity.registry.Case`)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from parity.registry import Case
from parity.strategies import WIDE_ELEMENTS, bucket, normal, rng, seeds, wide_rows


@st.composite
def embedding_cases(draw):
    T, Vocab, D = draw(bucket([(7, 50, 32), (12, 300, 48)]))
    r = rng(draw(seeds()))
    ids = r.integers(0, Vocab, size=T).astype(np.int64)
    ids[:2] = [0, Vocab - 1]
    return Case({"ids": ids, "table": normal(r, (Vocab, D))}, label=f"T={T} vocab={Vocab} D={D}")


def lm_head_case(T, D, vocab, seed) -> Case:
    r = rng(seed)
    return Case({"h": normal(r, (T, D)), "weight": normal(r, (vocab, D), D ** -0.5)},
                label=f"T={T} D={D} vocab={vocab}")


@st.composite
def lm_head_cases(draw):
    T, D, vocab = draw(bucket([(5, 32, 100), (3, 64, 257)]))
    return lm_head_case(T, D, vocab, draw(seeds()))


@st.composite
def wide_lm_head_cases(draw, space="full"):
    """Any token count, width and vocabulary up to the space's cap (parity search)."""
    T, D = draw(wide_rows(space, max_rows=16))
    vocab = draw(st.integers(1, max(1, min(1 << 14, WIDE_ELEMENTS[space] // D))))
    return lm_head_case(T, D, vocab, draw(seeds()))
