"""Named semantic bugs of the MLA attention ops, per op: the wrap mutants' transformations of the
real candidate's inputs, keyword arguments and outputs, and the internal ones evaluated by the
emulation (parity/mutants.py)."""
from __future__ import annotations

import torch

from parity.mutants import internal, wrap
from parity.ops._util import poison
from parity.registry import Mutant

from . import emulate


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

_ATTENTION = (
    WRONG_SCALE,
    wrap("latent_not_normed", "the raw latent projection used without kv_a_layernorm", inputs=_raw_latent,
         aux=True),
    wrap("k_pe_dropped", "the shared rope key slice left out of the scores", inputs=_no_kpe),
)


def _contiguous(fn):
    """The contiguous forms' internal mutants, evaluated by ``fn`` (naive or absorbed)."""
    return (
        internal("causal_off_by_one", "each query also attends to the next position", fn),
        internal("values_from_keys", "W_UV taken from the W_UK rows of w_kvb", fn),
    )


NAIVE = _ATTENTION + _contiguous(emulate.naive)
ABSORBED = _ATTENTION + _contiguous(emulate.absorbed)

PAGED_DECODE = (
    WRONG_SCALE,
    wrap("stale_last_token", "decode does not see the token just written (length - 1)", inputs=_stale),
    wrap("latent_not_normed", "raw latent cached", inputs=_raw_latent, aux=True),
    wrap("block_table_off_by_one", "each position read from the next block of the table", kwargs=_shift_blocks),
    Mutant("tail_blanked_by_zero", "the unused tail of the last block blanked by multiplying by zero "
           "instead of masking (NaN once the cache memory holds NaN or Inf)", "wrap", _TailTimesZero(),
           dirty=True),
)
