"""Records: mla.naive, mla.absorbed, mla.paged_decode (the paged decode kernel vs the reference
absorbed form at the last position of each sequence).
"""
from __future__ import annotations

import torch

from optimized import mla as fast
from parity.ops._util import STALE_SEED, poison
from parity.registry import OpRecord
from reference import mla as ref
from reference.executor import namespace

from . import bounds, emulate, mutants
from .inputs import absorbed_cases, decode_cases, dirty_decode, wide_attention_cases


# -- paged decode: build a paged cache with shuffled blocks, write each sequence, decode -----------
def paged_decode_adapter(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None,
                         _block_shift=0):
    """Run optimized.mla.paged_decode on the contiguous inputs: a PagedLatentCache with blocks
    assigned in a seeded random order (plus two spare blocks), positions written through the slot
    mapping, then one decode query per sequence. ``cache_fill``: what the cache's memory holds
    before the sequences are written (``nan``, ``inf``, ``stale``; None: zeros), so the tail of
    each last block and the spare blocks are dirty. ``_block_shift`` is a mutant hook (reads the
    next block of the table)."""
    B, S, L = latent.shape
    R = k_pe.shape[-1]
    nb = -(-S // block_size)
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(B * nb + 2, generator=g)[: B * nb].reshape(B, nb).to(latent.device)
    cache = fast.PagedLatentCache(B * nb + 2, block_size, L, R, latent.dtype, latent.device)
    if cache_fill is not None:
        cache.kv.copy_(_dirt(cache.kv.shape, cache_fill))
    lens = lengths.to(latent.device)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n, device=latent.device)
        slots = fast.PagedLatentCache.slot_mapping(perm, torch.full_like(pos, b), pos, block_size)
        cache.write(latent[b, :n].contiguous(), k_pe[b, :n].contiguous(), slots)
    table = perm.roll(-_block_shift, dims=1) if _block_shift else perm
    return fast.paged_decode(q, cache, table, lens, w_kvb, scale=scale)


def _dirt(shape, fill):
    if fill == "stale":
        return torch.randn(shape, generator=torch.Generator().manual_seed(STALE_SEED)) * 4.0
    return torch.full(shape, poison(fill))


def reference_decode(q, latent, k_pe, w_kvb, lengths, *, block_size, seed, scale=None, cache_fill=None):
    """The reference absorbed form, per sequence, with the query at its last position."""
    out = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        out.append(ref.absorbed(q[b, ...][None, None, ...], latent[b:b + 1, :n, ...], k_pe[b:b + 1, :n, ...],
                                w_kvb, scale=scale)[0, 0, ...])
    return namespace(q).stack(out)


MLA_DOC = ("sum_s p_s rel_p_s |v_s| + LAMBDA scale sqrt(sum_l (u q_lat_l)^2 Cov_l^2) + LAMBDA sqrt(sum_l (W_UV u o~)^2) "
           "+ gamma_S(ua)|W_UV| sum_s p_s|c_s| + gamma_L(ua)|W_UV||o~| + uo|o|; v_s = W_UV c_s, "
           "Cov_l = sum_s p_s (c_sl - o~_l) v_s, rel_p = |d sigma| + sum p d sigma + (4 + |sigma - max|) ua + gamma_S(ua) + u")

NAIVE = OpRecord(
    name="mla.naive", reference=ref.naive, optimized=fast.naive,
    emulated=emulate.naive, inputs=absorbed_cases, wide=wide_attention_cases, bound=bounds.naive, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb"), reductions="L, P + R, context S",
    batch=None,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    bound_doc="sum_s p_s rel_p_s |v_s| + sum_s p_s dv_s + gamma_S(ua) sum_s p_s |v_s| + (2 ua + uo)|o|; "
              "k_s, v_s = W_UK c_s, W_UV c_s stored: dk, dv = gamma_L(ua)|W||c| + u|.|; "
              "d sigma = scale (|q_nope|.dk + gamma_{P+R}(ua) |q|.|k|) + ua|sigma|; rel_p as mla.absorbed",
    mutants=mutants.NAIVE)

ABSORBED = OpRecord(
    name="mla.absorbed", reference=ref.absorbed, optimized=fast.absorbed,
    emulated=emulate.absorbed, inputs=absorbed_cases, wide=wide_attention_cases, bound=bounds.absorbed, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb"), reductions="P, L + R, context S, L",
    batch=None, bound_doc=MLA_DOC,  # torch GEMMs choose kernels by M: bytes = run-to-run only
    mutants=mutants.ABSORBED)

PAGED_DECODE = OpRecord(
    name="mla.paged_decode", reference=reference_decode, optimized=paged_decode_adapter,
    emulated=emulate.paged_decode, inputs=decode_cases, bound=bounds.paged_decode, outputs=("o",),
    args=("q", "latent", "k_pe", "w_kvb", "lengths"), policy={"lengths": "int"},
    counter="mla.paged_decode", reductions="P, L + R, context length, L", dirty=dirty_decode,
    batch={"inputs": {"q": 0, "latent": 0, "k_pe": 0, "lengths": 0}, "outputs": {"o": 0}},
    bound_doc="as mla.absorbed, one query per sequence over its own context length",
    mutants=mutants.PAGED_DECODE)


def records() -> list[OpRecord]:
    return [NAIVE, ABSORBED, PAGED_DECODE]
