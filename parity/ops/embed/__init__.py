"""Records: embed.embedding, embed.lm_head.
"""
from __future__ import annotations

from optimized import embed as fast
from parity.registry import OpRecord
from reference import embed as ref

from . import bounds, emulate, mutants
from .inputs import embedding_cases, lm_head_cases, wide_lm_head_cases

EMBEDDING = OpRecord(
    name="embed.embedding", reference=ref.embedding, optimized=fast.embedding,
    emulated=emulate.embedding, inputs=embedding_cases, bound=bounds.embedding, outputs=("y",),
    args=("ids", "table"), policy={"ids": "int"}, exact=("y",), reductions="none",
    batch={"inputs": {"ids": 0}, "outputs": {"y": 0}}, bound_doc="exact (a gather)", mutants=mutants.EMBEDDING)

LM_HEAD = OpRecord(
    name="embed.lm_head", reference=ref.lm_head, optimized=fast.lm_head,
    emulated=emulate.lm_head, inputs=lm_head_cases, wide=wide_lm_head_cases, bound=bounds.lm_head, outputs=("logits",),
    args=("h", "weight"), reductions="D", batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc="gamma_D(ua) |h| |W|^T + uo |logits|", mutants=mutants.LM_HEAD)


def records() -> list[OpRecord]:
    return [EMBEDDING, LM_HEAD]
