"""The arithmetic every bound is built from: unit roundoffs, the precision a candidate runs at, and
the two ways rounding errors add up (docs/error-bounds.md).

No absolute tolerance exists anywhere: a bound is always a unit roundoff times a magnitude taken
from the op's own values (an output, a sum of absolute terms, a norm).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Unit roundoff u = 2^-p of each dtype (p = significand bits incl. the hidden one).
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}

# Confidence factor of the probabilistic sums (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019):
# n independent rounding errors, each |d_i| <= c_i, sum to at most LAMBDA * sqrt(sum c_i^2) except
# with probability <= 2 exp(-LAMBDA^2 / 2) (Hoeffding). Round-to-nearest errors have variance
# <= c_i^2 / 3, so the Gaussian tail at LAMBDA = 4 is ~1e-11 per element in practice.
LAMBDA = 4.0

# The reference runs in float64: its own rounding is added to every unit roundoff of a model.
U_REFERENCE = UNIT_ROUNDOFF["float64"]


def dtype_name(dtype) -> str:
    """'bfloat16' | 'float16' | 'float32' | 'float64' for a torch dtype, numpy dtype or name."""
    s = str(dtype).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32", "fp64": "float64", "double": "float64"}
    s = aliases.get(s, s)
    if s not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {dtype!r}")
    return s


def unit_roundoff(dtype) -> float:
    """u of ``dtype``: bf16 2^-8, fp16 2^-11, fp32 2^-24, fp64 2^-53."""
    return UNIT_ROUNDOFF[dtype_name(dtype)]


def arithmetic_dtype(dtype) -> str:
    """What the kernels compute in for inputs of ``dtype``: float32, or float64 for float64
    (the optimized contract: optimized/elementwise/_precision.py)."""
    return "float64" if dtype_name(dtype) == "float64" else "float32"


@dataclass(frozen=True)
class Precision:
    """Unit roundoffs of one candidate run (each already includes the reference's 2^-53).

    u      storage: inputs, outputs and intermediates the kernel keeps in the run dtype (bf16 w, u,
           v_new, h of the chunked KDA; the bf16 operands of a tensor-core dot)
    ua     arithmetic: what registers and accumulators use (fp32 for bf16/fp16/fp32 runs, fp64 for
           fp64 runs)
    ustate the carried recurrent state (fp32 in bf16 runs)
    out    rounding of each output, from the dtype the candidate actually returned
    """

    dtype: str
    u: float
    ua: float
    ustate: float
    out: dict = field(default_factory=dict)
    rounding: str = "nearest"

    def uo(self, name: str) -> float:
        return self.out.get(name, self.u)

    def us(self, stored: bool) -> float:
        """Unit roundoff of an intermediate: ``u`` if the kernel stores it in the run dtype."""
        return self.u if stored else self.ua

    def describe(self) -> dict:
        return {"dtype": self.dtype, "u": self.u, "ua": self.ua, "ustate": self.ustate,
                "out": dict(self.out), "rounding": self.rounding}


def precision_for(dtype, out_dtypes: dict | None = None, rounding: str = "nearest") -> Precision:
    """The Precision of a candidate running at ``dtype`` whose outputs came back as ``out_dtypes``
    (name -> dtype; integer outputs ignored). ``rounding``: how the platform converts float32 to
    ``dtype`` (parity.platform: ``toward-zero`` doubles u, one full ulp). The reference's float64
    rounding is added to each u."""
    name = dtype_name(dtype)
    f = 2.0 if rounding == "toward-zero" else 1.0
    u = UNIT_ROUNDOFF[name] * (f if name in ("bfloat16", "float16") else 1.0)
    ua = UNIT_ROUNDOFF[arithmetic_dtype(name)]
    out = {}
    for k, d in (out_dtypes or {}).items():
        try:
            uo = unit_roundoff(d)
        except ValueError:
            continue  # integer outputs: compared exactly
        if dtype_name(d) == name and name in ("bfloat16", "float16"):
            uo *= f
        out[k] = uo + U_REFERENCE
    return Precision(name, u + U_REFERENCE, ua + U_REFERENCE, ua + U_REFERENCE, out, rounding)


def gamma(n, u):
    """Deterministic accumulation factor gamma_n = n u / (1 - n u) (Higham, ASNA 3.1): a sum or
    dot product of n terms computed in precision u errs by at most gamma_n * sum |terms|."""
    nu = np.asarray(n, dtype=np.float64) * u
    return nu / (1.0 - nu)


def prob_sum(sq):
    """LAMBDA * sqrt(sum of squared per-term bounds): the probabilistic sum of independent rounding
    errors (see LAMBDA)."""
    return LAMBDA * np.sqrt(sq)


def sig(x):
    """float64 sigmoid without overflow (bound helpers only; the ops use reference.elementwise)."""
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def exp_rel(x):
    """Relative error factor (in units of ua) of exp(x) as kernels compute it: ex2(x * log2 e) rounds
    the argument (|x| u) and ex2 itself errs by ~2 ulp."""
    return 2.0 + np.abs(x)
