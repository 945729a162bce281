"""Named semantic bugs of the MoE ops, per op: the wrap mutants' transformations of the real
candidate's inputs, keyword arguments and outputs, and the internal ones evaluated by the emulation
(parity/mutants.py)."""
from __future__ import annotations

import torch

from parity.mutants import internal, wrap
from parity.registry import Mutant

from . import emulate


# -- router_logits ---------------------------------------------------------------------------------
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


ROUTER_LOGITS = (
    wrap("expert_rows_shifted", "logit e computed from row e - 1 of the router weight", inputs=_expert_rows_shifted),
    wrap("hidden_last_dim_dropped", "the last hidden column left out of the contraction", inputs=_hidden_last_dropped),
    wrap("weight_rounded_to_bf16", "the fp32 router weight cast to the activations' bf16 "
         "(F.linear(x, W.to(x.dtype)))", inputs=_weight_bf16),
    wrap("tf32_operands", "x and the weight rounded to TF32 (a TF32 tl.dot or cuBLAS GEMM)", inputs=_tf32_operands),
    wrap("scores_returned", "sigmoid scores returned in place of the logits", outputs=_scores_returned),
)


# -- router ----------------------------------------------------------------------------------------
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


ROUTER = (
    Mutant("tie_break_flipped", "ties go to the higher expert (and group) index", "wrap", _TieBreakFlipped()),
    wrap("bias_used_in_combine", "combine weights from score + bias (the other variant)", kwargs=_flip_combine),
    wrap("bias_ignored_in_selection", "the correction bias not added for selection", inputs=_no_bias),
    wrap("renormalize_flipped", "renormalization of the combine weights toggled", kwargs=_flip_renorm),
)


# -- swiglu, experts -------------------------------------------------------------------------------
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


SWIGLU = (
    wrap("gate_up_swapped", "silu applied to the up projection", inputs=_swap_gate_up),
    internal("relu_activation", "ReLU in place of SiLU", emulate.swiglu),
    internal("sigmoid_activation", "sigmoid in place of SiLU", emulate.swiglu),
)

EXPERTS = (
    wrap("ids_off_by_one", "expert e's weights read for id e - 1", inputs=_ids_plus_one),
    wrap("weights_ignored", "combine weights taken as 1", inputs=_weights_one),
    wrap("w1_w3_swapped", "gate and up projections swapped", inputs=_swap_13),
    internal("relu_activation", "ReLU in place of SiLU", emulate.experts),
)
