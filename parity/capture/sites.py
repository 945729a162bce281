"""Which op calls of the optimized model are captured, and as which registered op.

The model makes its op calls through one object, ``model.ops`` (``optimized.backends.Ops``); each
of its methods below is fitted here to the record of the op it runs (the record's input names,
scalar keyword arguments as the op receives them). A method mapped to ``None`` runs unrecorded,
with the reason; :data:`UNCAPTURED` lists what the model computes outside ``model.ops``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Site:
    """``method`` of ``optimized.backends.Ops`` captured as record ``op`` (None: not captured, ``note``
    says why); ``convert(args) -> (arrays, kwargs)`` from the method's bound arguments to the
    record's inputs (tensors, None for an absent optional input) and explicit scalar kwargs."""

    method: str
    op: str | None
    convert: Callable | None = None
    note: str = ""


def _pick(*names, kw=()):
    def convert(a):
        return {n: a[n] for n in names}, {k: a[k] for k in kw}
    return convert


def _conv_prefill(a):
    # state_dtype is the model's pool dtype for the final state, not an argument of the op
    return {"x": a["x"], "weight": a["weight"], "initial_state": a["initial_state"]}, {}


FUSED = ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")


def _kda_prefill(a):
    arrays = {n: a[n] for n in FUSED}
    arrays.update(initial_state=a["initial_state"], cu_seqlens=None)
    return arrays, {}


def _mla_decode(a):
    """The paged cache gathered into contiguous [B, S, L] / [B, S, R] rows (zeros past each length):
    the record's adapter builds its own paged cache from them (its block order from ``seed``)."""
    import torch

    cache, batch, q = a["cache"], a["batch"], a["q"]
    lengths = batch.seq_lens[: q.shape[0]].to(torch.int64)
    S = int(lengths.max())
    latent = q.new_zeros((q.shape[0], S, cache.L))
    k_pe = q.new_zeros((q.shape[0], S, cache.R))
    for b, n in enumerate(lengths.tolist()):
        latent[b, :n], k_pe[b, :n] = cache.gather(batch.block_tables[b], n)
    arrays = {"q": q, "latent": latent, "k_pe": k_pe, "w_kvb": a["w_kvb"], "lengths": lengths}
    return arrays, {"block_size": int(cache.block_size), "seed": 0}


def _experts(a):
    return {n: a[n] for n in ("x", "weights", "ids", "w1", "w2", "w3")}, {}


SITES = {s.method: s for s in (
    Site("embedding", "embed.embedding", _pick("ids", "table")),
    Site("lm_head", "embed.lm_head", _pick("h", "weight")),
    Site("rms_norm", "norm.rms_norm", _pick("x", "weight", kw=("eps",))),
    Site("add_rms_norm", "norm.add_rms_norm", _pick("x", "residual", "weight", kw=("eps",))),
    Site("gated_rms_norm", "norm.gated_rms_norm", _pick("x", "gate", "weight", kw=("eps",))),
    Site("short_conv", "conv.short_conv", _conv_prefill),
    Site("short_conv_step_", "conv.short_conv_step_", _pick("x", "weight", "state_pool", "slot_ids")),
    Site("kda_prefill", "kda.fused_chunked", _kda_prefill),
    Site("kda_decode_", "kda.fused_recurrent_decode", _pick(*FUSED, "state_pool", "slot_ids")),
    Site("mla_prefill", "mla.naive", _pick("q", "latent", "k_pe", "w_kvb")),
    Site("mla_decode", "mla.paged_decode", _mla_decode,
         note="the paged cache is gathered into contiguous rows; the replay pages them itself "
              "(blocks in a seeded order), not in the model's block table"),
    Site("mla_write", None, note="the paged cache write (PagedLatentCache.write): data movement, no record"),
    Site("router_logits", "moe.router_logits", _pick("x", "weight")),
    Site("router", "moe.router", lambda a: ({"logits": a["logits"], "bias": a["bias"]}, dict(a["kw"]))),
    Site("experts", "moe.experts", _experts,
         note="in decode the model runs the per-(token, expert) GEMV form with the shared expert fused "
              "(moe._experts(form='gemv', shared=...)); the replay certifies the registered moe.experts "
              "(its own form) on the routed inputs, not that fused launch"),
    Site("swiglu", "moe.swiglu", _pick("x", "w_gate", "w_up", "w_down")),
)}

UNCAPTURED = (
    "the projections (torch GEMMs: KDA/MLA in/out projections, f_b/g_b, the prefill router logits "
    "x.float() @ W_r.T)",
    "elementwise silu/sigmoid/softplus, kda.gate, the beta sigmoid and the q/k l2norm (fused inside "
    "the kernels above)",
    "in a continued prefill, the MLA cache gather (data movement)",
)


def scalar_defaults(record) -> dict:
    """Scalar keyword parameters the op takes without the model passing them, with the defaults the
    optimized op applies (only those the reference takes too: ``chunk_size``, ``scale``); recorded
    so that a replay never depends on the two sides agreeing on a default."""
    arrays = set(record.args) | set(record.kwarg_arrays)
    ref = inspect.signature(record.reference).parameters
    out = {}
    for name, p in inspect.signature(record.optimized_callable()).parameters.items():
        if p.kind is not p.KEYWORD_ONLY or name in arrays or name.startswith("_") or name not in ref:
            continue
        if p.default is not p.empty:
            out[name] = p.default
    return out


def aux(op: str, arrays: dict) -> dict:
    """Arrays a mutant needs that the op does not take: for MLA, the raw latent projection that
    ``latent_not_normed`` substitutes. The model never hands the raw projection to the attention op
    (and the cache keeps only normed latents), so a replay takes ``3 x latent``: a raw projection of
    rms ~3, as the drawn cases have (``parity.ops.mla``)."""
    if op in ("mla.naive", "mla.paged_decode"):
        return {"latent_raw": 3.0 * arrays["latent"]}
    return {}
