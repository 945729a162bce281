"""What the float64 model carries from one call to the next: per-layer caches, immutable.

``ModelCache.layers`` holds a ``KDACache`` (conv states and the recurrent state) or an
``MLACache`` (normed latents and un-rotated key-pe) per layer, in layer order; ``length`` counts
the tokens seen. NumPy cache arrays are private read-only float64 copies, so ``decode`` never
changes the cache it was given.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from kimi.config import KimiConfig


def _frozen(a):
    """A cache array: a private read-only float64 copy for NumPy input; another executor's array as
    it is (no reference op writes an array, so nobody changes it)."""
    if isinstance(a, (np.ndarray, list, tuple, numbers.Number)):
        a = np.array(a, dtype=np.float64)
        a.setflags(write=False)
    return a


@dataclass(frozen=True)
class KDACache:
    """State of one KDA layer: conv states ``[C, W-1]`` (the last W-1 pre-conv q/k/v projections,
    oldest first) and the recurrent state ``[H, K, V]`` (K-first)."""
    conv_q: np.ndarray
    conv_k: np.ndarray
    conv_v: np.ndarray
    state: np.ndarray

    def __post_init__(self):
        for f in ("conv_q", "conv_k", "conv_v", "state"):
            object.__setattr__(self, f, _frozen(getattr(self, f)))


@dataclass(frozen=True)
class MLACache:
    """State of one MLA layer: the normed latents ``[S, L]`` and un-rotated key-pe ``[S, R]``."""
    latent: np.ndarray
    k_pe: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "latent", _frozen(self.latent))
        object.__setattr__(self, "k_pe", _frozen(self.k_pe))


@dataclass(frozen=True)
class ModelCache:
    """Per-layer caches (``KDACache`` or ``MLACache`` in layer order) and the number of tokens seen."""
    layers: tuple
    length: int

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))


def empty_cache(c: KimiConfig, xp, device) -> ModelCache:
    """The cache of an empty sequence (zero conv/KDA states, empty MLA caches) in namespace ``xp``
    on ``device``: decoding from it token by token equals a prefill."""
    zeros = lambda *shape: xp.zeros(shape, dtype=xp.float64, device=device)  # noqa: E731
    layers = []
    for i in range(c.num_hidden_layers):
        if c.is_kda_layer(i):
            C, Wm1 = c.kda_dim, c.short_conv_kernel_size - 1
            layers.append(KDACache(zeros(C, Wm1), zeros(C, Wm1), zeros(C, Wm1),
                                   zeros(c.kda_num_heads, c.kda_head_dim, c.kda_head_dim)))
        else:
            layers.append(MLACache(zeros(0, c.kv_lora_rank), zeros(0, c.qk_rope_head_dim)))
    return ModelCache(layers, 0)


def cache_bytes(c: KimiConfig, tokens: int) -> int:
    """Bytes of the float64 ``ModelCache`` of a sequence of ``tokens`` positions: per KDA layer the
    three conv states ``C (W-1)`` and the state ``H K V``, per MLA layer ``tokens (L+R)``."""
    C, Wm1, H, K = c.kda_dim, c.short_conv_kernel_size - 1, c.kda_num_heads, c.kda_head_dim
    kda = 3 * C * Wm1 + H * K * K
    mla = tokens * (c.kv_lora_rank + c.qk_rope_head_dim)
    return 8 * sum(kda if c.is_kda_layer(i) else mla for i in range(c.num_hidden_layers))


def check_cache(cache, c: KimiConfig) -> None:
    """``ValueError`` naming the layer unless ``cache`` is a ``ModelCache`` of the shapes of ``c``."""
    if not isinstance(cache, ModelCache):
        raise ValueError(f"cache: expected a reference ModelCache, got {type(cache).__name__}")
    if len(cache.layers) != c.num_hidden_layers:
        raise ValueError(f"cache: {len(cache.layers)} layers, the model has {c.num_hidden_layers}")
    for i, lc in enumerate(cache.layers):
        if c.is_kda_layer(i):
            C, Wm1, H, K = c.kda_dim, c.short_conv_kernel_size - 1, c.kda_num_heads, c.kda_head_dim
            ok = (isinstance(lc, KDACache) and _shape(lc.conv_q) == _shape(lc.conv_k) == _shape(lc.conv_v)
                  == (C, Wm1) and _shape(lc.state) == (H, K, K))
            want = f"KDACache with conv states {(C, Wm1)} and state {(H, K, K)}"
        else:
            S, L, R = cache.length, c.kv_lora_rank, c.qk_rope_head_dim
            ok = isinstance(lc, MLACache) and _shape(lc.latent) == (S, L) and _shape(lc.k_pe) == (S, R)
            want = f"MLACache with latent {(S, L)} and k_pe {(S, R)} (length {S})"
        if not ok:
            raise ValueError(f"cache.layers[{i}]: expected a {want}, got {_describe(lc)}")


def _shape(a) -> tuple:
    return tuple(a.shape)


def _describe(lc) -> str:
    if isinstance(lc, KDACache):
        return f"KDACache(conv {_shape(lc.conv_q)}, state {_shape(lc.state)})"
    if isinstance(lc, MLACache):
        return f"MLACache(latent {_shape(lc.latent)}, k_pe {_shape(lc.k_pe)})"
    return type(lc).__name__
