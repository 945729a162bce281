"""Inputs of the KDA ops (hypothesis strategies of :class:`parity.registry.Case`, and the case
builders the kernel tests call with their own shapes).

Inputs keep K != V (a transposed state cannot hide), include GVA (HV = 2 H), ragged final chunks,
several chunks per sequence (so a chunk-boundary slip reaches the outputs), carried initial states,
variable-length batches, and decays from ~1 to ~e^-12 per step (``strong``: ~e^-5 to e^-130, whose
prefix sums run far past exp's range inside a chunk).

Both gates: the softplus gate's records draw ``lower_bound``-free cases, the bounded gate's
(``+lower_bound``) cases with ``lower_bound`` in their kwargs (and A_log sometimes absent). Among the
draws of both, hostile inputs (:data:`HOSTILE`): keys identical or near-collinear over a whole run of
16, 32 or 64 tokens, gates at and near the bound, large beta, and their combination that breaks an
fp16 Neumann-series inverse of the chunk matrix (identical keys, raw gate -12, raw beta 8: FlashKDA
1ce47ea turns NaN there).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from parity.ops import _slots
from parity.registry import Case
from parity.strategies import bucket, normal, rng, seeds


def unit_rows(r: np.random.Generator, shape) -> np.ndarray:
    """Rows of unit 2-norm (KDA keys and queries after l2norm)."""
    x = r.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def log_decays(r: np.random.Generator, shape, strength: str = "mixed") -> np.ndarray:
    """Log-space decays g <= 0 as the KDA gate makes them: ``-exp(a) softplus(z)``. ``mixed``
    spans per-step decays from ~1 (g ~ -0.01) to ~e^-12; ``moderate`` stays in e^-0.05..e^-1;
    ``strong`` is ~e^-5 .. e^-130 (a chunk's prefix sums reach thousands: past exp's range);
    ``slow`` is 1 - 1e-4 .. 1 - 1e-2 (long memory: the state carries every step's rounding for
    many steps)."""
    z = r.standard_normal(shape)
    if strength == "slow":
        return -np.exp(r.uniform(-9.0, -4.5, size=shape[:-1] + (1,))) * np.log1p(np.exp(z))
    if strength == "strong":
        a = r.uniform(0.0, 2.8, size=shape[:-1] + (1,))
        return -np.exp(a) * np.log1p(np.exp(z + 6.0))
    sp = np.log1p(np.exp(z))
    if strength == "moderate":
        a = r.uniform(-2.5, -0.5, size=shape[:-1] + (1,))
    else:
        a = r.uniform(-4.0, 1.5, size=shape[:-1] + (1,))
    return -np.exp(a) * sp


# (B, T, H, HV, K, V, chunk), smallest first (what hypothesis tries first and shrinks toward); each
# shows every mutant: K != V, at least two chunks, a carried state
SHAPES = [(2, 20, 1, 1, 16, 32, 16), (1, 70, 1, 2, 32, 16, 32), (2, 37, 2, 2, 16, 32, 16)]
# the bounded gate's records add the head size of the kernels that serve it (FlashKDA takes only
# K = V = 128 and H = HV): 80 tokens, so a 64-token run of identical keys fits
BOUNDED_SHAPES = SHAPES + [(1, 80, 2, 2, 128, 128, 16)]
STRENGTHS = ("mixed", "moderate", "strong", "slow")
PATTERNS = ("random", "repeat", "lowrank")
# the bounded gate's b as drawn: the models' -5 first, and one inside the range (a port that
# hard-codes -5 shows)
LOWER_BOUNDS = (-5.0, -2.5)
# hostile inputs: None (none), keys identical over a run of tokens (``identical``) or near-collinear
# (``collinear``: one direction plus 1e-3 noise), gates at and near the bound (``bound``: the bounded
# gate's sigmoid saturated at 1 and just below; the softplus gate's decays at e^-5), large beta
# (``beta``: raw beta 8), and ``neumann``: identical keys, raw gate -12 (decay ~1), raw beta 8
HOSTILE = (None, "identical", "collinear", "bound", "beta", "neumann")
RUNS = (16, 32, 64)   # the lengths of the runs of identical or collinear keys


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
              qk_scale=2.0, lower_bound=None, has_A=True, hostile=None, run=16) -> Case:
    """One input of the core (``fused=False``: unit q, k rows, log-space g, beta) or fused ops (raw
    q, k, gate parameters, beta logits); ``chunk``: the chunk size (chunked ops); ``varlen`` (B = 1):
    two sequences cut at a random point, or ``cu_seqlens`` given; ``strength``: one of STRENGTHS.
    The search's wider draws: ``pattern`` (PATTERNS) of the q, k rows, ``beta_shift`` added to the
    beta logits (+6: beta near 1), ``v_scale`` of v (and the state), ``qk_scale`` of the raw q, k
    of the fused ops (1e-3: the l2norm's eps matters). ``lower_bound`` (fused): the bounded gate's
    b, put in the kwargs, its parameters drawn as the bounded gate's (``has_A`` False: no A_log);
    the core ops' decays are then that gate's. ``hostile`` (HOSTILE) with ``run`` (RUNS): see
    :func:`make_hostile`."""
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
        if lower_bound is None:
            a["A_log"], a["dt_bias"] = _gate_params(r, HV, K, strength)
        else:
            a["A_log"], a["dt_bias"] = _bounded_gate_params(r, HV, K, has_A)
    else:
        a["g"] = log_decays(r, (B, T, HV, K), strength) if lower_bound is None else \
            lower_bound * _sig(normal(r, (B, T, HV, K), 3.0))
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
    if lower_bound is not None and fused:
        kw["lower_bound"] = float(lower_bound)
    if hostile is not None:
        make_hostile(a, r, hostile, run, fused=fused, lower_bound=lower_bound, qk_scale=qk_scale)
    label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}" + (f" C={chunk}" if chunk else "") \
        + (f" varlen{n_seq}" if varlen and n_seq > 2 else " varlen" if varlen else "") \
        + (" h0" if has_state else "") + (f" {strength}" if lower_bound is None else f" lb{lower_bound:g}") \
        + ("" if has_A or not fused or lower_bound is None else " noA") \
        + (f" {pattern}" if pattern != "random" else "") + (" beta~1" if beta_shift else "") \
        + (f" v*{v_scale:g}" if v_scale != 1.0 else "") + (f" qk*{qk_scale:g}" if fused and qk_scale != 2.0 else "") \
        + (f" {hostile}" + (f"{min(run, T)}" if hostile in ("identical", "collinear", "neumann") else "")
           if hostile else "")
    return Case(a, kw, label=label)


def _bounded_gate_params(r, HV, K, has_A):
    """(A_log or None, dt_bias) of the bounded gate ``b sigmoid(exp(A_log) (g_raw + dt_bias))``:
    exp(A_log) in e^-1..e^1 (the models start A_log at 0), so with g_raw ~ N(0, 1.5) the sigmoid
    spans its whole range, saturated at both ends on some channels."""
    A_log = r.uniform(-1.0, 1.0, size=HV) if has_A else None
    return A_log, normal(r, (HV * K,), 1.0)


def make_hostile(a: dict, r, kind: str, run: int, *, fused: bool, lower_bound=None, qk_scale=2.0) -> None:
    """Make the arrays ``a`` of one input hostile, in place (module docstring; ``kind`` in HOSTILE):

    - ``identical`` / ``collinear``: in every batch row and qk head, ``run`` consecutive keys (from a
      random start, all of them when T is shorter) are one direction (``collinear``: plus noise of
      1e-3 relative); the chunk's key-key matrix is then all but singular in its run;
    - ``bound``: the gate at its bound (the bounded gate's sigmoid saturated: raw gate +30 on half the
      channels, +3 just below on the rest; the softplus gate's ops: decays exp(-5) and exp(-4.99));
    - ``beta``: beta near 1 (raw beta 8);
    - ``neumann``: ``identical``, with raw gate -12 (decay ~1: nothing forgets), raw beta 8 and, for
      the fused ops, A_log = 0, dt_bias = 0 (the combination that turns an fp16 Neumann inverse NaN).
    """
    k = a["k"]
    B, T, H, K = k.shape
    if kind in ("identical", "collinear", "neumann"):
        n = min(run, T)
        for b in range(B):
            t0 = int(r.integers(0, T - n + 1))
            u = r.standard_normal((H, K))
            rows = np.broadcast_to(u, (n, H, K)).copy()
            if kind == "collinear":
                rows += 1e-3 * np.linalg.norm(u, axis=-1, keepdims=True) / np.sqrt(K) * r.standard_normal((n, H, K))
            rows /= np.linalg.norm(rows, axis=-1, keepdims=True)
            k[b, t0:t0 + n] = rows * (qk_scale if fused else 1.0)
    if kind in ("beta", "neumann"):
        if fused:
            a["beta_logits"] = np.full_like(a["beta_logits"], 8.0)
        else:
            a["beta"] = np.full_like(a["beta"], _sig(8.0))
    if kind == "neumann":
        if fused:
            a["g_raw"] = np.full_like(a["g_raw"], -12.0)
            a["dt_bias"] = np.zeros_like(a["dt_bias"])
            if a["A_log"] is not None:
                a["A_log"] = np.zeros_like(a["A_log"])
        else:
            b = -5.0 if lower_bound is None else lower_bound
            a["g"] = np.full_like(a["g"], b * _sig(-12.0))
    if kind == "bound":
        half = np.arange(K) < K // 2
        if fused:
            z = np.where(half, 30.0, 6.0)
            if lower_bound is None:   # the softplus gate has no bound: its largest decays, e^-5
                z = np.where(half, 5.0, 4.99)
                a["A_log"] = np.zeros_like(a["A_log"])
            HV = a["g_raw"].shape[2]
            a["dt_bias"] = np.zeros_like(a["dt_bias"])
            a["g_raw"] = np.broadcast_to(z, a["g_raw"].shape).copy() if a["A_log"] is None else \
                np.broadcast_to(z * np.exp(-a["A_log"])[:, None], a["g_raw"].shape[:2] + (HV, K)).copy()
        else:
            b = -5.0 if lower_bound is None else lower_bound
            a["g"] = np.broadcast_to(np.where(half, b, b * 0.998), a["g"].shape).copy()


@st.composite
def core_cases(draw, chunked=False, fused=False, bounded=False):
    """The certification inputs of the core (``fused`` False) or fused ops, of the softplus gate or
    (``bounded``) the bounded one, hostile ones among them (HOSTILE; the first draw is not)."""
    B, T, H, HV, K, V, C = draw(bucket(BOUNDED_SHAPES if bounded else SHAPES))
    if chunked:   # the shape's chunk first, then twice it: 16, 32 and 64 all drawn (fla takes 32, 64)
        C = draw(bucket([C, 2 * C]))
    has_state = draw(bucket([True, False]))
    varlen = B == 1 and draw(bucket([True, False]))
    strength = draw(bucket(["mixed", "moderate"]))
    seed = draw(seeds())
    gate = {}
    if bounded:
        gate = {"lower_bound": draw(bucket(LOWER_BOUNDS)), "has_A": draw(bucket([True, False]))}
    hostile = draw(bucket(HOSTILE))
    run = draw(bucket(RUNS)) if hostile in ("identical", "collinear", "neumann") else 16
    return core_case(B, T, H, HV, K, V, seed, chunk=C if chunked else None, fused=fused,
                     has_state=has_state, varlen=varlen, strength=strength, hostile=hostile, run=run, **gate)


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
def wide_core_cases(draw, space="full", chunked=False, fused=False, bounded=False):
    """Inputs of the core or fused ops drawn widely (``parity search``): head dims 16 to 128 (K and
    V apart), 1 to 8 heads, GVA, any T up to the space's cap, chunk sizes 16/32/64, carried states,
    varlen batches of two or three sequences, decays from 1 - 1e-4 (``slow``) to e^-12 per step,
    beta near 1, values over four decades, raw q, k of norm ~1e-3 (fused: the l2norm's eps), and
    q, k rows that make the read-out cancel (``repeat``, ``lowrank``); the hostile inputs
    (HOSTILE); ``bounded``: the bounded gate's inputs (b and A_log drawn)."""
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
    gate = {"lower_bound": draw(bucket(LOWER_BOUNDS)), "has_A": draw(st.booleans())} if bounded else {}
    hostile = draw(bucket(HOSTILE))
    return core_case(
        B, T, H, HV, K, V, draw(seeds()), chunk=draw(bucket(sp.chunks)) if chunked else None, fused=fused,
        has_state=draw(st.booleans()), strength=draw(bucket(("moderate", "mixed", "slow"))),
        cu_seqlens=[0, *cuts, T] if varlen else None, pattern=draw(bucket(PATTERNS)),
        beta_shift=draw(bucket([0.0, 6.0])), v_scale=draw(bucket([1.0, 1e-2, 30.0])),
        qk_scale=draw(bucket([2.0, 1e-3])) if fused else 2.0, hostile=hostile,
        run=draw(bucket(RUNS)), **gate)


def gate_case(B, T, HV, K, seed, *, lower_bound=None, has_A=True) -> Case:
    """An input of kda.gate; ``lower_bound``: the bounded gate's (in the kwargs; ``has_A`` False: no
    A_log), whose raw gate also takes, on a few channels, values that saturate the sigmoid at the
    bound (+30, +60) and below float32's range (-60, -120: the gate underflows there)."""
    r = rng(seed)
    a = {"g_raw": normal(r, (B, T, HV, K), 3.0), "A_log": r.uniform(-2.0, 1.5, size=HV) if has_A else None,
         "dt_bias": normal(r, (HV * K,), 1.0)}
    if lower_bound is None:
        return Case(a, label=f"B={B} T={T} HV={HV} K={K}")
    a["g_raw"][..., :4] = [30.0, 60.0, -60.0, -120.0]
    return Case(a, {"lower_bound": float(lower_bound)},
                label=f"B={B} T={T} HV={HV} K={K} lb{lower_bound:g}" + ("" if has_A else " noA"))


@st.composite
def gate_cases(draw, bounded=False):
    B, T, HV, K = draw(bucket([(2, 5, 3, 16), (1, 9, 2, 32)]))
    if not bounded:
        return gate_case(B, T, HV, K, draw(seeds()))
    return gate_case(B, T, HV, K, draw(seeds()), lower_bound=draw(bucket(LOWER_BOUNDS)),
                     has_A=draw(bucket([True, False])))


def decode_case(B, H, HV, K, V, seed, *, n_slots=None, lower_bound=None, has_A=True) -> Case:
    """One decode step of B sequences over a pool of ``n_slots`` (default B + 3) states;
    ``lower_bound``: of the bounded gate (in the kwargs; ``has_A`` False: no A_log)."""
    r = rng(seed)
    n = n_slots or B + 3
    a = {"q": normal(r, (B, H, K), 2.0), "k": normal(r, (B, H, K), 2.0), "v": normal(r, (B, HV, V)),
         "g_raw": normal(r, (B, HV, K), 1.5), "beta_logits": normal(r, (B, HV)),
         "A_log": r.uniform(-2.0, 1.0, size=HV), "dt_bias": normal(r, (HV * K,), 0.5),
         "state_pool": normal(r, (n, HV, K, V), 0.5), "slot_ids": _slots.slot_ids(r, B, n)}
    label = f"B={B} slots={n} H={H} HV={HV} K={K} V={V}"
    if lower_bound is None:
        return Case(a, label=label)
    a["A_log"], a["dt_bias"] = _bounded_gate_params(r, HV, K, has_A)
    return Case(a, {"lower_bound": float(lower_bound)}, label=f"{label} lb{lower_bound:g}" + ("" if has_A else " noA"))


@st.composite
def decode_cases(draw, bounded=False):
    B, H, HV, K, V = draw(bucket([(3, 1, 2, 32, 16), (4, 2, 2, 16, 32)]))
    if not bounded:
        return decode_case(B, H, HV, K, V, draw(seeds()))
    return decode_case(B, H, HV, K, V, draw(seeds()), lower_bound=draw(bucket(LOWER_BOUNDS)),
                       has_A=draw(bucket([True, False])))


@st.composite
def raw_qk_cases(draw, chunked=False):
    """Core inputs with q, k rows of norm 2.5: a skipped l2norm shows."""
    c = draw(core_cases(chunked=chunked))
    c.arrays["q"], c.arrays["k"] = 2.5 * c.arrays["q"], 2.5 * c.arrays["k"]
    return c
