"""Records: moe.router_logits, moe.router, moe.swiglu, moe.experts.

The router's inputs are built so that its discrete decisions are well defined: selection scores
``sigmoid(logit) + bias`` sit on separated levels (grouped runs: each group a band of levels, so
group scores are separated too), and every token has one exact tie (two experts with the same
logit and bias) at or inside the top-k boundary, where the contract's "lower index wins" decides.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from reference import moe as ref

from ..bounds import moe as bounds
from ..emulate import moe as emu
from ..mutants import internal, wrap
from ..registry import Case, Mutant, OpRecord, Ref
from ..strategies import WIDE_ELEMENTS, bucket, normal, rng, seeds, wide_rows

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


@st.composite
def swiglu_cases(draw):
    T, D, F = draw(bucket([(1, 48, 16), (4, 32, 48), (9, 64, 100)]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (T, D)), "w_gate": normal(r, (F, D), D ** -0.5),
                 "w_up": normal(r, (F, D), D ** -0.5), "w_down": normal(r, (D, F), F ** -0.5)},
                label=f"T={T} D={D} F={F}")


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


@st.composite
def router_logits_cases(draw):
    T, D, E = draw(bucket([(5, 64, 16), (1, 128, 48), (3, 96, 32)]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (T, D)), "weight": normal(r, (E, D), D ** -0.5)},
                label=f"T={T} D={D} E={E}")


@st.composite
def wide_swiglu_cases(draw, space="full"):
    """Any token count, hidden and FFN width (parity search)."""
    T, D = draw(wide_rows(space, dims=(1, 7, 16, 64, 100, 256, 1000), max_rows=16))
    F = draw(bucket([f for f in (1, 7, 16, 60, 128, 1024) if f * D <= WIDE_ELEMENTS[space]] or [1]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (T, D)), "w_gate": normal(r, (F, D), D ** -0.5),
                 "w_up": normal(r, (F, D), D ** -0.5), "w_down": normal(r, (D, F), F ** -0.5)},
                label=f"T={T} D={D} F={F}")


@st.composite
def wide_router_logits_cases(draw, space="full"):
    """Any token count, hidden width and expert count (parity search)."""
    T, D = draw(wide_rows(space, dims=(1, 7, 16, 64, 100, 256, 2304), max_rows=16))
    E = draw(bucket([e for e in (1, 7, 16, 64, 256) if e * D <= WIDE_ELEMENTS[space]] or [1]))
    r = rng(draw(seeds()))
    return Case({"x": normal(r, (T, D)), "weight": normal(r, (E, D), D ** -0.5)}, label=f"T={T} D={D} E={E}")


# -- router_logits mutants ------------------------------------------------------------------------
def _expert_rows_shifted(d):
    d["weight"] = d["weight"].roll(1, dims=0).contiguous()
    return d


def _hidden_last_dropped(d):
    d["x"] = d["x"].clone()
    d["x"][..., -1] = 0
    return d


def _weight_bf16(d):
    d["weight"] = d["weight"].to(torch.bfloat16).to(d["weight"].dtype)
    return d


def _tf32(t):
    """``t`` rounded to TF32 (10 explicit mantissa bits, nearest, ties away: ``cvt.rna.tf32.f32``)."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(t.dtype)


def _tf32_operands(d):
    d["x"], d["weight"] = _tf32(d["x"]), _tf32(d["weight"])
    return d


def _scores_returned(out, inp):
    out["logits"] = torch.sigmoid(out["logits"])
    return out


ROUTER_LOGITS = OpRecord(
    name="moe.router_logits", reference=ref.router_logits,
    optimized=Ref("optimized.moe", "router_logits"), emulated=emu.router_logits, inputs=router_logits_cases,
    wide=wide_router_logits_cases,
    bound=bounds.router_logits, outputs=("logits",), args=("x", "weight"),
    policy={"weight": "fp32"}, reductions="D", batch={"inputs": {"x": 0}, "outputs": {"logits": 0}},
    bound_doc="gamma_D(ua) |x| |W|^T + uo |logits| (W fp32 in every run: no storage term)",
    mutants=(
        wrap("expert_rows_shifted", "logit e computed from row e - 1 of the router weight",
             inputs=_expert_rows_shifted),
        wrap("hidden_last_dim_dropped", "the last hidden column left out of the contraction",
             inputs=_hidden_last_dropped),
        wrap("weight_rounded_to_bf16", "the fp32 router weight cast to the activations' bf16 "
             "(F.linear(x, W.to(x.dtype)))", inputs=_weight_bf16),
        wrap("tf32_operands", "x and the weight rounded to TF32 (a TF32 tl.dot or cuBLAS GEMM)",
             inputs=_tf32_operands),
        wrap("scores_returned", "sigmoid scores returned in place of the logits", outputs=_scores_returned),
    ))


# -- router mutants -------------------------------------------------------------------------------
class _TieBreakFlipped:
    """Wrap mutant: experts (and groups) indexed in reverse, so every tie goes to the higher index."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            inp = dict(inp)
            E = inp["logits"].shape[-1]
            inp["logits"] = inp["logits"].flip(-1).contiguous()
            inp["bias"] = inp["bias"].flip(-1).contiguous()
            out = dict(cand(inp, kw))
            out["ids"] = (E - 1) - out["ids"]
            return out

        return mutated


def _flip_combine(kw):
    kw["combine"] = "unbiased" if kw.get("combine", "unbiased") == "biased" else "biased"
    return kw


def _no_bias(d):
    d["bias"] = torch.zeros_like(d["bias"])
    return d


def _flip_renorm(kw):
    kw["renormalize"] = not kw.get("renormalize", True)
    return kw


ROUTER = OpRecord(
    name="moe.router", reference=ref.router, optimized=Ref("optimized.moe", "router"),
    emulated=emu.router, inputs=router_cases, bound=bounds.router, outputs=("weights", "ids"),
    args=("logits", "bias"), policy={"bias": "fp32"}, exact=("ids",), reductions="k_e",
    batch={"inputs": {"logits": 0}, "outputs": {"weights": 0, "ids": 0}},
    bound_doc="weights: (rel(s_id) + sum rel / sum + gamma_k(ua) + 3 ua + uo) |w|, rel(s) = (5 + |logit|) ua; ids exact",
    mutants=(
        Mutant("tie_break_flipped", "ties go to the higher expert (and group) index", "wrap", _TieBreakFlipped()),
        wrap("bias_used_in_combine", "combine weights from score + bias (the other variant)", kwargs=_flip_combine),
        wrap("bias_ignored_in_selection", "the correction bias not added for selection", inputs=_no_bias),
        wrap("renormalize_flipped", "renormalization of the combine weights toggled", kwargs=_flip_renorm),
    ))


def _swap_gate_up(d):
    d["w_gate"], d["w_up"] = d["w_up"], d["w_gate"]
    return d


def _swap_13(d):
    d["w1"], d["w3"] = d["w3"], d["w1"]
    return d


def _ids_plus_one(d):
    E = d["w1"].shape[0]
    d["ids"] = (d["ids"] + 1) % E
    return d


def _weights_one(d):
    d["weights"] = torch.ones_like(d["weights"])
    return d


SWIGLU_DOC = ("gamma_F(ua)|a||Wd|^T + LAMBDA sqrt(da^2 (Wd^2)^T) + uo|y|, a = silu(h_g) h_u, "
              "da from gamma_D(ua)|x||W|^T and u |h| (stored)")

SWIGLU = OpRecord(
    name="moe.swiglu", reference=ref.swiglu, optimized=Ref("optimized.moe", "swiglu"),
    emulated=emu.swiglu, inputs=swiglu_cases, wide=wide_swiglu_cases, bound=bounds.swiglu, outputs=("y",),
    args=("x", "w_gate", "w_up", "w_down"), reductions="D, F", batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc=SWIGLU_DOC,
    mutants=(
        wrap("gate_up_swapped", "silu applied to the up projection", inputs=_swap_gate_up),
        internal("relu_activation", "ReLU in place of SiLU", emu.swiglu),
        internal("sigmoid_activation", "sigmoid in place of SiLU", emu.swiglu),
    ))

EXPERTS = OpRecord(
    name="moe.experts", reference=ref.experts, optimized=Ref("optimized.moe", "experts"),
    emulated=emu.experts, inputs=experts_cases, bound=bounds.experts, outputs=("y",),
    args=("x", "weights", "ids", "w1", "w2", "w3"), policy={"weights": "fp32", "ids": "int"},
    reductions="D, F, k_e", batch={"inputs": {"x": 0, "weights": 0, "ids": 0}, "outputs": {"y": 0}},
    bound_doc="sum_k |w_k| (swiglu bound + u |y_k|) + gamma_k(ua) sum_k |w_k y_k| + (ua + uo)|y|",
    mutants=(
        wrap("ids_off_by_one", "expert e's weights read for id e - 1", inputs=_ids_plus_one),
        wrap("weights_ignored", "combine weights taken as 1", inputs=_weights_one),
        wrap("w1_w3_swapped", "gate and up projections swapped", inputs=_swap_13),
        internal("relu_activation", "ReLU in place of SiLU", emu.experts),
    ))


def records() -> list[OpRecord]:
    return [ROUTER_LOGITS, ROUTER, SWIGLU, EXPERTS]
