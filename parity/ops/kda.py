"""Records: kda.gate, kda.recurrent, kda.chunked, kda.fused_recurrent, kda.fused_chunked.

Inputs keep K != V (a transposed state cannot hide), include GVA (HV = 2 H), ragged final chunks,
several chunks per sequence (so a chunk-boundary slip reaches the outputs), carried initial states,
variable-length batches, and decays from ~1 to ~e^-12 per step.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from .. import bounds
from ..emulate import kda as emu
from ..mutants import internal, transposed_state, wrap
from ..registry import Case, OpRecord, register
from ..strategies import bucket, log_decays, normal, rng, seeds, unit_rows
from ._util import lazy

# (B, T, H, HV, K, V, chunk): the first is hypothesis's first choice (richest: K != V, 3 chunks)
SHAPES = [(2, 37, 2, 2, 16, 32, 16), (1, 70, 1, 2, 32, 16, 32), (2, 20, 1, 1, 16, 32, 16)]


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


@st.composite
def core_cases(draw, chunked=False, fused=False):
    B, T, H, HV, K, V, C = draw(bucket(SHAPES))
    has_state = draw(bucket([True, False]))
    varlen = B == 1 and draw(bucket([True, False]))
    strength = draw(bucket(["mixed", "moderate"]))
    r = rng(draw(seeds()))
    a = {}
    if fused:
        a["q"], a["k"] = normal(r, (B, T, H, K), 2.0), normal(r, (B, T, H, K), 2.0)
    else:
        a["q"], a["k"] = unit_rows(r, (B, T, H, K)), unit_rows(r, (B, T, H, K))
    a["v"] = normal(r, (B, T, HV, V))
    if fused:
        a["g_raw"] = normal(r, (B, T, HV, K), 1.5)
        a["beta_logits"] = normal(r, (B, T, HV))
        a["A_log"] = r.uniform(-2.0, 1.0, size=HV) if strength == "mixed" else r.uniform(-2.5, -0.5, size=HV)
        a["dt_bias"] = normal(r, (HV * K,), 0.5)
    else:
        a["g"] = log_decays(r, (B, T, HV, K), strength)
        a["beta"] = _sig(normal(r, (B, T, HV)))
    n_seq = B
    if varlen:
        cut = int(r.integers(1, T))
        a["cu_seqlens"] = np.array([0, cut, T], dtype=np.int64)
        n_seq = 2
    else:
        a["cu_seqlens"] = None
    a["initial_state"] = normal(r, (n_seq, HV, K, V), 0.5) if has_state else None
    kw = {"chunk_size": C} if chunked else {}
    label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}" + (f" C={C}" if chunked else "") \
        + (" varlen" if varlen else "") + (" h0" if has_state else "") + f" {strength}"
    return Case(a, kw, label=label)


@st.composite
def gate_cases(draw):
    B, T, HV, K = draw(bucket([(2, 5, 3, 16), (1, 9, 2, 32)]))
    r = rng(draw(seeds()))
    return Case({"g_raw": normal(r, (B, T, HV, K), 3.0), "A_log": r.uniform(-2.0, 1.5, size=HV),
                 "dt_bias": normal(r, (HV * K,), 1.0)}, label=f"B={B} T={T} HV={HV} K={K}")


# -- composition of reference ops for the fused kernels ------------------------------------------
def _compose(core):
    def fused(q, k, v, g_raw, beta_logits, A_log, dt_bias, **kw):
        from reference import elementwise, kda, norm

        f = getattr(kda, core)
        return f(norm.l2norm(q), norm.l2norm(k), v, kda.gate(g_raw, A_log, dt_bias),
                 elementwise.sigmoid(beta_logits), **kw)

    fused.__name__ = f"l2norm+gate+sigmoid+{core}"
    return fused


# -- wrap mutants ----------------------------------------------------------------------------------
def _neg_g(d):
    d["g"] = -d["g"]
    return d


def _beta_one(d):
    d["beta"] = torch.ones_like(d["beta"])
    return d


def _beta_logits_inf(d):
    d["beta_logits"] = torch.full_like(d["beta_logits"], float("inf"))
    return d


def _A_plus_one(d):
    d["A_log"] = d["A_log"] + 1
    return d


def _state_T(out, inp):
    out["final_state"] = transposed_state(out["final_state"])
    return out


def _neg_out(out, inp):
    out["g"] = -out["g"]
    return out


def _dt_zero(d):
    d["dt_bias"] = torch.zeros_like(d["dt_bias"])
    return d


POLICY = {"g": "fp32", "beta": "fp32", "initial_state": "fp32", "A_log": "fp32", "dt_bias": "fp32",
          "cu_seqlens": "int"}
BATCH = {"inputs": {n: 0 for n in ("q", "k", "v", "g", "beta", "g_raw", "beta_logits", "initial_state")},
         "outputs": {"o": 0, "final_state": 0}}
CORE = ("q", "k", "v", "g", "beta")
FUSED = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")
KW = ("initial_state", "cu_seqlens")

STATE_T = wrap("state_stored_transposed", "final state written V-major into the K-major buffer (K != V)",
               outputs=_state_T)

register(OpRecord(
    name="kda.gate", reference=lazy("reference.kda:gate"), optimized="optimized.kda:gate",
    emulated=emu.gate, inputs=gate_cases, bound=bounds.kda.gate, outputs=("g",),
    args=("g_raw", "A_log", "dt_bias"), policy=POLICY, reductions="none",
    batch={"inputs": {"g_raw": 0}, "outputs": {"g": 0}},
    bound_doc="exp(A) (sigmoid(z) ua |z| + softplus err) + ((3 + |A_log|) ua + uo) |g|, z = g_raw + dt_bias",
    mutants=(
        wrap("gate_sign_flipped", "g = +exp(A_log) softplus(...): growth instead of decay", outputs=_neg_out),
        wrap("A_log_plus_one", "A_log + 1 (decays e times stronger)", inputs=_A_plus_one),
        wrap("dt_bias_dropped", "dt_bias not added", inputs=_dt_zero),
        internal("A_log_not_exponentiated", "-A_log * softplus(...) (exp of A_log forgotten)", emu.gate),
    )))

_CORE_DOC = ("per value column: E_t^2 = rho_t^2 E_{t-1}^2 + lam_t^2, rho = max exp(g) max(1, |1 - beta|k|^2|); "
             "o: scale (|q| LAMBDA E_t + gamma_K(ua) |q|.|S_t|) + (ua + uo)|o|")

register(OpRecord(
    name="kda.recurrent", reference=lazy("reference.kda:recurrent"), optimized="optimized.kda:recurrent",
    emulated=emu.recurrent, inputs=lambda: core_cases(), bound=bounds.kda.recurrent,
    outputs=("o", "final_state"), args=CORE, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, T", bound_doc=_CORE_DOC + "; state in ua (fp32 registers)",
    mutants=(
        wrap("gate_sign_flipped", "decay exp(-g) instead of exp(g)", inputs=_neg_g),
        wrap("beta_dropped", "beta taken as 1", inputs=_beta_one),
        STATE_T,
        internal("output_before_update", "o_t reads the state before step t's update", emu.recurrent),
    )))

register(OpRecord(
    name="kda.chunked", reference=lazy("reference.kda:chunked"), optimized="optimized.kda:chunked",
    emulated=emu.chunked, inputs=lambda: core_cases(chunked=True), bound=bounds.kda.chunked,
    outputs=("o", "final_state"), args=CORE, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, chunk C, T",
    bound_doc=_CORE_DOC + "; plus per chunk the run-dtype storage of A, M, w, u, v_new, h, Q through "
              "|M|(u|A| + gamma_C(ua)(I+|A|)), |Q|, |k exp(G_last - G)|",
    mutants=(
        wrap("gate_sign_flipped", "decay exp(-g) instead of exp(g)", inputs=_neg_g),
        wrap("beta_dropped", "beta taken as 1", inputs=_beta_one),
        STATE_T,
        internal("chunk_boundary_off_by_one", "the carried state decays by G one row short of the chunk end",
                 emu.chunked),
    )))

_FUSED_MUTANTS = (
    wrap("A_log_plus_one", "A_log + 1 inside the fused gate", inputs=_A_plus_one),
    wrap("beta_dropped", "beta taken as 1 (sigmoid(+inf))", inputs=_beta_logits_inf),
    STATE_T,
)

register(OpRecord(
    name="kda.fused_recurrent", reference=_compose("recurrent"), optimized="optimized.kda:fused_recurrent",
    emulated=emu.fused_recurrent, inputs=lambda: core_cases(fused=True), bound=bounds.kda.fused_recurrent,
    outputs=("o", "final_state"), args=FUSED, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, T",
    bound_doc="kda.recurrent's model at the composed inputs + l2norm/gate/sigmoid errors as input perturbations",
    mutants=_FUSED_MUTANTS + (
        internal("l2norm_skipped", "q, k not l2-normalized in the kernel", emu.fused_recurrent),
        internal("gate_sign_flipped", "the fused gate's sign lost", emu.fused_recurrent),
    )))

register(OpRecord(
    name="kda.fused_chunked", reference=_compose("chunked"), optimized="optimized.kda:fused_chunked",
    emulated=emu.fused_chunked, inputs=lambda: core_cases(chunked=True, fused=True),
    bound=bounds.kda.fused_chunked, outputs=("o", "final_state"), args=FUSED, kwarg_arrays=KW,
    policy=POLICY, batch=BATCH, reductions="K, chunk C, T",
    bound_doc="kda.chunked's model at the composed inputs + prologue errors (normalized q, k stored in the run dtype)",
    mutants=_FUSED_MUTANTS + (
        internal("l2norm_skipped", "q, k not l2-normalized in the kernel", emu.fused_chunked),
        internal("beta_sigmoid_skipped", "beta logits used as beta", emu.fused_chunked),
    )))
