"""Named semantic bugs of the KDA ops, per op: the wrap mutants' transformations of the real
candidate's inputs and outputs, and the internal ones evaluated by the emulation (parity/mutants.py).
"""
from __future__ import annotations

import torch

from parity.mutants import internal, wrap
from parity.ops import _slots

from . import emulate


def transposed_state(s):
    """The ``[..., K, V]`` state written in V-major order into a K-major buffer (the vLLM layout bug):
    same shape, scrambled values unless K == V and the state is symmetric."""
    return s.transpose(-1, -2).contiguous().reshape(s.shape)


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
    if d["A_log"] is not None:   # the bounded gate without A_log: nothing to shift
        d["A_log"] = d["A_log"] + 1
    return d


def _state_T(out, inp):
    out["final_state"] = transposed_state(out["final_state"])
    return out


def _h0_T(d):
    if d.get("initial_state") is not None:
        d["initial_state"] = transposed_state(d["initial_state"])
    return d


def _neg_out(out, inp):
    out["g"] = -out["g"]
    return out


def _dt_zero(d):
    d["dt_bias"] = torch.zeros_like(d["dt_bias"])
    return d


# -- the bounded gate ``b sigmoid(exp(A_log) (g_raw + dt_bias))`` (the ``+lower_bound`` records) ------
LN2 = 0.6931471805599453


def _softplus_gate(kw):
    kw.pop("lower_bound", None)
    return kw


def _bound_base_two(kw):
    kw["lower_bound"] = kw["lower_bound"] * LN2
    return kw


def _A_dropped(d):
    d["A_log"] = None
    return d


SOFTPLUS_ON_BOUNDED = wrap(
    "softplus_gate_on_bounded", "the softplus gate -exp(A_log) softplus(g_raw + dt_bias) run on a bounded-gate "
    "checkpoint (Kimi-Linear-48B's kernel path on a Kimi-K3 / GLM-5.3 layer)", kwargs=_softplus_gate)
WRONG_BOUND = wrap(
    "wrong_bound_value", "the bound read in base 2, b ln 2 (-3.47 for -5): a kernel working in exp2 that "
    "converts g but not b", kwargs=_bound_base_two)
A_LOG_DROPPED = wrap(
    "A_log_dropped", "b sigmoid(g_raw + dt_bias) on a checkpoint that has A_log (the A_log-free form taken)",
    inputs=_A_dropped)


def _clamped(fn):
    return internal("clamped_softplus", "max(b, -exp(A_log) softplus(g_raw + dt_bias)): the softplus gate "
                    "clamped at the bound instead of b sigmoid(...) (a shipped port's mistake)", fn)


STATE_T = wrap("state_stored_transposed", "final state written V-major into the K-major buffer (K != V)",
               outputs=_state_T)
H0_T = wrap("initial_state_read_transposed", "the carried state read V-major from the K-major buffer "
            "(K != V; a kernel that loads the state as [V, K])", inputs=_h0_T)
A_LOG_PLUS_ONE = wrap("A_log_plus_one", "A_log + 1 inside the fused gate", inputs=_A_plus_one)


def _l2norm_skipped(fn):
    return internal("l2norm_skipped", "q, k not l2-normalized in the kernel", fn)


GATE = (
    wrap("gate_sign_flipped", "g = +exp(A_log) softplus(...): growth instead of decay", outputs=_neg_out),
    wrap("A_log_plus_one", "A_log + 1 (decays e times stronger)", inputs=_A_plus_one),
    wrap("dt_bias_dropped", "dt_bias not added", inputs=_dt_zero),
    internal("A_log_not_exponentiated", "-A_log * softplus(...) (exp of A_log forgotten)", emulate.gate),
)

_CORE = (
    wrap("gate_sign_flipped", "decay exp(-g) instead of exp(g)", inputs=_neg_g),
    wrap("beta_dropped", "beta taken as 1", inputs=_beta_one),
    STATE_T,
    H0_T,
)

RECURRENT = _CORE + (
    internal("output_before_update", "o_t reads the state before step t's update", emulate.recurrent),
)

CHUNKED = _CORE + (
    internal("chunk_boundary_off_by_one", "the carried state decays by G one row short of the chunk end",
             emulate.chunked),
)

_FUSED = (
    A_LOG_PLUS_ONE,
    wrap("beta_dropped", "beta taken as 1 (sigmoid(+inf))", inputs=_beta_logits_inf),
    STATE_T,
    H0_T,
)

FUSED_RECURRENT = _FUSED + (
    _l2norm_skipped(emulate.fused_recurrent),
    internal("gate_sign_flipped", "the fused gate's sign lost", emulate.fused_recurrent),
)

FUSED_CHUNKED = _FUSED + (
    _l2norm_skipped(emulate.fused_chunked),
    internal("beta_sigmoid_skipped", "beta logits used as beta", emulate.fused_chunked),
)

FUSED_RECURRENT_DECODE = _slots.MUTANTS + (
    A_LOG_PLUS_ONE,
    _l2norm_skipped(emulate.fused_recurrent_decode),
    _slots.blanked_by_zero("o"),
)

# the bounded gate's records: the three gate mutants of every op that computes the gate, beside the op's
# own (those of A_log, beta, the state layout, the l2norm)
_BOUNDED = (SOFTPLUS_ON_BOUNDED, WRONG_BOUND)

GATE_BOUNDED = (
    wrap("gate_sign_flipped", "g = -b sigmoid(...): growth instead of decay", outputs=_neg_out),
    *_BOUNDED,
    _clamped(emulate.gate),
    A_LOG_DROPPED,
)

FUSED_RECURRENT_BOUNDED = FUSED_RECURRENT + _BOUNDED + (_clamped(emulate.fused_recurrent),)
FUSED_CHUNKED_BOUNDED = FUSED_CHUNKED + _BOUNDED + (_clamped(emulate.fused_chunked),)
FUSED_RECURRENT_DECODE_BOUNDED = FUSED_RECURRENT_DECODE + _BOUNDED + (_clamped(emulate.fused_recurrent_decode),)
