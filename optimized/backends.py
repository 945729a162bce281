"""The per-op-family backend switch of the optimized model (localization: ``--backend kda=reference``).

``Ops(backends)`` is every op call the model makes, grouped by family; each family runs either its
Triton kernels (``"triton"``, the default) or the float64 reference math of ``reference/<family>.py``
(``"reference"``). The reference side converts its tensor inputs to float64 NumPy on the host,
calls the reference op, and converts the result back to the model's dtype on the model's device
(states to their float32/float64 state dtype), so the rest of the model is untouched: swapping one
family and comparing with the all-Triton run isolates that family's contribution.

Families (the model's op calls in brackets):

- ``embed``: ``embedding``, ``lm_head``;
- ``norm``: ``rms_norm`` (first input norm, ``kv_a_layernorm``), ``add_rms_norm`` (each residual add
  with the norm after it, the final norm included), ``gated_rms_norm`` (o_norm);
- ``conv``: ``short_conv`` (prefill), ``short_conv_step_`` (decode, state pool by slot);
- ``kda``: ``fused_chunked`` (prefill), ``fused_recurrent_decode`` (decode, state pool by slot);
- ``mla``: ``naive`` (prefill over the sequence), ``paged_decode`` (decode over the paged cache);
- ``moe``: ``router_logits`` (decode), ``router``, ``experts``, ``swiglu`` (routed experts, shared
  expert and dense MLP).

Plain GEMMs (the projections) are torch in both cases. ``elementwise`` is a family of ops too, but the
model never calls one on its own (silu, sigmoid and softplus run fused inside the kernels of the
families above), so asking to swap it is an error rather than a silent no-op.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch

from . import _counters, conv, embed, kda, mla, moe, norm

FAMILIES = ("embed", "norm", "conv", "kda", "mla", "moe")
CHOICES = ("triton", "reference")


def resolve(backends) -> dict[str, str]:
    """``{family: "triton" | "reference"}`` for every family, from the user's partial mapping
    (``None`` = all Triton). ``ValueError`` names an unknown family or value."""
    out = {f: "triton" for f in FAMILIES}
    if backends is None:
        return out
    if not isinstance(backends, dict):
        raise ValueError(f"backends: expected a dict {{family: 'triton' | 'reference'}}, got "
                         f"{type(backends).__name__}")
    for family, value in backends.items():
        if family == "elementwise":
            if value == "triton":
                continue
            raise ValueError("backends: 'elementwise' cannot be swapped on its own: the model calls no "
                             "standalone elementwise op (silu/sigmoid/softplus are fused into the "
                             f"kernels of {', '.join(FAMILIES)}); swap one of those families instead")
        if family not in FAMILIES:
            raise ValueError(f"backends: unknown op family {family!r}; known: {', '.join(FAMILIES)}")
        if value not in CHOICES:
            raise ValueError(f"backends[{family!r}]: unknown backend {value!r}; expected one of "
                             f"{', '.join(CHOICES)}")
        out[family] = value
    return out


# -- the reference boundary ------------------------------------------------------------------------

def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()


def _np_or_none(t):
    return None if t is None else _np(t)


def _back(a, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(
        device=like.device, dtype=like.dtype if dtype is None else dtype)


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    """KDA state dtype of a run in x's dtype: float32, float64 for float64 runs (as the kernels)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _LazyRows:
    """``w[e]`` -> expert ``e``'s matrix as float64 NumPy, converted on demand (the reference
    ``moe.experts`` indexes the stacked weights by id; converting all of them would be 12x their
    bf16 size)."""

    def __init__(self, stacked: torch.Tensor):
        self.stacked = stacked

    def __len__(self) -> int:
        return self.stacked.shape[0]

    def __getitem__(self, e):
        return _np(self.stacked[int(e)])


class Ops:
    """The model's op calls, each family on its chosen backend (see the module docstring)."""

    def __init__(self, choice: dict[str, str]):
        self.choice = dict(choice)
        self._opt = {"conv": conv, "embed": embed, "kda": kda, "mla": mla, "moe": moe, "norm": norm}
        self._ref = {}
        for family, value in self.choice.items():
            if value == "reference":
                self._ref[family] = importlib.import_module(f"reference.{family}")

    def _is_ref(self, family: str) -> bool:
        return self.choice[family] == "reference"

    def _r(self, family: str, op: str):
        """The reference op, counted as ``reference.<family>.<op>`` in ``optimized._counters`` (so a
        report shows the swap happened; the Triton op's own counter stays untouched)."""
        _counters.record(f"reference.{family}.{op}")
        return getattr(self._ref[family], op)

    # -- embed ----------------------------------------------------------------------------------
    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        if self._is_ref("embed"):
            ids_np = ids.detach().cpu().numpy()
            uniq, inverse = np.unique(ids_np, return_inverse=True)  # convert only the rows used
            rows = _np(table[torch.as_tensor(uniq, device=table.device)])
            return _back(self._r("embed", "embedding")(inverse.reshape(-1), rows), table)
        return self._opt["embed"].embedding(ids, table)

    def lm_head(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._is_ref("embed"):
            return _back(self._r("embed", "lm_head")(_np(h), _np(weight)), h)
        return self._opt["embed"].lm_head(h, weight)

    # -- norm -----------------------------------------------------------------------------------
    def rms_norm(self, x, weight, *, eps):
        if self._is_ref("norm"):
            return _back(self._r("norm", "rms_norm")(_np(x), _np(weight), eps=eps), x)
        return self._opt["norm"].rms_norm(x, weight, eps=eps)

    def add_rms_norm(self, x, residual, weight, *, eps):
        """``(rms_norm(x + residual), x + residual)``; the add in x's dtype on either backend."""
        if self._is_ref("norm"):
            h = x + residual
            return self.rms_norm(h, weight, eps=eps), h
        return self._opt["norm"].add_rms_norm(x, residual, weight, eps=eps)

    def gated_rms_norm(self, x, gate, weight, *, eps):
        if self._is_ref("norm"):
            return _back(self._r("norm", "gated_rms_norm")(_np(x), _np(gate), _np(weight), eps=eps), x)
        return self._opt["norm"].gated_rms_norm(x, gate, weight, eps=eps)

    # -- conv -----------------------------------------------------------------------------------
    def short_conv(self, x, weight, *, initial_state=None, state_dtype=None):
        """x [B,T,C] -> (y [B,T,C], final_state [B,C,W-1] in ``state_dtype`` or x's dtype)."""
        if self._is_ref("conv"):
            s0 = None if initial_state is None else _np(initial_state)
            y, st = self._r("conv", "short_conv")(_np(x), _np(weight), initial_state=s0)
            return _back(y, x), _back(st, x, state_dtype)
        return self._opt["conv"].short_conv(x, weight, initial_state=initial_state)

    def short_conv_step_(self, x, weight, state_pool, slot_ids):
        """x [B,C], pool [slots,C,W-1] updated in place at ``slot_ids``; returns y [B,C]."""
        if self._is_ref("conv"):
            y = torch.zeros_like(x)
            real = slot_ids >= 0  # negative slot id: a padding row (output 0, no state touched)
            if bool(real.any()):
                slots = slot_ids[real]
                out, new = self._r("conv", "short_conv_step")(_np(x[real]), _np(weight), _np(state_pool[slots]))
                state_pool[slots] = _back(new, state_pool)
                y[real] = _back(out, x)
            return y
        return self._opt["conv"].short_conv_step_(x, weight, state_pool, slot_ids)

    # -- kda ------------------------------------------------------------------------------------
    def kda_prefill(self, q, k, v, g_raw, beta_logits, A_log, dt_bias, *, initial_state=None, lower_bound=None):
        """Chunked KDA with gate, beta sigmoid and q/k l2norm fused: -> (o, final_state).
        ``lower_bound``: the bounded gate's b (None: the softplus gate; A_log may be None with it)."""
        gate = {} if lower_bound is None else {"lower_bound": lower_bound}
        if self._is_ref("kda"):
            s0 = None if initial_state is None else _np(initial_state)
            o, st = self._r("kda", "fused_chunked")(_np(q), _np(k), _np(v), _np(g_raw), _np(beta_logits),
                                                   _np_or_none(A_log), _np(dt_bias), initial_state=s0, **gate)
            return _back(o, q), _back(st, q, _state_dtype(q))
        return self._opt["kda"].fused_chunked(q, k, v, g_raw, beta_logits, A_log, dt_bias,
                                              initial_state=initial_state, **gate)

    def kda_decode_(self, q, k, v, g_raw, beta_logits, A_log, dt_bias, state_pool, slot_ids, *, out=None,
                    lower_bound=None):
        """One recurrent step for B sequences (q, k [B,H,K], v [B,HV,V], g_raw [B,HV,K],
        beta_logits [B,HV]); states in ``state_pool`` at ``slot_ids`` updated in place; -> o [B,HV,V]
        (written into ``out`` when given). ``lower_bound`` as :meth:`kda_prefill`'s."""
        gate = {} if lower_bound is None else {"lower_bound": lower_bound}
        if self._is_ref("kda"):
            o = torch.zeros(v.shape, dtype=q.dtype, device=q.device) if out is None else out.zero_()
            real = slot_ids >= 0  # negative slot id: a padding row (output 0, no state touched)
            if bool(real.any()):
                slots = slot_ids[real]
                res, st = self._r("kda", "fused_recurrent")(
                    _np(q[real])[:, None], _np(k[real])[:, None], _np(v[real])[:, None],
                    _np(g_raw[real])[:, None], _np(beta_logits[real])[:, None], _np_or_none(A_log),
                    _np(dt_bias), initial_state=_np(state_pool[slots]), **gate)
                state_pool[slots] = _back(st, state_pool)
                o[real] = _back(res[:, 0], q)
            return o
        return self._opt["kda"].fused_recurrent_decode(q, k, v, g_raw, beta_logits, A_log, dt_bias,
                                                       state_pool, slot_ids, out=out, **gate)

    # -- mla ------------------------------------------------------------------------------------
    def mla_prefill(self, q, latent, k_pe, w_kvb):
        """q [1,T,N,P+R], latent [1,S,L], k_pe [1,S,R] (queries are the last T positions)."""
        if self._is_ref("mla"):
            return _back(self._r("mla", "naive")(_np(q), _np(latent), _np(k_pe), _np(w_kvb)), q)
        return self._opt["mla"].naive(q, latent, k_pe, w_kvb)

    def mla_write(self, cache, latent, k_pe, slot_mapping):
        """Store ``latent [n, L]``, ``k_pe [n, R]`` in the paged ``cache`` at ``slot_mapping [n]``
        (negative: padding, not written). Reference backend: a plain torch scatter (data movement)."""
        if self._is_ref("mla"):
            real = slot_mapping >= 0
            kv = cache.kv.view(-1, cache.L + cache.R)
            kv[slot_mapping[real]] = torch.cat([latent, k_pe], dim=-1)[real].to(kv.dtype)
            return
        cache.write(latent, k_pe, slot_mapping)

    def mla_decode(self, q, w_kvb, cache, batch, *, out=None):
        """q [B,N,P+R], one new token per row, over the paged ``cache`` described by ``batch``
        (``optimized.cache.DecodeBatch``: block tables, lengths including this token, slot mapping
        (negative = padding row)); -> o [B,N,Vh] (written into ``out`` when given). The key slices
        are ``mla.paged_decode``'s default: from each sequence's own length, never from B."""
        if self._is_ref("mla"):
            shape = q.shape[:2] + (w_kvb.shape[0] // q.shape[1] - (q.shape[2] - cache.R),)
            o = torch.zeros(shape, dtype=q.dtype, device=q.device) if out is None else out.zero_()
            real = (batch.slot_mapping >= 0).tolist()
            for b, is_real in enumerate(real):
                if not is_real:
                    continue
                latent, k_pe = cache.gather(batch.block_tables[b], int(batch.seq_lens[b]))
                res = self._r("mla", "absorbed")(_np(q[b])[None, None], _np(latent)[None],
                                                 _np(k_pe)[None], _np(w_kvb))
                o[b] = _back(res[0, 0], q)
            return o
        return self._opt["mla"].paged_decode(q, cache, batch.block_tables, batch.seq_lens, w_kvb,
                                             out=out)

    # -- moe ------------------------------------------------------------------------------------
    def router_logits(self, x, weight):
        """-> logits [T, E] in weight's dtype (float32, float64 for float64 runs)."""
        if self._is_ref("moe"):
            return _back(self._r("moe", "router_logits")(_np(x), _np(weight)), x, weight.dtype)
        return self._opt["moe"].router_logits(x, weight)

    def router(self, logits, bias, **kw):
        """-> (weights [T,k_e] float, ids [T,k_e] int64)."""
        if self._is_ref("moe"):
            w, ids = self._r("moe", "router")(_np(logits), _np(bias), **kw)
            return _back(w, logits), torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(logits.device)
        return self._opt["moe"].router(logits, bias, **kw)

    def experts(self, x, weights, ids, w1, w2, w3, *, decode: bool = False, add_to=None, shared=None,
                out=None):
        """Routed experts. ``decode``: the grouped form with its fixed decode tiles whatever the
        number of rows (``optimized.moe`` picks GEMV or grouped by the pair count, and the two
        forms round differently: a sequence's decode must not depend on its batch; the grouped
        form's rows do not, and it reads each routed expert once per step). Decode only:
        ``add_to`` (``add_to += experts(...)`` in place; the Triton form adds inside its combine
        kernel); ``shared`` ((gate, up, down)): the shared expert's SwiGLU added, in the Triton form
        inside the same launches, into ``out`` ([T, D]) when given."""
        if (add_to is not None or shared is not None or out is not None) and not decode:
            raise ValueError("experts: add_to, shared and out are decode-only options")
        if self._is_ref("moe"):
            y = _back(self._r("moe", "experts")(_np(x), _np(weights), ids.detach().cpu().numpy(),
                                                _LazyRows(w1), _LazyRows(w2), _LazyRows(w3)), x)
            if shared is not None:
                y = y + self.swiglu(x, *shared)
                if out is None:
                    return y
                out.copy_(y)
                return out
            if add_to is None:
                return y
            add_to += y
            return add_to
        moe = self._opt["moe"]
        if decode:
            # no public switch for the form yet: the module's own entry point with the form forced
            _counters.record("moe.experts")
            return moe._experts("moe.experts", x, weights, ids, w1, w2, w3, form="grouped", add_to=add_to,
                                shared=shared, out=out, launch=moe.GROUPED_DECODE)
        return moe.experts(x, weights, ids, w1, w2, w3)

    def swiglu(self, x, w_gate, w_up, w_down):
        if self._is_ref("moe"):
            return _back(self._r("moe", "swiglu")(_np(x), _np(w_gate), _np(w_up), _np(w_down)), x)
        return self._opt["moe"].swiglu(x, w_gate, w_up, w_down)

