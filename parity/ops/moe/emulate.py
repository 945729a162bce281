"""MoE ops in torch at float32 arithmetic (see parity.emulate).

Mutations: router ``tie_break_flipped`` (ties go to the higher expert index); SwiGLU/experts
``relu_activation`` (ReLU for SiLU), ``sigmoid_activation``.
"""
from __future__ import annotations

import torch

from parity.emulate import cdt, check_mutation


def router_logits(x, weight):
    """x @ weight.T in fp32 (fp64 for fp64 x); the fp32 logits are returned as computed."""
    cd = cdt(x.dtype)
    return x.to(cd) @ weight.to(cd).T


def router(logits, bias, *, top_k, num_groups=1, topk_groups=1, renormalize=True, scaling=1.0,
           combine="unbiased", mutation=None):
    check_mutation("router", mutation, ("tie_break_flipped",))
    cd = cdt(logits.dtype)
    s = torch.sigmoid(logits.to(cd))
    sel = s + bias.to(cd)[None, :]
    T, E = sel.shape
    if mutation == "tie_break_flipped":
        order = torch.arange(E - 1, -1, -1, device=sel.device)
    else:
        order = torch.arange(E, device=sel.device)
    if num_groups > 1:
        gs = sel.view(T, num_groups, E // num_groups).topk(2, dim=-1).values.sum(-1)
        keep = _stable_topk(gs, topk_groups, torch.arange(num_groups, device=sel.device))
        gmask = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device)
        gmask.scatter_(1, keep, True)
        emask = gmask.repeat_interleave(E // num_groups, dim=1)
        sel = sel.masked_fill(~emask, -float("inf"))
    ids = _stable_topk(sel, top_k, order)
    c = s + bias.to(cd)[None, :] if combine == "biased" else s
    w = torch.gather(c, 1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * scaling
    return w.to(logits.dtype), ids


def _stable_topk(x, k, order):
    """Top-k of each row by value, ties by position in ``order`` (earlier wins), descending."""
    xo = x[:, order]
    idx = torch.sort(xo, dim=1, descending=True, stable=True).indices[:, :k]
    return order[idx]


def _act(h, mutation):
    if mutation == "relu_activation":
        return torch.relu(h)
    if mutation == "sigmoid_activation":
        return torch.sigmoid(h)
    return h * torch.sigmoid(h)


def swiglu(x, w_gate, w_up, w_down, *, mutation=None):
    check_mutation("swiglu", mutation, ("relu_activation", "sigmoid_activation"))
    cd = cdt(x.dtype)
    xc = x.to(cd)
    a = _act(xc @ w_gate.to(cd).T, mutation) * (xc @ w_up.to(cd).T)
    return (a @ w_down.to(cd).T).to(x.dtype)


def experts(x, weights, ids, w1, w2, w3, *, mutation=None):
    check_mutation("experts", mutation, ("relu_activation", "sigmoid_activation"))
    cd = cdt(x.dtype)
    T, k = ids.shape
    y = torch.zeros(T, x.shape[1], dtype=cd, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            xt = x[t:t + 1].to(cd)
            a = _act(xt @ w1[e].to(cd).T, mutation) * (xt @ w3[e].to(cd).T)
            y[t] += weights[t, j].to(cd) * (a @ w2[e].to(cd).T)[0]
    return y.to(x.dtype)
