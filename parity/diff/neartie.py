"""The near-tie primitive: is a greedy-token flip between two paths benign noise or a bug?

Rule (docs/error-bounds.md, "Near-ties"): with reference logits ``r`` (float64) and optimized
logits ``o`` at one decode step, ``i = argmax r`` and ``j = argmax o``:

- ``match`` when ``i == j``;
- otherwise the reference margin ``m = r[i] - r[j] >= 0`` is compared with the flip bound
  ``b = e_i + e_j``: a flip needs the errors on both tokens, so the bound is twice the per-logit
  noise ``e``; ``near-tie`` when ``m <= b``, ``diverged`` when ``m > b``.

The per-logit noise ``e`` is, unless the caller passes ``bound=`` (a per-logit bound, scalar or
``[vocab]``, e.g. from an op-level model), the larger of

- the measured noise: a high quantile (99th; the max below 100 tokens) of ``|o - r|`` over the
  vocabulary **excluding the two tokens being judged**, so that a bug confined to those logits
  cannot excuse itself, and one outlier elsewhere cannot inflate the bound;
- the dtype floor: the rounding of each logit to the optimized dtype, ``u * |r[t]|``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bounds.core import UNIT_ROUNDOFF, dtype_name
from ..metrics import round_to, to_numpy

QUANTILE = 0.99
MIN_FOR_QUANTILE = 100


@dataclass(frozen=True)
class StepVerdict:
    verdict: str          # "match" | "near-tie" | "diverged"
    ref_token: int
    opt_token: int
    margin: float         # r[ref_token] - r[opt_token] (0 for a match)
    bound: float          # flip bound: per-logit noise on both tokens
    ratio: float          # margin / bound
    noise: float          # measured per-logit noise (quantile of |o - r| off the two tokens); NaN
                          # when a bound is given (the engine under test never sets its own noise)
    floor: float          # dtype model floor of the flip bound (u |r_i| + u |r_j|)
    dtype: str            # the dtype model used
    model: str            # how the bound was formed

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def infer_dtype(opt) -> str:
    """The optimized logits' dtype: from the tensor/array type, or, for float64 values, the
    narrowest of bfloat16/float16/float32 that represents every value exactly."""
    s = str(getattr(opt, "dtype", "")).replace("torch.", "")
    if s in ("bfloat16", "float16", "float32"):
        return s
    a = to_numpy(opt)
    a = a[np.isfinite(a)]
    for d in ("bfloat16", "float16", "float32"):
        if np.array_equal(round_to(a, d), a):
            return d
    return "float64"


def classify_step(ref_logits, opt_logits, *, bound=None, dtype=None) -> StepVerdict:
    """Classify one decode step (module docstring). ``ref_logits``, ``opt_logits``: ``[vocab]``
    (NumPy or torch); ``bound``: optional per-logit error bound (scalar or ``[vocab]``) replacing
    the measured noise; ``dtype``: the optimized dtype for the floor (inferred when omitted)."""
    r = to_numpy(ref_logits).astype(np.float64).ravel()
    dname = dtype_name(dtype) if dtype is not None else infer_dtype(opt_logits)
    o = to_numpy(opt_logits).astype(np.float64).ravel()
    if r.shape != o.shape:
        raise ValueError(f"classify_step: logits shapes differ: reference {r.shape}, optimized {o.shape}")
    if r.size == 0:
        raise ValueError("classify_step: empty logits")
    i = int(np.argmax(r))
    j = int(np.argmax(np.where(np.isnan(o), -np.inf, o)))
    u = UNIT_ROUNDOFF[dname]
    floor_i, floor_j = float(u * abs(r[i])), float(u * abs(r[j]))
    noise = float("nan") if bound is not None else _measured_noise(r, o, i, j)
    if bound is not None:
        b = np.broadcast_to(np.asarray(bound, dtype=np.float64), r.shape)
        e_i, e_j = float(b[i]), float(b[j])
        model = "given per-logit bound on both tokens"
    else:
        e_i, e_j = max(noise, floor_i), max(noise, floor_j)
        model = (f"per logit max(q{int(QUANTILE * 100)}(|o - r|) off the two tokens, u_{dname} |r|), "
                 "on both tokens")
    flip = e_i + e_j
    if not np.isfinite(o[j]) or not np.all(np.isfinite(o)):
        nonfinite = True
    else:
        nonfinite = False
    if i == j and not nonfinite:
        return StepVerdict("match", i, j, 0.0, flip, 0.0, noise, floor_i + floor_j, dname, model)
    margin = float(r[i] - r[j])
    ratio = margin / flip if flip > 0 else (0.0 if margin == 0 else float("inf"))
    if nonfinite:
        verdict = "diverged"
        model += "; non-finite optimized logits"
    else:
        verdict = "near-tie" if margin <= flip else "diverged"
    return StepVerdict(verdict, i, j, margin, flip, ratio, noise, floor_i + floor_j, dname, model)


def _measured_noise(r: np.ndarray, o: np.ndarray, i: int, j: int) -> float:
    """The high quantile of ``|o - r|`` off the tokens ``i`` and ``j`` (the max below
    MIN_FOR_QUANTILE logits; 0 when none is finite)."""
    err = np.abs(o - r)
    keep = np.ones(r.size, bool)
    keep[[i, j]] = False
    rest = err[keep]
    rest = rest[np.isfinite(rest)] if rest.size else rest
    if rest.size == 0:
        return 0.0
    return float(np.max(rest)) if rest.size < MIN_FOR_QUANTILE else float(np.quantile(rest, QUANTILE))


def twin_bound(ref_logits, twin_logits, *, dtype) -> np.ndarray:
    """Per-logit noise ``[vocab]`` measured on a certified twin (``parity.diff.twin``): a correct
    implementation at ``dtype`` fed the same tokens. Per logit ``v``: the larger of the twin's
    high quantile of ``|t - r|`` over the vocabulary (QUANTILE; the max below MIN_FOR_QUANTILE
    logits), its own ``|t_v - r_v|`` and the dtype floor ``u |r_v|``. Pass it as ``bound=`` to
    ``classify_step``: the engine under test never sets its own noise."""
    r = to_numpy(ref_logits).astype(np.float64).ravel()
    t = to_numpy(twin_logits).astype(np.float64).ravel()
    if r.shape != t.shape:
        raise ValueError(f"twin_bound: logits shapes differ: reference {r.shape}, twin {t.shape}")
    err = np.abs(t - r)
    ok = err[np.isfinite(err)]  # an engine that is its own twin may hold NaN: never a noise
    q = 0.0 if ok.size == 0 else float(np.max(ok)) if ok.size < MIN_FOR_QUANTILE else float(np.quantile(ok, QUANTILE))
    return np.maximum(np.where(np.isfinite(err), np.maximum(err, q), q), UNIT_ROUNDOFF[dtype_name(dtype)] * np.abs(r))
