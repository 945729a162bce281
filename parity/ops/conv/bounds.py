"""Bounds of the short convolution (docs/error-bounds.md, section 3), and of its in-place decode
step over a state pool.

Pre-activation z = sum of W products, accumulated in ua: |dz| <= gamma_W(ua) sum_j |w_j x_j|. SiLU's
slope is at most 1.0999, so dz reaches y at most that amplified, plus SiLU's own rounding and the
output rounding. The state is a copy of inputs: compared bit for bit (bound 0).
"""
from __future__ import annotations

import numpy as np

from parity.bounds.core import exp_rel, gamma, silu_prime
from parity.ops import _slots


def _act(z, absum, W, y, p, out="y"):
    dz = gamma(W, p.ua) * absum + p.ua * np.abs(z)
    return np.abs(silu_prime(z)) * dz + (p.ua * (exp_rel(z) + 4.0) + p.uo(out)) * np.abs(y)


def _weight(w):
    return w[:, 0, :] if w.ndim == 3 else w


def short_conv(x, kw, ref, p):
    xx, w = x["x"], _weight(x["weight"])
    B, T, C = xx.shape
    W = w.shape[1]
    h0 = x.get("initial_state")
    h0 = np.zeros((B, C, W - 1)) if h0 is None else h0
    xp = np.concatenate([h0.transpose(0, 2, 1), xx], axis=1)
    z = np.zeros((B, T, C))
    a = np.zeros((B, T, C))
    for j in range(W):
        z += w[:, j] * xp[:, j:j + T, :]
        a += np.abs(w[:, j] * xp[:, j:j + T, :])
    return {"y": _act(z, a, W, ref["y"], p), "final_state": np.zeros_like(ref["final_state"])}


def short_conv_step(x, kw, ref, p):
    xx, w, st = x["x"], _weight(x["weight"]), x["state"]
    win = np.concatenate([st, xx[:, :, None]], axis=2)
    z = np.sum(w[None] * win, axis=2)
    a = np.sum(np.abs(w[None] * win), axis=2)
    W = w.shape[1]
    return {"y": _act(z, a, W, ref["y"], p), "new_state": np.zeros_like(ref["new_state"])}


def short_conv_step_(x, kw, r, p):
    """:func:`short_conv_step`'s model on the named rows; padding outputs and the whole pool exact."""
    rows, slots = _slots.valid(x)
    y_b = np.zeros(np.shape(r["y"]))
    if rows.size:
        sub = {"x": x["x"][rows], "weight": x["weight"], "state": x["state_pool"][slots]}
        rr = {"y": r["y"][rows], "new_state": r["state_pool"][slots]}
        y_b[rows] = short_conv_step(sub, kw, rr, p)["y"]
    return {"y": y_b, "state_pool": np.zeros(np.shape(r["state_pool"]))}
