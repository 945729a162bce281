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

# The smallest normal number of each arithmetic dtype: below it a result keeps no relative accuracy
# (a subnormal, or 0 where the GPU flushes subnormals), so a bound there is absolute, this times the
# magnitude the value is a fraction of (the KDA bounded gate: docs/error-bounds.md).
UNDERFLOW = {"float32": 2.0**-126, "float64": 2.0**-1022}

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
    udot   what a matrix product does to the operands it reads (the arithmetic contract, see
           CONTRACTS): 0 under IEEE (operands read as they are held), TF32's 2^-10 when the product
           reads float32 operands with a 10-bit mantissa. A bound reads it through ``uop`` / ``dot``
    """

    dtype: str
    u: float
    ua: float
    ustate: float
    out: dict = field(default_factory=dict)
    rounding: str = "nearest"
    udot: float = 0.0
    contract: str = "ieee"

    def uo(self, name: str) -> float:
        return self.out.get(name, self.u)

    def us(self, stored: bool) -> float:
        """Unit roundoff of an intermediate: ``u`` if the kernel stores it in the run dtype."""
        return self.u if stored else self.ua

    def uread(self, held: float) -> float:
        """The rounding a matrix product applies to an operand held with unit roundoff ``held``: none
        when the operand's format is no finer than the product's (a bf16 value is exact in TF32),
        else ``udot``."""
        return 0.0 if self.udot == 0.0 or held >= self.udot else self.udot

    def uop(self, stored: bool) -> float:
        """Unit roundoff of one operand of a matrix product, relative to the value it stands for:
        the storage of an intermediate the kernel keeps in the run dtype (``u``, when ``stored``)
        and the product's own rounding of it (first order: a product of two such operands errs by
        ``2 uop`` plus its accumulation). IEEE: ``u`` for a stored operand, 0 for a register."""
        held = self.u if stored else self.ua
        return (self.u if stored else 0.0) + self.uread(held)

    def dot(self, n, held_a: float | None = None, held_b: float | None = None):
        """First-order relative error factor of an ``n``-long matrix product of two operands the
        kernel reads as they are held (default: the run dtype, as inputs are):
        ``gamma_n(ua) + uread(a) + uread(b)``; IEEE: ``gamma_n(ua)``, Higham's bound."""
        uin = UNIT_ROUNDOFF[self.dtype]
        return (gamma(n, self.ua) + self.uread(uin if held_a is None else held_a)
                + self.uread(uin if held_b is None else held_b))

    def describe(self) -> dict:
        return {"dtype": self.dtype, "u": self.u, "ua": self.ua, "ustate": self.ustate,
                "out": dict(self.out), "rounding": self.rounding, "udot": self.udot,
                "contract": self.contract}


@dataclass(frozen=True)
class Contract:
    """The arithmetic an implementation claims (``parity certify --contract``, or declared by an
    adapter). ``udot``: what its matrix products do to their operands (``Precision.udot``);
    ``ustore``: the unit roundoff of the intermediates it stores, when coarser than the run dtype's
    (None: the run dtype); ``ua``: the least precise arithmetic it may use (None: the run dtype's,
    ``arithmetic_dtype``)."""

    name: str
    doc: str
    udot: float = 0.0
    ustore: float | None = None
    ua: float | None = None


# Strongest first: each is weaker than (its bounds contain) those before it, so a failure of a
# claimed contract is also judged against the weaker ones after it (parity.certify).
# TF32: a float32 operand keeps 10 mantissa bits. Triton's tl.dot hands float32 registers to the
# tensor cores, which drop the low 13 bits (truncation: a full TF32 ulp, 2^-10, as
# triton-lang/triton issue 4574 measured: tf32 dots less accurate than fp16 ones of the same
# mantissa); cuBLAS rounds to nearest (2^-11). The contract takes the larger.
CONTRACTS = {c.name: c for c in (
    Contract("ieee", "IEEE arithmetic at the run dtype: float32 accumulation for bf16/fp16/fp32 runs, "
             "float64 for float64; matrix products read their operands as they are held"),
    Contract("tf32", "matrix-product operands read as TF32 (10-bit mantissa, truncated or rounded: "
             "u = 2^-10), float32 accumulation", udot=2.0**-10, ua=2.0**-24),
    Contract("bf16-storage", "intermediates stored in bfloat16 and matrix-product operands read as "
             "bfloat16 (u = 2^-8), float32 accumulation", udot=2.0**-8, ustore=2.0**-8, ua=2.0**-24),
)}


def contract_named(name: str) -> Contract:
    """The contract called ``name``; ValueError naming the known ones."""
    if name not in CONTRACTS:
        raise ValueError(f"contract: expected one of {', '.join(CONTRACTS)}, got {name!r}")
    return CONTRACTS[name]


def weaker_contracts(name: str) -> list[str]:
    """The contracts weaker than ``name``, strongest first."""
    names = list(CONTRACTS)
    return names[names.index(contract_named(name).name) + 1:]


def precision_for(dtype, out_dtypes: dict | None = None, rounding: str = "nearest",
                  contract: str = "ieee") -> Precision:
    """The Precision of a candidate running at ``dtype`` whose outputs came back as ``out_dtypes``
    (name -> dtype; integer outputs ignored). ``rounding``: how the platform converts float32 to
    ``dtype`` (parity.platform: ``toward-zero`` doubles u, one full ulp). ``contract``: the
    arithmetic the candidate claims (CONTRACTS; it may coarsen the intermediates' storage, the
    arithmetic and what matrix products read). The reference's float64 rounding is added to each u."""
    name = dtype_name(dtype)
    c = contract_named(contract)
    f = 2.0 if rounding == "toward-zero" else 1.0
    u = max(UNIT_ROUNDOFF[name] * (f if name in ("bfloat16", "float16") else 1.0), c.ustore or 0.0)
    ua = max(UNIT_ROUNDOFF[arithmetic_dtype(name)], c.ua or 0.0)
    out = {}
    for k, d in (out_dtypes or {}).items():
        try:
            uo = unit_roundoff(d)
        except ValueError:
            continue  # integer outputs: compared exactly
        if dtype_name(d) == name and name in ("bfloat16", "float16"):
            uo *= f
        out[k] = uo + U_REFERENCE
    return Precision(name, u + U_REFERENCE, ua + U_REFERENCE, ua + U_REFERENCE, out, rounding,
                     c.udot, c.name)


def underflow(dtype) -> float:
    """The smallest normal number of the arithmetic dtype ``dtype`` (UNDERFLOW)."""
    return UNDERFLOW[arithmetic_dtype(dtype)]


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


def silu_prime(z):
    """The slope of SiLU, ``d/dz z sigmoid(z)``: how much an error of its argument moves its value
    (at most 1.0999)."""
    s = sig(z)
    return s * (1.0 + z * (1.0 - s))
