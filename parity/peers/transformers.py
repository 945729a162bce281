"""transformers' KimiLinear KDA functions fitted to the registered signatures, both ways: its torch
``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention`` (``transformers/models/
kimi_linear/modeling_kimi_linear.py``, 5.17 to 5.25). Nothing here is transformers' code; these
functions call it, and transformers is imported only when one runs.

What the functions compute: ``query, key [B, T, H, K]``, ``value [B, T, H, V]``, a log-space ``g
[B, T, H, K]`` and ``beta [B, T, H]`` as given, in float32 (every input cast first), with ``scale =
K^-0.5`` fixed and the q/k l2norm (``x / sqrt(sum x^2 + 1e-6)``, the kernels' form) applied first
when ``use_qk_l2norm_in_kernel=True``. The model calls both with ``use_qk_l2norm_in_kernel=True``,
its gate ``g = -exp(A_log) softplus(...)`` and ``beta = sigmoid(b_proj(x))`` computed outside: such
a call is ``kda.chunked+qk_l2norm`` (``kda.recurrent+qk_l2norm``): the l2norm is inside the judged
op and its bound counts the l2norm's error as the fused ops' bounds do
(parity.ops.kda.bounds.qk_l2norm).
The output comes back in the input dtype, the final state in float32. Contract: ``ieee`` (torch's
CPU float32 matmuls and sums; on CUDA without TF32).

With fla-core importable, transformers hands these names to fla's ``chunk_kda`` /
``fused_recurrent_kda`` when the model module loads (``use_kernel_func_from_hub_with_fallback``);
the torch functions stay as ``__wrapped__``. The forward adapters call those. Where the ``kernels``
package is installed (transformers 5.25 and later), each such name holds a ``kernels`` function
module instead, whose ``forward`` calls the same dispatching function: :func:`dispatcher` finds it
and :func:`torch_function` the torch function behind it, in every supported release.
"""
from __future__ import annotations

import importlib
import inspect

from ..certify.candidate import adapter
from ..errors import Unsupported
from ..record.watch.adapters import Mapping, Mismatch, flag, returned

MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
CHUNK = f"{MODULE}:chunk_kimi_delta_attention"
RECURRENT = f"{MODULE}:recurrent_kimi_delta_attention"


def dispatcher(fn):
    """The function behind one of the modeling module's kernel names: ``fn`` itself, or, for a
    ``kernels`` function module (an object whose class's ``forward`` closes over the function it
    calls when no hub kernel replaces it), that function."""
    if inspect.isfunction(fn):
        return fn
    forward = getattr(type(fn), "forward", None)
    inner = inspect.getclosurevars(forward).nonlocals.get("func") if inspect.isfunction(forward) else None
    return inner if callable(inner) else fn


def chosen(fn) -> tuple:
    """``(torch function, implementation that runs)`` behind one of the modeling module's kernel
    names: the implementation is the outside kernel transformers chose when the module loaded
    (the wrapper's ``implementation``), or the torch function itself."""
    d = dispatcher(fn)
    own = getattr(d, "__wrapped__", d)
    impl = inspect.getclosurevars(d).nonlocals.get("implementation", own) if own is not d else d
    return own, impl


def torch_function(name: str):
    """transformers' own torch function for the modeling module's kernel name ``name``."""
    return chosen(getattr(importlib.import_module(MODULE), name))[0]


def _mapping(a: dict, core: str, **scalars):
    l2 = flag(a, "use_qk_l2norm_in_kernel")
    q, v = a["query"], a["value"]
    if q.shape[2] != v.shape[2]:
        raise Mismatch("value", f"{v.shape[2]} heads for {q.shape[2]} query heads: this function takes no grouped values")
    inputs = {"q": q, "k": a["key"], "v": v, "g": a["g"], "beta": a["beta"],
              "initial_state": a.get("initial_state"), "cu_seqlens": None}
    names = ("o", "final_state") if a.get("output_final_state") else ("o",)
    return Mapping(core + ("+qk_l2norm" if l2 else ""), inputs, {"scale": None, **scalars}, returned(*names),
                   "ieee", "q/k l2norm in the call, g and beta given" if l2 else "")


def chunk_reverse(a: dict):
    """A call of ``chunk_kimi_delta_attention``: kda.chunked, or kda.chunked+qk_l2norm."""
    return _mapping(a, "kda.chunked", chunk_size=int(a.get("chunk_size", 64)))


def recurrent_reverse(a: dict):
    """A call of ``recurrent_kimi_delta_attention``: kda.recurrent, or kda.recurrent+qk_l2norm."""
    return _mapping(a, "kda.recurrent")


def _fixed(q, scale, cu_seqlens, v):
    if cu_seqlens is not None:
        raise Unsupported("transformers' torch KDA: variable-length batches")
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12 * scale:
        raise Unsupported("transformers' torch KDA: scale is K^-0.5, fixed")
    if v.shape[2] != q.shape[2]:
        raise Unsupported("transformers' torch KDA: grouped value heads")


@adapter(contract="ieee", wraps=CHUNK, reverse=chunk_reverse)
def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    """kda.chunked's signature around transformers' torch chunked KDA (l2norm off)."""
    _fixed(q, scale, cu_seqlens, v)
    return torch_function("chunk_kimi_delta_attention")(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=False)


@adapter(contract="ieee", wraps=RECURRENT, reverse=recurrent_reverse)
def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """kda.recurrent's signature around transformers' torch recurrent KDA (l2norm off)."""
    _fixed(q, scale, cu_seqlens, v)
    return torch_function("recurrent_kimi_delta_attention")(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=False)

