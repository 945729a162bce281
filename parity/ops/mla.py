"""Records: mla.naive, mla.absorbed, mla.paged_decode (the paged decode kernel vs the reference
absorbed form at the last position of each sequence)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from reference import mla as ref
from reference.executor import namespace

from ..bounds import mla as bounds
from ..emulate import mla as emu
from ..mutants import internal, wrap
from ..registry import Case, Mutant, OpRecord, Ref
from ..strategies import bucket, normal, rng, seeds
from ._util import STALE_SEED, poison

# (B, T, S, N, P, R, L, Vh)
SHAPES = [(2, 4, 4, 2, 32, 8, 32, 32), (2, 3, 19, 2, 16, 8, 32, 16), (1, 1, 33, 3, 16, 16, 64, 32)]


def _latent(r, shape, L):
    """(normed latent, raw latent): kv_a_layernorm of a raw projection whose rms is far from 1."""
    raw = normal(r, shape, 3.0)
    w = 1.0 + 0.2 * normal(r, (L,))
    normed = raw / np.sqrt(np.mean(raw * raw, axis=-1, keepdims=True) + 1e-6) * w
    return normed, raw


def attention_case(B, T, S, N, P, R, L, Vh, seed, *, w_scale=1.0) -> Case:
    """An input of the contiguous forms (naive, absorbed): T queries at the end of S positions;
    ``w_scale`` scales w_kvb (larger: sharper softmax)."""
    r = rng(seed)
    lat, raw = _latent(r, (B, S, L), L)
    a = {"q": normal(r, (B, T, N, P + R)), "latent": lat, "k_pe": normal(r, (B, S, R)),
         "w_kvb": normal(r, (N * (P + Vh), L), w_scale * L ** -0.5)}
    return Case(a, aux={"latent_raw": raw}, label=f"B={B} T={T} S={S} N={N} P={P} R={R} L={L} Vh={Vh}")


@st.composite
def absorbed_cases(draw):
    B, T, S, N, P, R, L, Vh = draw(bucket(SHAPES))
    return attention_case(B, T, S, N, P, R, L, Vh, draw(seeds()))


@st.composite
def wide_attention_cases(draw, space="full"):
    """The contiguous forms over wider shapes (parity search): 1 to 8 heads, head dims 8 to 128,
    latent ranks 16 to 512 (the model's 576-wide latent keys), T queries at the end of S positions
    up to the space's cap, and sharper softmaxes (``w_kvb`` scaled up to 4x)."""
    cap = {"cheap": 1 << 14, "full": 1 << 20, "buckets": 1 << 22}[space]
    N = draw(bucket([1, 2, 4, 8]))
    P, R, Vh = (draw(bucket([8, 16, 64, 128])) for _ in range(3))
    L = draw(bucket([16, 64, 128, 512]))
    B = draw(bucket([1, 2]))
    S = draw(st.integers(1, max(1, min(512, cap // (B * (L + R + N * (P + Vh)))))))
    T = draw(st.integers(1, S))
    return attention_case(B, T, S, N, P, R, L, Vh, draw(seeds()), w_scale=draw(bucket([1.0, 2.0, 4.0])))


@st.composite
def decode_cases(draw):
    B, S, N, P, R, L, Vh, bs = draw(bucket([(2, 20, 3, 16, 16, 64, 32, 8), (3, 40, 2, 16, 8, 32, 16, 16)]))
    r = rng(draw(seeds()))
    lat, raw = _latent(r, (B, S, L), L)
    lengths = np.array([S] + [int(x) for x in r.integers(2, S + 1, size=B - 1)], dtype=np.int64)
    a = {"q": normal(r, (B, N, P + R)), "latent": lat, "k_pe": normal(r, (B, S, R)),
         "w_kvb": normal(r, (N * (P + Vh), L), L ** -0.5), "lengths": lengths}
    return Case(a, {"block_size": bs, "seed": int(r.integers(0, 2**31))}, aux={"latent_raw": raw},
                label=f"B={B} S<={S} N={N} P={P} R={R} L={L} Vh={Vh} block={bs}")


# -- paged decode: build a paged cache with shuffled blocks, write each sequence, decode -----------
def paged_decode_adapter(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None,
                         _block_shift=0):
    """Run optimized.mla.paged_decode on the contiguous inputs: a PagedLatentCache with blocks
    assigned in a seeded random order (plus two spare blocks), positions written through the slot
    mapping, then one decode query per sequence. ``cache_fill``: what the cache's memory holds
    before the sequences are written (``nan``, ``inf``, ``stale``; None: zeros), so the tail of
    each last block and the spare blocks are dirty. ``_block_shift`` is a mutant hook (reads the
    next block of the table)."""
    from optimized.mla import PagedLatentCache, paged_decode  # here: importing optimized picks the backend

    B, S, L = latent.shape
    R = k_pe.shape[-1]
    nb = -(-S // block_size)
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(B * nb + 2, generator=g)[: B * nb].reshape(B, nb).to(latent.device)
    cache = PagedLatentCache(B * nb + 2, block_size, L, R, latent.dtype, latent.device)
    if cache_fill is not None:
        cache.kv.copy_(_dirt(cache.kv.shape, cache_fill))
    lens = lengths.to(latent.device)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n, device=latent.device)
        slots = PagedLatentCache.slot_mapping(perm, torch.full_like(pos, b), pos, block_size)
        cache.write(latent[b, :n].contiguous(), k_pe[b, :n].contiguous(), slots)
    table = perm.roll(-_block_shift, dims=1) if _block_shift else perm
    return paged_decode(q, cache, table, lens, w_kvb, scale=scale)


def _dirt(shape, fill):
    if fill == "stale":
        return torch.randn(shape, generator=torch.Generator().manual_seed(STALE_SEED)) * 4.0
    return torch.full(shape, poison(fill))


def dirty_decode(case: Case, fill: str) -> Case:
    """``case`` with the paged cache's memory holding ``fill`` before the sequences are written."""
    return Case(dict(case.arrays), dict(case.kwargs, cache_fill=fill), dict(case.aux), case.label, case.source)


def reference_decode(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None):
    """The reference absorbed form, per sequence, with the query at its last position."""
    out = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        out.append(ref.absorbed(q[b, ...][None, None, ...], latent[b:b + 1, :n, ...], k_pe[b:b + 1, :n, ...],
                                w_kvb, scale=scale)[0, 0, ...])
    return namespace(q).stack(out)


def emulated_decode(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None,
                    mutation=None, _block_shift=0):
    """The stand-in: contiguous attention; ``_block_shift`` emulates reading the next block of a
    sequence's table (its blocks in order, wrapping around) by rolling the padded context."""
    if _block_shift:
        B, S, L = latent.shape
        cap = -(-S // block_size) * block_size
        pad = lambda t: torch.cat([t, t.new_zeros(B, cap - S, t.shape[-1])], 1).roll(-block_size * _block_shift, 1)
        latent, k_pe = pad(latent), pad(k_pe)
    return emu.paged_decode(q[:, None], latent, k_pe, w_kvb, lengths, scale=scale, mutation=mutation)[:, 0]


class _PScale:
    """Wrap mutant: calls the candidate with scale = P^-0.5 instead of (P + R)^-0.5."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            kw = dict(kw)
            kw["scale"] = (inp["q"].shape[-1] - inp["k_pe"].shape[-1]) ** -0.5
            return cand(inp, kw)

        return mutated


def _raw_latent(d, aux):
    d["latent"] = aux["latent_raw"]
    return d


class _TailTimesZero:
    """Wrap mutant (vLLM pull 43961): the unused tail of a sequence's last block blanked by
    multiplying by zero instead of masking: each such sequence's output gains 0 x what the tail
    holds, NaN once it holds NaN or Inf, nothing on finite memory."""

    def __call__(self, cand, record):
        def mutated(inp, kw):
            out = dict(cand(inp, kw))
            fill = kw.get("cache_fill")
            if fill is None:
                return out
            o = out["o"]
            tail = (inp["lengths"] % kw["block_size"] != 0).to(o.device)[:, None, None]
            out["o"] = torch.where(tail, o + 0.0 * poison(fill), o)
            return out

        return mutated


def _no_kpe(d):
    d["k_pe"] = torch.zeros_like(d["k_pe"])
    return d


def _stale(d):
    d["lengths"] = d["lengths"] - 1
    return d


def _shift_blocks(kw):
    kw["_block_shift"] = 1
    return kw


WRONG_SCALE = Mutant("wrong_scale", "softmax scale P^-0.5 (the rope dims left out)", "wrap", _PScale())
MLA_DOC = ("sum_s p_s rel_p_s |v_s| + LAMBDA scale sqrt(sum_l (u q_lat_l)^2 Cov_l^2) + LAMBDA sqrt(sum_l (W_UV u o~)^2) "
           "+ gamma_S(ua)|W_UV| sum_s p_s|c_s| + gamma_L(ua)|W_UV||o~| + uo|o|; v_s = W_UV c_s, "
           "Cov_l = sum_s p_s (c_sl - o~_l) v_s, rel_p = |d sigma| + sum p d sigma + (4 + |sigma - max|) ua + gamma_S(ua) + u")

ATTENTION_MUTANTS = (
    WRONG_SCALE,
    wrap("latent_not_normed", "the raw latent projection used without kv_a_layernorm", inputs=_raw_latent,
         aux=True),
    wrap("k_pe_dropped", "the shared rope key slice left out of the scores", inputs=_no_kpe),
)

NAIVE = OpRecord(
    name="mla.naive", reference=ref.naive, optimized=Ref("optimized.mla", "naive"),
    emulated=emu.naive, inputs=absorbed_cases, wide=wide_attention_cases, bound=bounds.naive, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb"), reductions="L, P + R, context S",
    batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc="sum_s p_s rel_p_s |v_s| + sum_s p_s dv_s + gamma_S(ua) sum_s p_s |v_s| + (2 ua + uo)|o|; "
              "k_s, v_s = W_UK c_s, W_UV c_s stored: dk, dv = gamma_L(ua)|W||c| + u|.|; "
              "d sigma = scale (|q_nope|.dk + gamma_{P+R}(ua) |q|.|k|) + ua|sigma|; rel_p as mla.absorbed",
    mutants=ATTENTION_MUTANTS + (
        internal("causal_off_by_one", "each query also attends to the next position", emu.naive),
        internal("values_from_keys", "W_UV taken from the W_UK rows of w_kvb", emu.naive),
    ))

ABSORBED = OpRecord(
    name="mla.absorbed", reference=ref.absorbed, optimized=Ref("optimized.mla", "absorbed"),
    emulated=emu.absorbed, inputs=absorbed_cases, wide=wide_attention_cases, bound=bounds.absorbed, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb"), reductions="P, L + R, context S, L",
    batch=None, bound_doc=MLA_DOC,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    mutants=ATTENTION_MUTANTS + (
        internal("causal_off_by_one", "each query also attends to the next position", emu.absorbed),
        internal("values_from_keys", "W_UV taken from the W_UK rows of w_kvb", emu.absorbed),
    ))

PAGED_DECODE = OpRecord(
    name="mla.paged_decode", reference=reference_decode, optimized=paged_decode_adapter,
    emulated=emulated_decode, inputs=decode_cases, bound=bounds.paged_decode, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb", "lengths"), policy={"lengths": "int"},
    counter="mla.paged_decode", reductions="P, L + R, context length, L", dirty=dirty_decode,
    batch={"inputs": {"q": 0, "latent": 0, "k_pe": 0, "lengths": 0}, "outputs": {"o": 0}},
    bound_doc="as mla.absorbed, one query per sequence over its own context length",
    mutants=(
        WRONG_SCALE,
        wrap("stale_last_token", "decode does not see the token just written (length - 1)", inputs=_stale),
        wrap("latent_not_normed", "raw latent cached", inputs=_raw_latent, aux=True),
        wrap("block_table_off_by_one", "each position read from the next block of the table", kwargs=_shift_blocks),
        Mutant("tail_blanked_by_zero", "the unused tail of the last block blanked by multiplying by zero "
               "instead of masking (NaN once the cache memory holds NaN or Inf)", "wrap", _TailTimesZero(),
               dirty=True),
    ))


def records() -> list[OpRecord]:
    return [NAIVE, ABSORBED, PAGED_DECODE]
