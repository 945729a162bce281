"""Checks of the model-level arguments the models take (``reference.load`` / ``optimized.load``
and their ``forward / prefill / decode``): the semantic variants, token ids and (the reference's)
replayed routing. One-line ``ValueError``s that name the argument; optimized/ imports these
(reference/ imports neither)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from kimi.config import kda_gate_name

from .executor import to_numpy

MOE_COMBINES = ("unbiased", "biased")
OWN = -1  # a replayed routing's row of OWN: that token keeps the router's own choice
LOWER_BOUND_RANGE = (-5.0, 0.0)  # [lo, hi): the bounded gate's b, as its kernels take it


def check_lower_bound(lower_bound):
    """The KDA gate's ``lower_bound`` as a float (None: the softplus gate); ``ValueError`` outside
    [-5, 0), the range the bounded gate's kernels (FlashKDA, fla's safe gate) take."""
    if lower_bound is None:
        return None
    lo, hi = LOWER_BOUND_RANGE
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float, np.floating, np.integer)) \
            or not lo <= float(lower_bound) < hi:
        raise ValueError(f"lower_bound: expected a number in [{lo:g}, {hi:g}) (None: the softplus gate), "
                         f"got {lower_bound!r}")
    return float(lower_bound)


def kda_gate_bound(kda_gate: str):
    """The ``kda_gate`` variant's b: ``"softplus"`` -> None, ``"lower_bound:<b>"`` -> b (in [-5, 0));
    ``ValueError`` naming the variant for anything else."""
    if kda_gate == "softplus":
        return None
    kind, sep, value = kda_gate.partition(":") if isinstance(kda_gate, str) else ("", "", "")
    try:
        if kind != "lower_bound" or not sep:
            raise ValueError
        return check_lower_bound(float(value))
    except ValueError:
        lo, hi = LOWER_BOUND_RANGE
        raise ValueError(f"kda_gate: expected softplus or lower_bound:<b> with b in [{lo:g}, {hi:g}), "
                         f"got {kda_gate!r}") from None


def check_variants(*, moe_combine, kv_norm_eps, kda_gate=None) -> None:
    """``ValueError`` for an unknown ``moe_combine``, a non-positive / non-finite ``kv_norm_eps`` or a
    ``kda_gate`` other than None (the checkpoint's), ``softplus`` or ``lower_bound:<b>``."""
    if moe_combine not in MOE_COMBINES:
        raise ValueError(f"moe_combine: expected one of {MOE_COMBINES}, got {moe_combine!r}")
    if (not isinstance(kv_norm_eps, numbers.Real) or isinstance(kv_norm_eps, bool)
            or not math.isfinite(kv_norm_eps) or kv_norm_eps <= 0):
        raise ValueError(f"kv_norm_eps: expected a positive finite number, got {kv_norm_eps!r}")
    if kda_gate is not None:
        kda_gate_bound(kda_gate)


def resolve_kda_gate(kda_gate, config) -> str:
    """The ``kda_gate`` a model runs: the variant given, else the checkpoint config's; a gate without
    A_log (``config.kda_A_log`` False) cannot run as the softplus gate (``ValueError``)."""
    name = config.kda_gate if kda_gate is None else kda_gate_name(kda_gate_bound(kda_gate))
    if name == "softplus" and not config.kda_A_log:
        raise ValueError("kda_gate: softplus needs A_log, which this checkpoint's KDA layers do not have "
                         "(it is a bounded-gate checkpoint without A_log)")
    return name


def check_token_ids(ids, vocab_size: int, what: str = "token_ids") -> np.ndarray:
    """``ids`` (a sequence or array) as a non-empty 1-D int64 array of ids in ``[0, vocab_size)``."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected integer token ids, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise ValueError(f"{what}: token id {int(arr[pos])} at position {pos} is outside the "
                         f"vocabulary [0, {vocab_size})")
    return arr.astype(np.int64)


def check_token_id(token_id, vocab_size: int) -> int:
    """One integer token id (a Python or NumPy integer, or a one-element array) in ``[0, vocab_size)``."""
    if isinstance(token_id, np.ndarray) and token_id.size == 1 and token_id.ndim <= 1:
        token_id = token_id.reshape(()).item()
    if np.ndim(token_id) != 0 or not isinstance(token_id, (numbers.Integral, np.integer)) \
            or isinstance(token_id, bool):
        got = f"shape {np.shape(token_id)}" if np.ndim(token_id) else repr(token_id)
        raise ValueError(f"token_id: expected one integer token id, got {got}")
    token_id = int(token_id)
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token_id: token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id


def check_routing(routing, T: int, config) -> dict:
    """``routing`` ``{layer: ids [T, k_e]}`` (expert choices to replay) checked against ``config``
    (a ``KimiConfig``): MoE layer indices, integer ids in ``[0, E)``, no expert twice in a row; a
    row of ``-1`` (``OWN``) leaves that token to the router's own choice. Returns ``{layer: int
    ids}`` (NumPy); None is ``{}``."""
    c = config
    if routing is None:
        return {}
    if not isinstance(routing, dict):
        raise ValueError(f"routing: expected a dict {{layer: ids [T, k_e]}}, got {type(routing).__name__}")
    checked = {}
    for layer, ids in routing.items():
        if not (isinstance(layer, numbers.Integral) and 0 <= layer < c.num_hidden_layers
                and c.is_moe_layer(int(layer))):
            raise ValueError(f"routing: {layer!r} is not a MoE layer index")
        ids = to_numpy(ids) if hasattr(ids, "shape") else np.asarray(ids)
        want = (T, c.num_experts_per_token)
        if ids.shape != want or ids.dtype.kind not in "iu":
            raise ValueError(f"routing[{layer}]: expected integer ids of shape {want}, got {ids.dtype} {ids.shape}")
        own = np.all(ids == OWN, axis=-1)
        given = ids[~own]
        if given.size and (given.min() < 0 or given.max() >= c.num_experts):
            raise ValueError(f"routing[{layer}]: expert ids must be in [0, {c.num_experts}) (or a whole row "
                             f"of {OWN}: the router's own choice), got {given.min()}..{given.max()}")
        if any(len(set(row)) != len(row) for row in given.tolist()):
            raise ValueError(f"routing[{layer}]: a token names the same expert twice")
        checked[int(layer)] = ids
    return checked
