"""The model's MLA calls captured as records (parity/record/capture/sites.py): the prefill as mla.naive,
the decode step as mla.paged_decode (its paged cache gathered into contiguous rows), and the arrays
the records' mutants need that the model never hands over (:data:`AUX`)."""
from __future__ import annotations

import torch

from parity.registry import Site, picked


def _decode(a):
    """The paged cache gathered into contiguous [B, S, L] / [B, S, R] rows (zeros past each length):
    the record's adapter builds its own paged cache from them (its block order from ``seed``)."""
    cache, batch, q = a["cache"], a["batch"], a["q"]
    lengths = batch.seq_lens[: q.shape[0]].to(torch.int64)
    S = int(lengths.max())
    latent = q.new_zeros((q.shape[0], S, cache.L))
    k_pe = q.new_zeros((q.shape[0], S, cache.R))
    for b, n in enumerate(lengths.tolist()):
        latent[b, :n], k_pe[b, :n] = cache.gather(batch.block_tables[b], n)
    arrays = {"q": q, "latent": latent, "k_pe": k_pe, "w_kvb": a["w_kvb"], "lengths": lengths}
    return arrays, {"block_size": int(cache.block_size), "seed": 0}


SITES = (
    Site("mla_prefill", "mla.naive", picked("q", "latent", "k_pe", "w_kvb")),
    Site("mla_decode", "mla.paged_decode", _decode,
         note="the paged cache is gathered into contiguous rows; the replay pages them itself "
              "(blocks in a seeded order), not in the model's block table"),
    Site("mla_write", None, note="the paged cache write (PagedLatentCache.write): data movement, no record"),
)


def _latent_raw(arrays: dict) -> dict:
    """The raw latent projection that ``latent_not_normed`` substitutes. The model never hands it to
    the attention op (and the cache keeps only normed latents), so a replay takes ``3 x latent``: a
    raw projection of rms ~3, as the drawn cases have (parity/ops/mla/inputs.py)."""
    return {"latent_raw": 3.0 * arrays["latent"]}


AUX = {"mla.naive": _latent_raw, "mla.paged_decode": _latent_raw}
