"""The checkpoint tensor table of spec §(c): names, shapes, and the storage dtype policy.

``expected_tensors(config)`` lists every tensor a hub-layout Kimi-Linear checkpoint holds, in model
order (embedding, layer 0, ..., layer n-1, final norm, lm_head), as ``{name: shape}``. Shapes are
the canonical ones of the HF module tree; the only alternative layout accepted on load is the 2-D
``[C, W]`` depthwise conv weight (``alternative_shapes``), which readers reshape to ``[C, 1, W]``;
the only alternative names are transformers 5.x's for the dense MLP (``transformers_aliases``).

``storage_dtype(name)`` is the policy for checkpoints this project writes (synthetic fixtures):
bfloat16 everywhere except the float32 parameters that vLLM/HF declare as fp32
(``A_log``, ``dt_bias``, ``e_score_correction_bias``).
"""
from __future__ import annotations

from .config import KimiConfig

Shape = tuple[int, ...]

FLOAT32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias")
CONV_SUFFIXES = (".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expert_name(i: int, e: int, which: str) -> str:
    """``model.layers.{i}.block_sparse_moe.experts.{e}.{which}.weight``, which in w1 (gate), w2
    (down), w3 (up)."""
    return f"model.layers.{i}.block_sparse_moe.experts.{e}.{which}.weight"


def layer_tensors(config: KimiConfig, i: int) -> dict[str, Shape]:
    """The tensors of 0-indexed layer ``i``: its two norms, its mixer, its FFN."""
    c = config
    D = c.hidden_size
    p = layer_prefix(i)
    out: dict[str, Shape] = {p + "input_layernorm.weight": (D,)}
    a = p + "self_attn."
    if c.is_kda_layer(i):
        H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        HK = H * K  # value heads == qk heads and V == K in Kimi-Linear
        out.update({
            a + "q_proj.weight": (HK, D),
            a + "k_proj.weight": (HK, D),
            a + "v_proj.weight": (HK, D),
            a + "q_conv1d.weight": (HK, 1, W),
            a + "k_conv1d.weight": (HK, 1, W),
            a + "v_conv1d.weight": (HK, 1, W),
            a + "f_a_proj.weight": (K, D),
            a + "f_b_proj.weight": (HK, K),
            a + "dt_bias": (HK,),
            **({a + "A_log": (1, 1, H, 1)} if c.kda_A_log else {}),   # none: the bounded gate without it
            a + "b_proj.weight": (H, D),
            a + "g_a_proj.weight": (K, D),
            a + "g_b_proj.weight": (HK, K),
            a + "o_norm.weight": (K,),
            a + "o_proj.weight": (D, HK),
        })
    else:
        N, P, R, Vh, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                          c.v_head_dim, c.kv_lora_rank)
        out.update({
            a + "q_proj.weight": (N * (P + R), D),
            a + "kv_a_proj_with_mqa.weight": (L + R, D),
            a + "kv_a_layernorm.weight": (L,),
            a + "kv_b_proj.weight": (N * (P + Vh), L),
            a + "o_proj.weight": (D, N * Vh),
        })
    out[p + "post_attention_layernorm.weight"] = (D,)
    if c.is_moe_layer(i):
        E, F = c.num_experts, c.moe_intermediate_size
        m = p + "block_sparse_moe."
        out[m + "gate.weight"] = (E, D)
        out[m + "gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            out[expert_name(i, e, "w1")] = (F, D)
            out[expert_name(i, e, "w2")] = (D, F)
            out[expert_name(i, e, "w3")] = (F, D)
        if c.num_shared_experts:
            Fs = F * c.num_shared_experts
            out[m + "shared_experts.gate_proj.weight"] = (Fs, D)
            out[m + "shared_experts.up_proj.weight"] = (Fs, D)
            out[m + "shared_experts.down_proj.weight"] = (D, Fs)
    else:
        F = c.intermediate_size
        out[p + "mlp.gate_proj.weight"] = (F, D)
        out[p + "mlp.up_proj.weight"] = (F, D)
        out[p + "mlp.down_proj.weight"] = (D, F)
    return out


def expected_tensors(config: KimiConfig) -> dict[str, Shape]:
    """Every tensor of a hub-layout checkpoint for ``config``: ``{name: shape}`` in model order
    (spec §(c); 20,493 tensors for kimi-linear-48b). ``lm_head.weight`` is absent when the
    embeddings are tied."""
    V, D = config.vocab_size, config.hidden_size
    out: dict[str, Shape] = {"model.embed_tokens.weight": (V, D)}
    for i in range(config.num_hidden_layers):
        out.update(layer_tensors(config, i))
    out["model.norm.weight"] = (D,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    return out


DENSE_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def transformers_aliases(config: KimiConfig) -> dict[str, str]:
    """transformers 5.x name -> hub name of tensors the two layouts name differently: its
    ``save_pretrained`` writes a dense layer's MLP as ``model.layers.N.block_sparse_moe.{gate,up,
    down}_proj.weight`` where the hub checkpoints have ``model.layers.N.mlp.*``."""
    out = {}
    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            for proj in DENSE_MLP_PROJECTIONS:
                out[f"{layer_prefix(i)}block_sparse_moe.{proj}.weight"] = f"{layer_prefix(i)}mlp.{proj}.weight"
    return out


def alternative_shapes(name: str, shape: Shape) -> tuple[Shape, ...]:
    """Other stored shapes accepted for ``name`` (canonical ``shape``): ``[C, W]`` for the
    depthwise conv weights ``[C, 1, W]`` (llama.cpp-style exports)."""
    if name.endswith(CONV_SUFFIXES) and len(shape) == 3 and shape[1] == 1:
        return ((shape[0], shape[2]),)
    return ()


def storage_dtype(name: str) -> str:
    """Storage dtype of ``name`` in the checkpoints this project writes: ``"float32"`` for
    ``A_log``, ``dt_bias`` and ``e_score_correction_bias``, ``"bfloat16"`` for everything else."""
    return "float32" if name.endswith(FLOAT32_SUFFIXES) else "bfloat16"


def num_parameters(config: KimiConfig) -> int:
    total = 0
    for shape in expected_tensors(config).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
