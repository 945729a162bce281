"""Records: moe.router_logits, moe.router, moe.swiglu, moe.experts.
"""
from __future__ import annotations

from optimized import moe as fast
from parity.registry import OpRecord
from reference import moe as ref

from . import bounds, emulate, mutants
from .inputs import (experts_cases, router_cases, router_logits_cases, swiglu_cases, wide_router_logits_cases,
                     wide_swiglu_cases)

ROUTER_LOGITS = OpRecord(
    name="moe.router_logits", reference=ref.router_logits,
    optimized=fast.router_logits, emulated=emulate.router_logits, inputs=router_logits_cases,
    wide=wide_router_logits_cases,
    bound=bounds.router_logits, outputs=("logits",), args=("x", "weight"),
    policy={"weight": "fp32"}, reductions="D", batch={"inputs": {"x": 0}, "outputs": {"logits": 0}},
    bound_doc="gamma_D(ua) |x| |W|^T + uo |logits| (W fp32 in every run: no storage term)",
    mutants=mutants.ROUTER_LOGITS)

ROUTER = OpRecord(
    name="moe.router", reference=ref.router, optimized=fast.router,
    emulated=emulate.router, inputs=router_cases, bound=bounds.router, outputs=("weights", "ids"),
    args=("logits", "bias"), policy={"bias": "fp32"}, exact=("ids",), reductions="k_e",
    batch={"inputs": {"logits": 0}, "outputs": {"weights": 0, "ids": 0}},
    bound_doc="weights: (rel(s_id) + sum rel / sum + gamma_k(ua) + 3 ua + uo) |w|, rel(s) = (5 + |logit|) ua; ids exact",
    mutants=mutants.ROUTER)

SWIGLU_DOC = ("gamma_F(ua)|a||Wd|^T + LAMBDA sqrt(da^2 (Wd^2)^T) + uo|y|, a = silu(h_g) h_u, "
              "da from gamma_D(ua)|x||W|^T and u |h| (stored)")

SWIGLU = OpRecord(
    name="moe.swiglu", reference=ref.swiglu, optimized=fast.swiglu,
    emulated=emulate.swiglu, inputs=swiglu_cases, wide=wide_swiglu_cases, bound=bounds.swiglu, outputs=("y",),
    args=("x", "w_gate", "w_up", "w_down"), reductions="D, F", batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc=SWIGLU_DOC, mutants=mutants.SWIGLU)

EXPERTS = OpRecord(
    name="moe.experts", reference=ref.experts, optimized=fast.experts,
    emulated=emulate.experts, inputs=experts_cases, bound=bounds.experts, outputs=("y",),
    args=("x", "weights", "ids", "w1", "w2", "w3"), policy={"weights": "fp32", "ids": "int"},
    reductions="D, F, k_e", batch={"inputs": {"x": 0, "weights": 0, "ids": 0}, "outputs": {"y": 0}},
    bound_doc="sum_k |w_k| (swiglu bound + u |y_k|) + gamma_k(ua) sum_k |w_k y_k| + (ua + uo)|y|",
    mutants=mutants.EXPERTS)


def records() -> list[OpRecord]:
    return [ROUTER_LOGITS, ROUTER, SWIGLU, EXPERTS]
