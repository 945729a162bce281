"""Records: kda.gate, kda.recurrent, kda.chunked, kda.fused_recurrent, kda.fused_chunked and
kda.fused_recurrent_decode (one token per sequence, states updated in place in a pool by slot id:
parity/ops/_slots.py); the bounded gate's records of the four ops that compute the gate,
``kda.gate+lower_bound`` and the other three with the same suffix (:data:`BOUNDED`); and the
``+qk_l2norm`` variants (:func:`variants`).

The bounded gate (``lower_bound`` b in [-5, 0): ``g = b sigmoid(exp(A_log) (g_raw + dt_bias))``)
is the same optimized op called with ``lower_bound=b``: its records draw that keyword (and A_log
absent on some inputs), judge it by the bounded gate's bound and hold it to the bounded gate's
mutants (the softplus gate run on a bounded-gate layer, the softplus clamped at b, a wrong b).
``GATES`` names each gated op's record per gate (``parity certify --variant kda_gate=...``).
"""
from __future__ import annotations

import dataclasses

from optimized import kda as fast
from parity.mutants import internal
from parity.ops import _slots
from parity.registry import OpRecord
from reference import kda as ref
from reference.norm import l2norm

from . import bounds, emulate, mutants
from .args import CORE, FUSED, KWARG_ARRAYS
from .inputs import core_cases, decode_cases, gate_cases, raw_qk_cases, wide_core_cases


# -- the decode step: the optimized op updates the pool in place; the record compares it whole ----
def decode_step(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None,
                lower_bound=None):
    """optimized.kda.fused_recurrent_decode, returning (o, the pool it updated in place)."""
    kw = {} if lower_bound is None else {"lower_bound": lower_bound}
    o = fast.fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, scale=scale, **kw)
    return o, state_pool


def decode_step_reference(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None,
                          lower_bound=None):
    """reference.kda.fused_recurrent, one token per named slot."""
    def step(b, s):
        one = [t[b, ...][None, None, ...] for t in (q, k, v, g_raw, beta_logits)]
        o, st_ = ref.fused_recurrent(*one, A_log, dt_bias, initial_state=s[None, ...], scale=scale,
                                     lower_bound=lower_bound)
        return o[0, 0, ...], st_[0, ...]

    return _slots.per_row(step, v, state_pool, slot_ids)


POLICY = {"g": "fp32", "beta": "fp32", "initial_state": "fp32", "A_log": "fp32", "dt_bias": "fp32",
          "cu_seqlens": "int"}
BATCH = {"inputs": {n: 0 for n in ("q", "k", "v", "g", "beta", "g_raw", "beta_logits", "initial_state")},
         "outputs": {"o": 0, "final_state": 0}}

GATE = OpRecord(
    name="kda.gate", reference=ref.gate, optimized=fast.gate,
    emulated=emulate.gate, inputs=gate_cases, bound=bounds.gate, outputs=("g",),
    args=("g_raw", "A_log", "dt_bias"), policy=POLICY, reductions="none",
    batch={"inputs": {"g_raw": 0}, "outputs": {"g": 0}},
    bound_doc="exp(A) (sigmoid(z) ua |z| + softplus err) + ((3 + |A_log|) ua + uo) |g|, z = g_raw + dt_bias",
    mutants=mutants.GATE, gate="softplus")

_CORE_DOC = ("per value column: E_t^2 = rho_t^2 E_{t-1}^2 + lam_t^2, rho = max exp(g) max(1, |1 - beta|k|^2|); "
             "o: scale (|q| LAMBDA E_t + gamma_K(ua) |q|.|S_t|) + (ua + uo)|o|")


def _over_sequences(name: str, *, reductions: str, bound_doc: str) -> OpRecord:
    """The record of ``kda.<name>``, one of the four ops over whole sequences (core or ``fused_``,
    recurrent or ``chunked``): its reference, optimized op, emulation, bound and mutants all go by
    ``name`` (the mutants by ``NAME``), and it is drawn on the inputs of its kind."""
    chunked, fused = name.endswith("chunked"), name.startswith("fused")
    return OpRecord(
        name=f"kda.{name}", reference=getattr(ref, name), optimized=getattr(fast, name),
        emulated=getattr(emulate, name), inputs=lambda: core_cases(chunked=chunked, fused=fused),
        wide=lambda space: wide_core_cases(space, chunked=chunked, fused=fused), bound=getattr(bounds, name),
        outputs=("o", "final_state"), args=FUSED if fused else CORE, kwarg_arrays=KWARG_ARRAYS, policy=POLICY,
        batch=BATCH, reductions=reductions, bound_doc=bound_doc, mutants=getattr(mutants, name.upper()),
        gate="softplus" if fused else None)


RECURRENT = _over_sequences("recurrent", reductions="K, T", bound_doc=_CORE_DOC + "; state in ua (fp32 registers)")

CHUNKED = _over_sequences(
    "chunked", reductions="K, chunk C, T",
    bound_doc=_CORE_DOC + "; plus per chunk the run-dtype storage of A, M, w, u, v_new, h, Q and their "
              "dots' operands: |M|(u|A| + (2u + gamma_K)|A|abs + gamma_C(ua)(I+|A|abs)), (2u|M| + dM)|R|, "
              "|Q| + (2u + gamma_K)|Q|abs, |k exp(G_last - G)|; |.|abs: sums of |k||k|, |q||k|")

FUSED_RECURRENT = _over_sequences(
    "fused_recurrent", reductions="K, T",
    bound_doc="kda.recurrent's model at the composed inputs + l2norm/gate/sigmoid errors as input perturbations")

FUSED_CHUNKED = _over_sequences(
    "fused_chunked", reductions="K, chunk C, T",
    bound_doc="kda.chunked's model at the composed inputs + prologue errors (normalized q, k stored in the run dtype)")

FUSED_RECURRENT_DECODE = OpRecord(
    name="kda.fused_recurrent_decode", reference=decode_step_reference, optimized=decode_step,
    emulated=emulate.fused_recurrent_decode, inputs=decode_cases, bound=bounds.fused_recurrent_decode,
    outputs=("o", "state_pool"), args=FUSED + ("state_pool", "slot_ids"),
    policy={"state_pool": "fp32", "slot_ids": "int", "A_log": "fp32", "dt_bias": "fp32"},
    in_place=True, reductions="K", dirty=_slots.dirty,
    batch={"inputs": {n: 0 for n in ("q", "k", "v", "g_raw", "beta_logits", "slot_ids")}, "outputs": {"o": 0}},
    bound_doc="kda.fused_recurrent's model (T = 1) on the named slots; untouched pool rows and padding outputs exact",
    mutants=mutants.FUSED_RECURRENT_DECODE, gate="softplus")


# -- the bounded gate: the same ops, called with lower_bound -----------------------------------------
BOUNDED_SUFFIX = "+lower_bound"
_BOUNDED_GATE_DOC = ("((1 - s)(|dy| + exp_rel(y) ua) + 5 ua + uo) |g| + 2 |b| tiny, g = b s, s = sigmoid(y), "
                     "y = exp(A_log) (g_raw + dt_bias), |dy| = ua |y| (4 + |A_log|); tiny: float32's smallest normal")


def _bounded(rec: OpRecord, inputs, mutants, wide=None, bound_doc=None) -> OpRecord:
    """``rec``'s op under the bounded gate: the same reference, optimized op (counted under its own
    name), emulation and bound (both read ``lower_bound`` from the kwargs), other inputs and mutants."""
    doc = bound_doc or f"{rec.bound_doc}; the gate's error: kda.gate+lower_bound's model"
    return dataclasses.replace(
        rec, name=rec.name + BOUNDED_SUFFIX, counter=rec.counter_name, inputs=inputs, wide=wide,
        mutants=mutants, bound_doc=doc, gate="lower_bound")


GATE_BOUNDED = _bounded(GATE, lambda: gate_cases(bounded=True), mutants.GATE_BOUNDED, bound_doc=_BOUNDED_GATE_DOC)
FUSED_RECURRENT_BOUNDED = _bounded(
    FUSED_RECURRENT, lambda: core_cases(fused=True, bounded=True), mutants.FUSED_RECURRENT_BOUNDED,
    lambda space: wide_core_cases(space, fused=True, bounded=True))
FUSED_CHUNKED_BOUNDED = _bounded(
    FUSED_CHUNKED, lambda: core_cases(chunked=True, fused=True, bounded=True), mutants.FUSED_CHUNKED_BOUNDED,
    lambda space: wide_core_cases(space, chunked=True, fused=True, bounded=True))
FUSED_RECURRENT_DECODE_BOUNDED = _bounded(
    FUSED_RECURRENT_DECODE, lambda: decode_cases(bounded=True), mutants.FUSED_RECURRENT_DECODE_BOUNDED)
BOUNDED = (GATE_BOUNDED, FUSED_RECURRENT_BOUNDED, FUSED_CHUNKED_BOUNDED, FUSED_RECURRENT_DECODE_BOUNDED)
# a gated op's record per gate: "softplus" (Kimi-Linear-48B) and "lower_bound" (the bounded gate)
GATES = {r.name: {"softplus": r.name, "lower_bound": b.name}
         for r, b in zip((GATE, FUSED_RECURRENT, FUSED_CHUNKED, FUSED_RECURRENT_DECODE), BOUNDED)}


def records() -> list[OpRecord]:
    return [GATE, RECURRENT, CHUNKED, FUSED_RECURRENT, FUSED_CHUNKED, FUSED_RECURRENT_DECODE, *BOUNDED]


def under_gate(recs: list, lower_bound) -> list:
    """``recs`` with every op that computes the KDA gate (of either gate) replaced by its record of
    the gate ``lower_bound`` (None: the softplus gate; a number b: the bounded gate, every input
    drawn with that b), in order, each once; other records unchanged (``parity certify --variant
    kda_gate=...``)."""
    by_name = {r.name: r for r in records()}
    family = {name: base for base, gates in GATES.items() for name in gates.values()}
    out = []
    for r in recs:
        if r.name in family:
            r = by_name[GATES[family[r.name]]["softplus" if lower_bound is None else "lower_bound"]]
            if lower_bound is not None:
                r = _pinned(r, float(lower_bound))
        if r.name not in {o.name for o in out}:
            out.append(r)
    return out


def _pinned(rec: OpRecord, b: float) -> OpRecord:
    """The bounded gate's ``rec`` with every input drawn at ``lower_bound = b``."""
    def pin(case):
        old = case.kwargs.get("lower_bound")
        label = case.label.replace(f"lb{old:g}", f"lb{b:g}") if old is not None else case.label
        return dataclasses.replace(case, kwargs={**case.kwargs, "lower_bound": b}, label=label)

    wide = None if rec.wide is None else (lambda space: rec.wide(space).map(pin))
    return dataclasses.replace(rec, inputs=lambda: rec.inputs().map(pin), wide=wide)


# -- the core ops with only the q/k l2norm fused in the call ------------------------------------------
# fla's ``chunk_kda`` / ``fused_recurrent_kda`` with ``use_qk_l2norm_in_kernel=True`` and the gate and
# beta computed outside (what vLLM and transformers' KimiLinear call): neither the core ops (unit q, k
# given) nor the fused ones (the gate and beta sigmoid fused too). These records judge such calls seen
# by ``parity.watch``; no optimized op of this repository computes them, so they are not registered
# (``parity certify`` never runs them) and :func:`variants` lists them.
QK_L2NORM = "+qk_l2norm"


def _qk_l2norm_reference(fn):
    def run(q, k, v, g, beta, **kw):
        return fn(l2norm(q), l2norm(k), v, g, beta, **kw)

    run.__name__ = run.__qualname__ = f"{fn.__name__}_qk_l2norm"
    run.__doc__ = f"reference.kda.{fn.__name__} of l2norm(q), l2norm(k) (eps 1e-6), the other inputs as given."
    return run


def _qk_l2norm_variant(rec: OpRecord, core_internal: str) -> OpRecord:
    emulated = emulate.with_qk_l2norm(rec.emulated)
    variant_mutants = tuple(m for m in rec.mutants if m.kind == "wrap") + (
        internal(core_internal, next(m.doc for m in rec.mutants if m.name == core_internal), emulated),
        internal("l2norm_skipped", "q, k not l2-normalized in the call", emulated))
    chunked = rec is CHUNKED
    return dataclasses.replace(
        rec, name=rec.name + QK_L2NORM, reference=_qk_l2norm_reference(rec.reference), emulated=emulated,
        optimized=no_optimized_op, mutants=variant_mutants,
        inputs=lambda: raw_qk_cases(chunked=chunked),
        bound=bounds.qk_l2norm_chunked if chunked else bounds.qk_l2norm_recurrent,
        bound_doc=f"{rec.name}'s model at l2norm(q), l2norm(k), the l2norm's errors as perturbations of q, k "
                  "(as the fused ops count them)")


def no_optimized_op(*args, **kwargs):
    """The ``+qk_l2norm`` variants judge outside calls only: this repository has no such kernel."""
    raise NotImplementedError("no optimized op computes the core KDA ops with only the q/k l2norm fused")


def variants() -> list[OpRecord]:
    """``kda.recurrent+qk_l2norm`` and ``kda.chunked+qk_l2norm`` (see :data:`QK_L2NORM`)."""
    return [_qk_l2norm_variant(RECURRENT, "output_before_update"),
            _qk_l2norm_variant(CHUNKED, "chunk_boundary_off_by_one")]
