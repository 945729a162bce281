"""A bound of a whole model's logits (docs/error-bounds.md, "Model logits"): what the model tests
hold an optimized model's logits to against the float64 reference model.

Every op on the deepest path through the stack (:func:`path_ops`) rounds its output once to the
model dtype (unit roundoff ``u``) and accumulates ``n`` terms in its arithmetic dtype (``ua``, fp32
for bf16 and fp32 runs); with independent rounding errors (Higham & Mary, 2019) the residual
stream's relative error is at most ``LAMBDA sqrt(sum_ops (u^2 + n ua^2))``. The lm_head adds its own
rounding; a logit's error is that relative error times its magnitude ``sum_k |h_k| |W_jk|``
(reference final-norm output and lm_head weight). Layer gains are taken as 1: the norms
re-normalize, attention and the MoE combine are convex combinations, the delta rule is
contractive, and errors entering the residual stream are measured against magnitudes that already
hold them. Measured on the tiny preset: the worst logit sits at ~0.05 of this bound at fp32 and
~0.2 at bf16 (tests/optimized/test_model_parity.py); a row from the wrong position misses it by ~5x.
A router top-k flip is a discontinuity no smooth bound covers: the tests first show each flip is a
near-tie (parity.diff.router), then replay the optimized run's expert choices in the reference.
"""
from __future__ import annotations

import math

import numpy as np

from .core import LAMBDA, arithmetic_dtype, unit_roundoff


def path_ops(config, S: int) -> list[tuple[str, int]]:
    """(op, reduction length) of every op on the deepest path through the stack, for a token at
    position S-1 (KDA state and attention accumulate over S positions; KDA chunks of 64)."""
    c = config
    D, K, W = c.hidden_size, c.kda_head_dim, c.short_conv_kernel_size
    ops = [("embedding", 1)]
    for i in range(c.num_hidden_layers):
        ops.append(("input_norm", D))
        if c.is_kda_layer(i):
            ops += [("qkv_proj", D), ("gate_down", D), ("gate_up", K), ("conv", W), ("l2norm", K),
                    ("kda_state", S + K), ("kda_chunk", min(S, 64) + K), ("o_norm", K),
                    ("o_proj", c.kda_num_heads * K)]
        else:
            L, R, P = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim
            ops += [("q_kv_proj", D), ("kv_norm", L), ("q_absorb", P), ("scores", L + R),
                    ("softmax", S), ("pv", S), ("uv", L), ("o_proj", c.num_attention_heads * c.v_head_dim)]
        ops += [("residual", 1), ("post_norm", D)]
        if c.is_moe_layer(i):
            F = c.moe_intermediate_size
            ops += [("router", D), ("expert_up", D), ("expert_down", F),
                    ("combine", c.num_experts_per_token), ("shared_up", D), ("shared_down", F), ("add", 1)]
        else:
            ops += [("mlp_up", D), ("mlp_down", c.intermediate_size)]
        ops.append(("residual", 1))
    ops.append(("final_norm", D))
    return ops


def _units(dtype: str) -> tuple[float, float]:
    return unit_roundoff(dtype), unit_roundoff(arithmetic_dtype(dtype))


def hidden_rel_bound(config, S: int, dtype: str) -> float:
    """Relative error of the final hidden state of a token at position S-1 (module docstring)."""
    u, ua = _units(dtype)
    return LAMBDA * math.sqrt(sum(u ** 2 + n * ua ** 2 for _, n in path_ops(config, S)))


def logit_rel_bound(config, S: int, dtype: str) -> float:
    """A logit's bound of a token at position S-1 in units of its magnitude ``sum_k |h_k| |W_jk|``:
    the final hidden state's relative bound plus the lm_head's own rounding."""
    u, ua = _units(dtype)
    return hidden_rel_bound(config, S, dtype) + LAMBDA * math.sqrt(u ** 2 + config.hidden_size * ua ** 2)


def logit_bound(config, S_of_rows, h_ref: np.ndarray, w_lm: np.ndarray, dtype: str) -> np.ndarray:
    """[T, vocab] bound of logits whose rows sit at positions ``S_of_rows - 1``; ``h_ref`` [T, D]
    the reference's final-norm output, ``w_lm`` [vocab, D] the lm_head weight."""
    mag = np.abs(h_ref) @ np.abs(w_lm).T
    rel = np.array([logit_rel_bound(config, int(S), dtype) for S in np.atleast_1d(S_of_rows)])
    return rel[:, None] * mag
