"""Records: kda.gate, kda.recurrent, kda.chunked, kda.fused_recurrent, kda.fused_chunked and
kda.fused_recurrent_decode (one token per sequence, states updated in place in a pool by slot id:
parity/ops/_slots.py).

Inputs keep K != V (a transposed state cannot hide), include GVA (HV = 2 H), ragged final chunks,
several chunks per sequence (so a chunk-boundary slip reaches the outputs), carried initial states,
variable-length batches, and decays from ~1 to ~e^-12 per step (``strong``: ~e^-5 to e^-130, whose
prefix sums run far past exp's range inside a chunk).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from reference import kda as ref

from ..bounds import kda as bounds
from ..emulate import kda as emu
from ..mutants import internal, transposed_state, wrap
from ..registry import Case, OpRecord, Ref
from ..strategies import bucket, log_decays, normal, rng, seeds, unit_rows
from . import _slots

# (B, T, H, HV, K, V, chunk), smallest first (what hypothesis tries first and shrinks toward); each
# shows every mutant: K != V, at least two chunks, a carried state
SHAPES = [(2, 20, 1, 1, 16, 32, 16), (1, 70, 1, 2, 32, 16, 32), (2, 37, 2, 2, 16, 32, 16)]
STRENGTHS = ("mixed", "moderate", "strong", "slow")
PATTERNS = ("random", "repeat", "lowrank")


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _gate_params(r, HV, K, strength):
    """(A_log, dt_bias) of the fused gate: per-token decays exp(A_log) softplus(g_raw + dt_bias)."""
    if strength == "strong":
        return r.uniform(0.0, 2.8, size=HV), normal(r, (HV * K,)) + 6.0
    if strength == "slow":
        return r.uniform(-9.0, -5.0, size=HV), normal(r, (HV * K,), 0.5)
    A_log = r.uniform(-2.0, 1.0, size=HV) if strength == "mixed" else r.uniform(-2.5, -0.5, size=HV)
    return A_log, normal(r, (HV * K,), 0.5)


def _shift(x, by):
    return x + by if by else x


def _tokens(r, shape, pattern, scale):
    """q or k rows ``[B, T, H, K]`` times ``scale`` (None: unit rows): i.i.d. normal (``random``), a
    few vectors repeated like the tokens of a prompt that repeats itself (``repeat``), or rows from
    a two-dimensional subspace (``lowrank``): the last two make the read-out ``q.k`` cancel."""
    if pattern == "random":
        return unit_rows(r, shape) if scale is None else normal(r, shape, scale)
    B, T, H, K = shape
    if pattern == "repeat":
        x = r.standard_normal((3, H, K))[r.integers(0, 3, size=(B, T))]
    else:
        x = np.einsum("bthc,hck->bthk", r.standard_normal((B, T, H, 2)), r.standard_normal((H, 2, K)))
    return x / np.linalg.norm(x, axis=-1, keepdims=True) if scale is None else x * scale


def core_case(B, T, H, HV, K, V, seed, *, chunk=None, fused=False, has_state=True, varlen=False,
              strength="mixed", cu_seqlens=None, pattern="random", beta_shift=0.0, v_scale=1.0,
              qk_scale=2.0) -> Case:
    """One input of the core (``fused=False``: unit q, k rows, log-space g, beta) or fused ops (raw
    q, k, gate parameters, beta logits); ``chunk``: the chunk size (chunked ops); ``varlen`` (B = 1):
    two sequences cut at a random point, or ``cu_seqlens`` given; ``strength``: one of STRENGTHS.
    The search's wider draws: ``pattern`` (PATTERNS) of the q, k rows, ``beta_shift`` added to the
    beta logits (+6: beta near 1), ``v_scale`` of v (and the state), ``qk_scale`` of the raw q, k
    of the fused ops (1e-3: the l2norm's eps matters)."""
    if strength not in STRENGTHS:
        raise ValueError(f"strength: expected one of {STRENGTHS}, got {strength!r}")
    r = rng(seed)
    a = {}
    scale = qk_scale if fused else None
    a["q"], a["k"] = _tokens(r, (B, T, H, K), pattern, scale), _tokens(r, (B, T, H, K), pattern, scale)
    a["v"] = normal(r, (B, T, HV, V), v_scale)
    if fused:
        a["g_raw"] = normal(r, (B, T, HV, K), 1.5)
        a["beta_logits"] = _shift(normal(r, (B, T, HV)), beta_shift)
        a["A_log"], a["dt_bias"] = _gate_params(r, HV, K, strength)
    else:
        a["g"] = log_decays(r, (B, T, HV, K), strength)
        a["beta"] = _sig(_shift(normal(r, (B, T, HV)), beta_shift))
    n_seq = B
    if varlen:
        cut = int(r.integers(1, T))
        cu_seqlens = [0, cut, T]
    a["cu_seqlens"] = None if cu_seqlens is None else np.array(cu_seqlens, dtype=np.int64)
    if cu_seqlens is not None:
        varlen, n_seq = True, len(cu_seqlens) - 1
    a["initial_state"] = normal(r, (n_seq, HV, K, V), 0.5 * v_scale) if has_state else None
    kw = {"chunk_size": chunk} if chunk else {}
    label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}" + (f" C={chunk}" if chunk else "") \
        + (f" varlen{n_seq}" if varlen and n_seq > 2 else " varlen" if varlen else "") \
        + (" h0" if has_state else "") + f" {strength}" \
        + (f" {pattern}" if pattern != "random" else "") + (" beta~1" if beta_shift else "") \
        + (f" v*{v_scale:g}" if v_scale != 1.0 else "") + (f" qk*{qk_scale:g}" if fused and qk_scale != 2.0 else "")
    return Case(a, kw, label=label)


@st.composite
def core_cases(draw, chunked=False, fused=False):
    B, T, H, HV, K, V, C = draw(bucket(SHAPES))
    if chunked:   # the shape's chunk first, then twice it: 16, 32 and 64 all drawn (fla takes 32, 64)
        C = draw(bucket([C, 2 * C]))
    has_state = draw(bucket([True, False]))
    varlen = B == 1 and draw(bucket([True, False]))
    strength = draw(bucket(["mixed", "moderate"]))
    return core_case(B, T, H, HV, K, V, draw(seeds()), chunk=C if chunked else None, fused=fused,
                     has_state=has_state, varlen=varlen, strength=strength)


# -- wide inputs (parity search): any head shape, long sequences, cancelling read-outs --------------
@dataclasses.dataclass(frozen=True)
class Space:
    """What the search draws KDA inputs from. ``elements`` caps ``B T HV K V`` (the interpreter's
    cost); ``shapes``: (H, HV, K, V) drawn from these only (None: any of ``heads`` and ``dims``,
    with ``HV`` 1, 2 or 4 times ``H``, at most the largest of ``heads``)."""

    dims: tuple = (16, 32, 64, 128)
    heads: tuple = (1, 2, 4, 8)
    chunks: tuple = (16, 32, 64)
    max_T: int = 160
    elements: int = 1 << 22
    shapes: tuple | None = None


SPACES = {
    "full": Space(),
    # a few seconds per example under the Triton interpreter (the suite's searches)
    "cheap": Space(dims=(16, 32, 64), heads=(1, 2, 4), max_T=48, elements=1 << 17),
    # on a GPU every new (H, HV, K, V) compiles and autotunes the kernels (seconds each): a
    # five-minute search draws its data widely over a few head shapes that still span 1..8
    # heads, GVA and K, V from 16 to 128, apart and equal
    "buckets": Space(max_T=512, elements=1 << 26,
                     shapes=((1, 1, 16, 16), (2, 4, 32, 64), (4, 8, 128, 128), (8, 8, 64, 16),
                             (1, 4, 128, 32), (4, 4, 16, 128), (2, 2, 128, 128))),
}


@st.composite
def wide_core_cases(draw, space="full", chunked=False, fused=False):
    """Inputs of the core or fused ops drawn widely (``parity search``): head dims 16 to 128 (K and
    V apart), 1 to 8 heads, GVA, any T up to the space's cap, chunk sizes 16/32/64, carried states,
    varlen batches of two or three sequences, decays from 1 - 1e-4 (``slow``) to e^-12 per step,
    beta near 1, values over four decades, raw q, k of norm ~1e-3 (fused: the l2norm's eps), and
    q, k rows that make the read-out cancel (``repeat``, ``lowrank``)."""
    sp = SPACES[space]
    if sp.shapes:
        H, HV, K, V = draw(bucket(sp.shapes))
    else:
        H = draw(bucket(sp.heads))
        HV = H * draw(bucket([g for g in (1, 2, 4) if H * g <= max(sp.heads)]))
        K, V = draw(bucket(sp.dims)), draw(bucket(sp.dims))
    varlen = draw(st.booleans())
    B = 1 if varlen else draw(bucket([1, 2]))
    T = draw(st.integers(2 if varlen else 1, max(2, min(sp.max_T, sp.elements // (B * HV * K * V)))))
    cuts = sorted(set(draw(st.lists(st.integers(1, T - 1), min_size=1, max_size=2)))) if varlen else ()
    return core_case(
        B, T, H, HV, K, V, draw(seeds()), chunk=draw(bucket(sp.chunks)) if chunked else None, fused=fused,
        has_state=draw(st.booleans()), strength=draw(bucket(("moderate", "mixed", "slow"))),
        cu_seqlens=[0, *cuts, T] if varlen else None, pattern=draw(bucket(PATTERNS)),
        beta_shift=draw(bucket([0.0, 6.0])), v_scale=draw(bucket([1.0, 1e-2, 30.0])),
        qk_scale=draw(bucket([2.0, 1e-3])) if fused else 2.0)


def gate_case(B, T, HV, K, seed) -> Case:
    r = rng(seed)
    return Case({"g_raw": normal(r, (B, T, HV, K), 3.0), "A_log": r.uniform(-2.0, 1.5, size=HV),
                 "dt_bias": normal(r, (HV * K,), 1.0)}, label=f"B={B} T={T} HV={HV} K={K}")


@st.composite
def gate_cases(draw):
    B, T, HV, K = draw(bucket([(2, 5, 3, 16), (1, 9, 2, 32)]))
    return gate_case(B, T, HV, K, draw(seeds()))


def decode_case(B, H, HV, K, V, seed, *, n_slots=None) -> Case:
    """One decode step of B sequences over a pool of ``n_slots`` (default B + 3) states."""
    r = rng(seed)
    n = n_slots or B + 3
    a = {"q": normal(r, (B, H, K), 2.0), "k": normal(r, (B, H, K), 2.0), "v": normal(r, (B, HV, V)),
         "g_raw": normal(r, (B, HV, K), 1.5), "beta_logits": normal(r, (B, HV)),
         "A_log": r.uniform(-2.0, 1.0, size=HV), "dt_bias": normal(r, (HV * K,), 0.5),
         "state_pool": normal(r, (n, HV, K, V), 0.5), "slot_ids": _slots.slot_ids(r, B, n)}
    return Case(a, label=f"B={B} slots={n} H={H} HV={HV} K={K} V={V}")


@st.composite
def decode_cases(draw):
    B, H, HV, K, V = draw(bucket([(3, 1, 2, 32, 16), (4, 2, 2, 16, 32)]))
    return decode_case(B, H, HV, K, V, draw(seeds()))


# -- the decode step: the optimized op updates the pool in place; the record compares it whole ----
def decode_step(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None):
    """optimized.kda.fused_recurrent_decode, returning (o, the pool it updated in place)."""
    from optimized.kda import fused_recurrent_decode  # here: importing optimized picks the Triton backend

    o = fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, scale=scale)
    return o, state_pool


def decode_step_reference(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None):
    """reference.kda.fused_recurrent, one token per named slot."""
    def step(b, s):
        one = [t[b, ...][None, None, ...] for t in (q, k, v, g_raw, beta_logits)]
        o, st_ = ref.fused_recurrent(*one, A_log, dt_bias, initial_state=s[None, ...], scale=scale)
        return o[0, 0, ...], st_[0, ...]

    return _slots.per_row(step, v, state_pool, slot_ids)


def decode_step_emulated(q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, scale=None,
                         mutation=None):
    o = torch.zeros_like(v)
    for b, s in enumerate(int(s) for s in slot_ids.tolist()):
        if s < 0:
            continue
        ob, sb = emu.fused_recurrent(q[b][None, None], k[b][None, None], v[b][None, None],
                                     g_raw[b][None, None], beta_logits[b][None, None], A_log, dt_bias,
                                     initial_state=state_pool[s][None], scale=scale, mutation=mutation)
        o[b] = ob[0, 0]
        state_pool[s] = sb[0].to(state_pool.dtype)
    return o, state_pool


def decode_step_bound(x, kw, r, p):
    """kda.fused_recurrent's model (T = 1) on the named slots; untouched rows and padding exact."""
    rows, slots = _slots.valid(x)
    o_b = np.zeros(np.shape(r["o"]))
    pool_b = np.zeros(np.shape(r["state_pool"]))
    if rows.size:
        sub = {n: x[n][rows][:, None] for n in ("q", "k", "v", "g_raw", "beta_logits")}
        sub.update(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["state_pool"][slots], cu_seqlens=None)
        rr = {"o": r["o"][rows][:, None], "final_state": r["state_pool"][slots]}
        pp = dataclasses.replace(p, out={"o": p.uo("o"), "final_state": p.uo("state_pool")})
        b = bounds.fused(sub, kw, rr, pp)
        o_b[rows] = b["o"][:, 0]
        pool_b[slots] = b["final_state"]
    return {"o": o_b, "state_pool": pool_b}


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


POLICY = {"g": "fp32", "beta": "fp32", "initial_state": "fp32", "A_log": "fp32", "dt_bias": "fp32",
          "cu_seqlens": "int"}
BATCH = {"inputs": {n: 0 for n in ("q", "k", "v", "g", "beta", "g_raw", "beta_logits", "initial_state")},
         "outputs": {"o": 0, "final_state": 0}}
CORE = ("q", "k", "v", "g", "beta")
FUSED = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")
KW = ("initial_state", "cu_seqlens")

STATE_T = wrap("state_stored_transposed", "final state written V-major into the K-major buffer (K != V)",
               outputs=_state_T)
H0_T = wrap("initial_state_read_transposed", "the carried state read V-major from the K-major buffer "
            "(K != V; a kernel that loads the state as [V, K])", inputs=_h0_T)

GATE = OpRecord(
    name="kda.gate", reference=ref.gate, optimized=Ref("optimized.kda", "gate"),
    emulated=emu.gate, inputs=gate_cases, bound=bounds.gate, outputs=("g",),
    args=("g_raw", "A_log", "dt_bias"), policy=POLICY, reductions="none",
    batch={"inputs": {"g_raw": 0}, "outputs": {"g": 0}},
    bound_doc="exp(A) (sigmoid(z) ua |z| + softplus err) + ((3 + |A_log|) ua + uo) |g|, z = g_raw + dt_bias",
    mutants=(
        wrap("gate_sign_flipped", "g = +exp(A_log) softplus(...): growth instead of decay", outputs=_neg_out),
        wrap("A_log_plus_one", "A_log + 1 (decays e times stronger)", inputs=_A_plus_one),
        wrap("dt_bias_dropped", "dt_bias not added", inputs=_dt_zero),
        internal("A_log_not_exponentiated", "-A_log * softplus(...) (exp of A_log forgotten)", emu.gate),
    ))

_CORE_DOC = ("per value column: E_t^2 = rho_t^2 E_{t-1}^2 + lam_t^2, rho = max exp(g) max(1, |1 - beta|k|^2|); "
             "o: scale (|q| LAMBDA E_t + gamma_K(ua) |q|.|S_t|) + (ua + uo)|o|")

RECURRENT = OpRecord(
    name="kda.recurrent", reference=ref.recurrent, optimized=Ref("optimized.kda", "recurrent"),
    emulated=emu.recurrent, inputs=lambda: core_cases(), wide=lambda space: wide_core_cases(space),
    bound=bounds.recurrent,
    outputs=("o", "final_state"), args=CORE, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, T", bound_doc=_CORE_DOC + "; state in ua (fp32 registers)",
    mutants=(
        wrap("gate_sign_flipped", "decay exp(-g) instead of exp(g)", inputs=_neg_g),
        wrap("beta_dropped", "beta taken as 1", inputs=_beta_one),
        STATE_T,
        H0_T,
        internal("output_before_update", "o_t reads the state before step t's update", emu.recurrent),
    ))

CHUNKED = OpRecord(
    name="kda.chunked", reference=ref.chunked, optimized=Ref("optimized.kda", "chunked"),
    emulated=emu.chunked, inputs=lambda: core_cases(chunked=True),
    wide=lambda space: wide_core_cases(space, chunked=True), bound=bounds.chunked,
    outputs=("o", "final_state"), args=CORE, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, chunk C, T",
    bound_doc=_CORE_DOC + "; plus per chunk the run-dtype storage of A, M, w, u, v_new, h, Q and their "
              "dots' operands: |M|(u|A| + (2u + gamma_K)|A|abs + gamma_C(ua)(I+|A|abs)), (2u|M| + dM)|R|, "
              "|Q| + (2u + gamma_K)|Q|abs, |k exp(G_last - G)|; |.|abs: sums of |k||k|, |q||k|",
    mutants=(
        wrap("gate_sign_flipped", "decay exp(-g) instead of exp(g)", inputs=_neg_g),
        wrap("beta_dropped", "beta taken as 1", inputs=_beta_one),
        STATE_T,
        H0_T,
        internal("chunk_boundary_off_by_one", "the carried state decays by G one row short of the chunk end",
                 emu.chunked),
    ))

_FUSED_MUTANTS = (
    wrap("A_log_plus_one", "A_log + 1 inside the fused gate", inputs=_A_plus_one),
    wrap("beta_dropped", "beta taken as 1 (sigmoid(+inf))", inputs=_beta_logits_inf),
    STATE_T,
    H0_T,
)

FUSED_RECURRENT = OpRecord(
    name="kda.fused_recurrent", reference=ref.fused_recurrent, optimized=Ref("optimized.kda", "fused_recurrent"),
    emulated=emu.fused_recurrent, inputs=lambda: core_cases(fused=True),
    wide=lambda space: wide_core_cases(space, fused=True), bound=bounds.fused_recurrent,
    outputs=("o", "final_state"), args=FUSED, kwarg_arrays=KW, policy=POLICY, batch=BATCH,
    reductions="K, T",
    bound_doc="kda.recurrent's model at the composed inputs + l2norm/gate/sigmoid errors as input perturbations",
    mutants=_FUSED_MUTANTS + (
        internal("l2norm_skipped", "q, k not l2-normalized in the kernel", emu.fused_recurrent),
        internal("gate_sign_flipped", "the fused gate's sign lost", emu.fused_recurrent),
    ))

FUSED_CHUNKED = OpRecord(
    name="kda.fused_chunked", reference=ref.fused_chunked, optimized=Ref("optimized.kda", "fused_chunked"),
    emulated=emu.fused_chunked, inputs=lambda: core_cases(chunked=True, fused=True),
    wide=lambda space: wide_core_cases(space, chunked=True, fused=True), bound=bounds.fused_chunked,
    outputs=("o", "final_state"), args=FUSED, kwarg_arrays=KW,
    policy=POLICY, batch=BATCH, reductions="K, chunk C, T",
    bound_doc="kda.chunked's model at the composed inputs + prologue errors (normalized q, k stored in the run dtype)",
    mutants=_FUSED_MUTANTS + (
        internal("l2norm_skipped", "q, k not l2-normalized in the kernel", emu.fused_chunked),
        internal("beta_sigmoid_skipped", "beta logits used as beta", emu.fused_chunked),
    ))


def _l2_skipped(fn):
    return internal("l2norm_skipped", "q, k not l2-normalized in the kernel", fn)


FUSED_RECURRENT_DECODE = OpRecord(
    name="kda.fused_recurrent_decode", reference=decode_step_reference, optimized=decode_step,
    emulated=decode_step_emulated, inputs=decode_cases, bound=decode_step_bound, outputs=("o", "state_pool"),
    args=("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "state_pool", "slot_ids"),
    policy={"state_pool": "fp32", "slot_ids": "int", "A_log": "fp32", "dt_bias": "fp32"},
    in_place=True, reductions="K", dirty=_slots.dirty,
    batch={"inputs": {n: 0 for n in ("q", "k", "v", "g_raw", "beta_logits", "slot_ids")}, "outputs": {"o": 0}},
    bound_doc="kda.fused_recurrent's model (T = 1) on the named slots; untouched pool rows and padding outputs exact",
    mutants=_slots.MUTANTS + (wrap("A_log_plus_one", "A_log + 1 inside the fused gate", inputs=_A_plus_one),
                              _l2_skipped(decode_step_emulated), _slots.blanked_by_zero("o")))


def records() -> list[OpRecord]:
    return [GATE, RECURRENT, CHUNKED, FUSED_RECURRENT, FUSED_CHUNKED, FUSED_RECURRENT_DECODE]


# -- the core ops with only the q/k l2norm fused in the call ------------------------------------------
# fla's ``chunk_kda`` / ``fused_recurrent_kda`` with ``use_qk_l2norm_in_kernel=True`` and the gate and
# beta computed outside (what vLLM and transformers' KimiLinear call): neither the core ops (unit q, k
# given) nor the fused ones (the gate and beta sigmoid fused too). These records judge such calls seen
# by ``parity.watch``; no optimized op of this repository computes them, so they are not registered
# (``parity certify`` never runs them) and :func:`variants` lists them.
QK_L2NORM = "+qk_l2norm"


def _qk_l2norm_reference(fn):
    from reference.norm import l2norm

    def run(q, k, v, g, beta, **kw):
        return fn(l2norm(q), l2norm(k), v, g, beta, **kw)

    run.__name__ = run.__qualname__ = f"{fn.__name__}_qk_l2norm"
    run.__doc__ = f"reference.kda.{fn.__name__} of l2norm(q), l2norm(k) (eps 1e-6), the other inputs as given."
    return run


def _qk_l2norm_emulated(fn):
    from ..emulate import cdt
    from ..emulate.norm import l2norm

    def run(q, k, v, g, beta, *, mutation=None, **kw):
        cd = cdt(q.dtype)
        if mutation == "l2norm_skipped":
            qn, kn = q.to(cd), k.to(cd)
        else:
            qn, kn = l2norm(q.to(cd)), l2norm(k.to(cd))
        o, S = fn(qn, kn, v.to(cd), g, beta, mutation=None if mutation == "l2norm_skipped" else mutation, **kw)
        return o.to(v.dtype), S

    return run


@st.composite
def _raw_qk_cases(draw, chunked=False):
    """Core inputs with q, k rows of norm 2.5: a skipped l2norm shows."""
    c = draw(core_cases(chunked=chunked))
    c.arrays["q"], c.arrays["k"] = 2.5 * c.arrays["q"], 2.5 * c.arrays["k"]
    return c


def _qk_l2norm_variant(rec: OpRecord, core_internal: str) -> OpRecord:
    emulated = _qk_l2norm_emulated(rec.emulated)
    mutants = tuple(m for m in rec.mutants if m.kind == "wrap") + (
        internal(core_internal, next(m.doc for m in rec.mutants if m.name == core_internal), emulated),
        internal("l2norm_skipped", "q, k not l2-normalized in the call", emulated))
    chunked = rec is CHUNKED
    return dataclasses.replace(
        rec, name=rec.name + QK_L2NORM, reference=_qk_l2norm_reference(rec.reference), emulated=emulated,
        optimized=Ref("parity.ops.kda", "no_optimized_op"), mutants=mutants,
        inputs=lambda: _raw_qk_cases(chunked=chunked),
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
