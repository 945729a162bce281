"""Inputs of the KDA ops (hypothesis strategies of :class:`parity.registry.Case`, and the case
builders the kernel tests call with their own shapes).

Inputs keep K != V (a transposed state cannot hide), include GVA (HV = 2 H), ragged final chunks,
several chunks per sequence (so a chunk-boundary slip reaches the outputs), carried initial states,
variable-length batches, and decays from ~1 to ~e^-12 per step (``strong``: ~e^-5 to e^-130, whose
prefix sums run far past exp's range inside a chunk).
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


@st.composite
def raw_qk_cases(draw, chunked=False):
    """Core inputs with q, k rows of norm 2.5: a skipped l2norm shows."""
    c = draw(core_cases(chunked=chunked))
    c.arrays["q"], c.arrays["k"] = 2.5 * c.arrays["q"], 2.5 * c.arrays["k"]
    return c
