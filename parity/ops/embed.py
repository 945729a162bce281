"""Records: embed.embedding, embed.lm_head."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from reference import embed as ref

from ..bounds import moe as bounds
from ..emulate import embed as emu
from ..mutants import wrap
from ..registry import Case, OpRecord, Ref
from ..strategies import WIDE_ELEMENTS, bucket, normal, rng, seeds, wide_rows


@st.composite
def embedding_cases(draw):
    T, Vocab, D = draw(bucket([(7, 50, 32), (12, 300, 48)]))
    r = rng(draw(seeds()))
    ids = r.integers(0, Vocab, size=T).astype(np.int64)
    ids[:2] = [0, Vocab - 1]
    return Case({"ids": ids, "table": normal(r, (Vocab, D))}, label=f"T={T} vocab={Vocab} D={D}")


@st.composite
def lm_head_cases(draw):
    T, D, Vocab = draw(bucket([(5, 32, 100), (3, 64, 257)]))
    r = rng(draw(seeds()))
    return Case({"h": normal(r, (T, D)), "weight": normal(r, (Vocab, D), D ** -0.5)},
                label=f"T={T} D={D} vocab={Vocab}")


@st.composite
def wide_lm_head_cases(draw, space="full"):
    """Any token count, width and vocabulary up to the space's cap (parity search)."""
    T, D = draw(wide_rows(space, max_rows=16))
    vocab = draw(st.integers(1, max(1, min(1 << 14, WIDE_ELEMENTS[space] // D))))
    r = rng(draw(seeds()))
    return Case({"h": normal(r, (T, D)), "weight": normal(r, (vocab, D), D ** -0.5)},
                label=f"T={T} D={D} vocab={vocab}")


def _ids_plus_one(d):
    d["ids"] = (d["ids"] + 1) % d["table"].shape[0]
    return d


def _ids_reversed(d):
    d["ids"] = d["ids"].flip(0).contiguous()
    return d


def _roll_cols(out, inp):
    out["y"] = out["y"].roll(1, dims=-1)
    return out


def _rows_shifted(d):
    d["weight"] = d["weight"].roll(1, dims=0).contiguous()
    return d


def _scaled(out, inp):
    out["logits"] = out["logits"] * inp["h"].shape[-1] ** -0.5
    return out


def _last_dim_dropped(d):
    d["h"] = d["h"].clone()
    d["h"][..., -1] = 0
    return d


EMBEDDING = OpRecord(
    name="embed.embedding", reference=ref.embedding, optimized=Ref("optimized.embed", "embedding"),
    emulated=emu.embedding, inputs=embedding_cases, bound=bounds.embedding, outputs=("y",),
    args=("ids", "table"), policy={"ids": "int"}, exact=("y",), reductions="none",
    batch={"inputs": {"ids": 0}, "outputs": {"y": 0}}, bound_doc="exact (a gather)",
    mutants=(
        wrap("ids_off_by_one", "row id + 1 gathered", inputs=_ids_plus_one),
        wrap("ids_reversed", "tokens gathered in reverse order", inputs=_ids_reversed),
        wrap("columns_rolled", "hidden columns shifted by one", outputs=_roll_cols),
    ))

LM_HEAD = OpRecord(
    name="embed.lm_head", reference=ref.lm_head, optimized=Ref("optimized.embed", "lm_head"),
    emulated=emu.lm_head, inputs=lm_head_cases, wide=wide_lm_head_cases, bound=bounds.lm_head, outputs=("logits",),
    args=("h", "weight"), reductions="D", batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc="gamma_D(ua) |h| |W|^T + uo |logits|",
    mutants=(
        wrap("vocab_rows_shifted", "logit i computed from row i - 1 of the head", inputs=_rows_shifted),
        wrap("logit_scale_applied", "logits scaled by D^-0.5 (a tied-embedding convention)", outputs=_scaled),
        wrap("hidden_last_dim_dropped", "the last hidden column left out of the contraction",
             inputs=_last_dim_dropped),
    ))


def records() -> list[OpRecord]:
    return [EMBEDDING, LM_HEAD]
