"""Bounds of the MoE ops (docs/error-bounds.md, section 6).

GEMMs: a D-long dot accumulated in ua errs by gamma_D(ua) |x| |W|^T (componentwise; ``Precision.dot``:
plus the rounding of its operands under a TF32 or bf16 contract). Values the
kernel stores in the run dtype between GEMMs (the SwiGLU hidden activation, each expert's output)
err by u relatively; those independent roundings pass the next GEMM as a probabilistic sum
(LAMBDA sqrt(sum (W e)^2)). Router ids are compared exactly: the input builder keeps distinct
selection scores far apart and makes ties exact, where the contract's lower-index rule decides.
"""
from __future__ import annotations

import numpy as np

from parity.bounds.core import LAMBDA, exp_rel, gamma, sig, silu_prime


def swiglu_err(x, wg, wu, wd, p):
    """(y, |dy| bound) of down(silu(x wg^T) * (x wu^T)); x [T, D]."""
    D, F = x.shape[-1], wg.shape[0]
    ua, us = p.ua, p.u
    hg, hu = x @ wg.T, x @ wu.T
    dhg = p.dot(D) * (np.abs(x) @ np.abs(wg).T) + us * np.abs(hg)
    dhu = p.dot(D) * (np.abs(x) @ np.abs(wu).T) + us * np.abs(hu)
    sg = hg * sig(hg)
    a = sg * hu
    da = np.abs(silu_prime(hg)) * dhg * np.abs(hu) + np.abs(sg) * dhu \
        + (ua * (exp_rel(hg) + 5.0) + us) * np.abs(a)
    y = a @ wd.T
    dy = p.dot(F) * (np.abs(a) @ np.abs(wd).T) + LAMBDA * np.sqrt((da * da) @ (wd * wd).T)
    return y, dy


def swiglu(x, kw, ref, p):
    _, dy = swiglu_err(x["x"], x["w_gate"], x["w_up"], x["w_down"], p)
    return {"y": dy + p.uo("y") * np.abs(ref["y"])}


def experts(x, kw, ref, p):
    xx, wts, ids = x["x"], x["weights"], x["ids"].astype(np.int64)
    T, k = ids.shape
    acc = np.zeros_like(ref["y"])
    absy = np.zeros_like(ref["y"])
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            y, dy = swiglu_err(xx[t:t + 1], x["w1"][e], x["w3"][e], x["w2"][e], p)
            w = abs(wts[t, j])
            acc[t] += w * (dy[0] + p.u * np.abs(y[0]))
            absy[t] += w * np.abs(y[0])
    return {"y": acc + gamma(k, p.ua) * absy + (p.ua + p.uo("y")) * np.abs(ref["y"])}


def router_logits(x, kw, ref, p):
    """gamma_D(ua)|x||W|^T + uo|logits|. No storage term for W: the weight is fp32 in every run
    (policy "fp32") and the reference multiplies those same fp32 values; x likewise reaches the
    reference already rounded to the run dtype, so only the fp32 products and sums remain."""
    xx, W = x["x"], x["weight"]
    # W float32 (float64): held finer than any product's operand format
    return {"logits": p.dot(xx.shape[-1], held_b=0.0) * (np.abs(xx) @ np.abs(W).T)
            + p.uo("logits") * np.abs(ref["logits"])}


def router(x, kw, ref, p):
    """weights [T, k_e]: sigmoid (exp_rel + 3 ua relative), the optional bias add, the k-long sum of
    the renormalization, the divide and the scaling; ids: exact."""
    logits, bias, ids = x["logits"], x["bias"], ref["ids"].astype(np.int64)
    ua = p.ua
    s = sig(logits)
    ds = ua * (exp_rel(logits) + 3.0) * s
    biased = kw.get("combine", "unbiased") == "biased"
    c = s + bias[None, :] if biased else s
    dc = ds + (ua * (np.abs(s) + np.abs(bias[None, :])) if biased else 0.0)
    cs = np.take_along_axis(c, ids, axis=1)
    dcs = np.take_along_axis(dc, ids, axis=1)
    scaling = float(kw.get("scaling", 1.0))
    k = ids.shape[1]
    if kw.get("renormalize", True):
        den = np.sum(cs, axis=1, keepdims=True)
        rel = dcs / np.abs(cs) + (np.sum(dcs, axis=1, keepdims=True) + gamma(k, ua) * np.sum(np.abs(cs), axis=1, keepdims=True)) / np.abs(den) + 3 * ua
    else:
        rel = dcs / np.abs(cs) + ua
    w = ref["weights"]
    return {"weights": (rel + p.uo("weights")) * np.abs(w), "ids": np.zeros(ids.shape)}
