"""Records: elementwise.silu, elementwise.sigmoid, elementwise.softplus.
"""
from __future__ import annotations

from optimized import elementwise as fast
from parity.ops._util import ROWS
from parity.registry import OpRecord
from reference import elementwise as ref

from . import bounds, emulate, mutants
from .inputs import cases, wide_cases

DOC = "one ua per operation, exp (2 + |x|) ua, one rounding to the output dtype; relative to |y|"


SILU = OpRecord(
    name="elementwise.silu", reference=ref.silu, optimized=fast.silu,
    emulated=emulate.silu, inputs=cases, wide=wide_cases,
    bound=bounds.silu,
    outputs=("y",), args=("x",), batch=ROWS, bound_doc="((6 + |x|) ua + uo) |y|  (" + DOC + ")",
    reductions="none", mutants=mutants.SILU)

SIGMOID = OpRecord(
    name="elementwise.sigmoid", reference=ref.sigmoid, optimized=fast.sigmoid,
    emulated=emulate.sigmoid, inputs=cases, wide=wide_cases,
    bound=bounds.sigmoid, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="((5 + |x|) ua + uo) |y|", reductions="none", mutants=mutants.SIGMOID)

SOFTPLUS = OpRecord(
    name="elementwise.softplus", reference=ref.softplus, optimized=fast.softplus,
    emulated=emulate.softplus, inputs=cases, wide=wide_cases,
    bound=bounds.softplus, outputs=("y",), args=("x",), batch=ROWS,
    bound_doc="ua ((2 + |x|) z/(1+z) + 4 |y|) + uo |y|, z = exp(-|x|)", reductions="none",
    mutants=mutants.SOFTPLUS)


def records() -> list[OpRecord]:
    return [SILU, SIGMOID, SOFTPLUS]
