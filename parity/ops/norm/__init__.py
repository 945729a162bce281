"""Records: norm.rms_norm, norm.add_rms_norm, norm.gated_rms_norm, norm.l2norm.
"""
from __future__ import annotations

from optimized import norm as fast
from parity.ops._util import ROWS
from parity.registry import OpRecord
from reference import norm as ref

from . import bounds, emulate, mutants
from .inputs import add_cases, l2_cases, rms_cases, wide_l2_cases, wide_norm_cases

RMS_DOC = "(gamma_D(ua)/2 + 6 ua + u + uo) |y|  (u: HF rounds x/rms to the run dtype before the weight)"

RMS_NORM = OpRecord(
    name="norm.rms_norm", reference=ref.rms_norm, optimized=fast.rms_norm,
    emulated=emulate.rms_norm, inputs=rms_cases, wide=lambda space: wide_norm_cases(space), bound=bounds.rms_norm,
    outputs=("y",),
    args=("x", "weight"), batch=ROWS, reductions="D", bound_doc=RMS_DOC, mutants=mutants.RMS_NORM)

ADD_RMS_NORM = OpRecord(
    name="norm.add_rms_norm", reference=ref.add_rms_norm, optimized=fast.add_rms_norm,
    emulated=emulate.add_rms_norm, inputs=add_cases, wide=lambda space: wide_norm_cases(space, "add"),
    bound=bounds.add_rms_norm, outputs=("y", "h"),
    args=("x", "residual", "weight"), reductions="D",
    batch={"inputs": {"x": 0, "residual": 0}, "outputs": {"y": 0, "h": 0}},
    bound_doc="h: u_h |h|, u_h = ua + uo (one add, one rounding); y: (c (1 + u_h) + 2 u_h) / (1 - u_h) |y|, "
              "c = rms_norm's relative bound",
    mutants=mutants.ADD_RMS_NORM)

GATED_RMS_NORM = OpRecord(
    name="norm.gated_rms_norm", reference=ref.gated_rms_norm, optimized=fast.gated_rms_norm,
    emulated=emulate.gated_rms_norm, inputs=lambda: rms_cases(gated=True),
    wide=lambda space: wide_norm_cases(space, "gated"), bound=bounds.gated_rms_norm,
    outputs=("y",), args=("x", "gate", "weight"), reductions="V",
    batch={"inputs": {"x": 0, "gate": 0}, "outputs": {"y": 0}},
    bound_doc="(gamma_V(ua)/2 + 7 ua + (5 + |gate|) ua + uo) |y|",
    mutants=mutants.GATED_RMS_NORM)

L2NORM = OpRecord(
    name="norm.l2norm", reference=ref.l2norm, optimized=fast.l2norm,
    emulated=emulate.l2norm, inputs=l2_cases, wide=wide_l2_cases, bound=bounds.l2norm, outputs=("y",), args=("x",),
    batch=ROWS, reductions="K", bound_doc="(gamma_K(ua)/2 + 5 ua + uo) |y|", mutants=mutants.L2NORM)


def records() -> list[OpRecord]:
    return [RMS_NORM, ADD_RMS_NORM, GATED_RMS_NORM, L2NORM]
