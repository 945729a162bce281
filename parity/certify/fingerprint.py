"""Which known bug a failure looks like: the ``nearest_bug`` of a certificate.

When a candidate fails on an input, each registered mutant of the op is run on the same prepared
input around a correct implementation (the record's float32 stand-in), and the candidate's error
pattern is compared with each mutant's.

The pattern of outputs ``y`` is, per element of every output (concatenated in the record's order),
the error in bound units ``e = (y - ref) / bound``, set to 0 where ``|e| <= 1`` and clipped to the
99th percentile ``c`` of the other elements' ``|e|`` (a NaN counts as ``+c``, an infinity as
``+-c``). The score is the cosine similarity of two patterns. Why this form:

- bound units put every output on one scale (the final state and ``o`` both count, whatever their
  magnitudes), and an element within its bound contributes nothing: rounding noise is no pattern;
- magnitudes are kept, so structure is compared: an error that depends on the column (a weight
  convention) differs from one that depends on the row (a norm of the wrong vector) even where both
  fail everywhere with the same signs (a logarithmic pattern loses that: cosine 0.999 for
  ``norm.gated_rms_norm``'s ``weight_plus_one`` against ``norm_after_gate``, 0.88 with this one);
- the clip keeps a handful of enormous elements (a decay turned into growth overflows by 1e30, a
  NaN) from deciding alone, and the cosine is free of scale: a real bug need not err by exactly as
  much as its mutant does.

A transposed state errs in the final state only, in a permutation pattern that no other bug has; a
dropped beta errs in every output, with signs set by ``1 - beta``; garbage in some rows, or an
uninitialized output, matches no mutant. Some mutants cannot be told apart by their outputs
(``norm.rms_norm``'s ``eps_dropped`` and ``eps_one_tenth`` differ only in the small rows, by the
same pattern): every mutant within :data:`TIE` of the best is named with it. A mutant is named when
its mean score over the fingerprinted inputs reaches :data:`THRESHOLD`; below it the failure is
reported with no name.
"""
from __future__ import annotations

import numpy as np

from .. import metrics

# A mean score at or above this names the mutant. Measured (float32 and bfloat16, three drawn inputs
# each): a replay of a registered bug scores 1.0 against its mutant (tests/parity/certify/test_certify_impl.py);
# failures no mutant fits score at most 0.28 (kda.recurrent: garbage rows 0.04, an uninitialized
# output 0.13, TF32 products 0.28 against output_before_update); two different mutants of one op at
# most 0.51 (norm.l2norm), except the pairs that err alike (kda.gate's sign flip and forgotten exp
# 0.99, gated_rms_norm's weight conventions 0.88), named together when within TIE.
THRESHOLD = 0.6
TIE = 0.02                                      # mutants this close to the best are named with it
MAX_CASES = 2                                   # failing inputs fingerprinted per dtype run


def pattern(prepared, outputs: dict, contract: str | None = None) -> np.ndarray | None:
    """The error pattern of ``outputs`` on ``prepared`` (module docstring); None when an output is
    missing or has the wrong shape."""
    rec = prepared.record
    out_dtypes = {n: metrics.dtype_of(outputs[n]) for n in rec.outputs
                  if n in outputs and metrics.dtype_of(outputs[n])}
    bounds = prepared.bound(out_dtypes, contract)
    parts = []
    for name in rec.outputs:
        if name not in outputs:
            return None
        ref = np.asarray(prepared.ref[name], dtype=np.float64)
        y = metrics.to_numpy(outputs[name]).astype(np.float64)
        if y.shape != ref.shape:
            return None
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            e = (y - ref) / np.asarray(bounds[name], dtype=np.float64)
        e = np.where((y == ref) | (np.abs(e) <= 1.0), 0.0, e)    # equal (infinities too) or within
        parts.append(e.ravel())
    if not parts:
        return None
    e = np.concatenate(parts)
    big = np.abs(e[(e != 0) & np.isfinite(e)])
    c = float(np.quantile(big, 0.99)) if big.size else 1.0
    e = np.where(np.isnan(e), c, e)
    return np.sign(e) * np.minimum(np.abs(e), c)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity (0 when either is all zeros); scaled first, so no norm overflows."""
    a = a / (np.max(np.abs(a)) or 1.0)
    b = b / (np.max(np.abs(b)) or 1.0)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a / na, b / nb))


def similarities(prepared, outputs: dict, standin) -> dict:
    """mutant -> score of ``outputs`` against each mutant of the record, built around ``standin``
    (a normalized correct candidate) on the same prepared input; empty when the failure has no
    pattern (all within the bound, or a missing or misshapen output). A mutant that raises scores 0."""
    rec = prepared.record
    a = pattern(prepared, outputs)
    if a is None or not np.any(a):
        return {}
    scores = {}
    for m in rec.mutants:
        try:
            b = pattern(prepared, m.run(standin, rec, prepared.inputs(), dict(prepared.case.kwargs), prepared.aux))
        except Exception:  # a mutant that cannot run here matches nothing
            b = None
        scores[m.name] = 0.0 if b is None else round(cosine(a, b), 4)
    return scores


def nearest(per_case: list) -> tuple[dict | None, dict]:
    """(``{"mutant", "similarity", "ties"}`` of the best mean score when it reaches THRESHOLD, else
    None; mutant -> mean score) over the fingerprinted inputs ``per_case`` (dicts from
    :func:`similarities`; a mutant absent from one counts 0 there). ``ties``: the other mutants
    within TIE of the best, which these outputs cannot tell from it."""
    per_case = [s for s in per_case if s]
    if not per_case:
        return None, {}
    names = list(dict.fromkeys(n for s in per_case for n in s))
    mean = {n: round(float(np.mean([s.get(n, 0.0) for s in per_case])), 4) for n in names}
    best = max(mean, key=mean.get)
    if mean[best] < THRESHOLD:
        return None, mean
    ties = [n for n in names if n != best and mean[n] >= mean[best] - TIE]
    return {"mutant": best, "similarity": mean[best], "ties": ties}, mean
