"""The model configuration: one frozen dataclass, parsed from the hub ``config.json``, with presets.

Field names follow the Kimi ``config.json`` keys (spec §(a)); the two nested
``linear_attn_config`` lists are kept **1-indexed**, exactly as the hub writes them, and the
0-indexed layer map is derived (``is_kda_layer``). Ops never take the config: the model reads the
scalars it needs from here and passes them explicitly.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi-Linear model."""


@dataclass(frozen=True)
class KimiConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # MLA ("full attention") layers
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # FFN / MoE
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    # KDA (linear_attn_config)
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    kda_layers: tuple[int, ...]  # 1-indexed, as in the hub config
    full_attn_layers: tuple[int, ...]  # 1-indexed
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"

    def __post_init__(self):
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "kda_num_heads", "kda_head_dim", "short_conv_kernel_size", "moe_layer_freq"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        layers = set(self.kda_layers) | set(self.full_attn_layers)
        if set(self.kda_layers) & set(self.full_attn_layers):
            raise ConfigError("linear_attn_config: a layer is listed as both KDA and full attention: "
                              f"{sorted(set(self.kda_layers) & set(self.full_attn_layers))}")
        if layers != set(range(1, self.num_hidden_layers + 1)):
            raise ConfigError("linear_attn_config: kda_layers + full_attn_layers (1-indexed) must cover "
                              f"layers 1..{self.num_hidden_layers} exactly, got {sorted(layers)}")
        if self.has_moe:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(f"num_experts_per_token: expected 1..{self.num_experts}, "
                                  f"got {self.num_experts_per_token}")
            if self.num_experts % self.num_expert_group:
                raise ConfigError(f"num_expert_group: {self.num_expert_group} does not divide "
                                  f"num_experts {self.num_experts}")
            if not 0 < self.topk_group <= self.num_expert_group:
                raise ConfigError(f"topk_group: expected 1..{self.num_expert_group}, got {self.topk_group}")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def kda_dim(self) -> int:
        """Width of the KDA q/k/v projections: H * K."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head width P + R (192 in the real model)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_kda_layer(self, i: int) -> bool:
        """0-indexed layer i is KDA (the config lists are 1-indexed)."""
        return (i + 1) in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def layer_kind(self, i: int) -> tuple[str, str]:
        """(mixer, ffn) of 0-indexed layer i: mixer in {'kda', 'mla'}, ffn in {'dense', 'moe'}."""
        return ("kda" if self.is_kda_layer(i) else "mla", "moe" if self.is_moe_layer(i) else "dense")

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_hub_dict(self) -> dict:
        """The hub ``config.json`` layout (Kimi key names, nested ``linear_attn_config``)."""
        d = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": None,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": 0,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.torch_dtype,
        }
        return d

    @classmethod
    def from_hub_dict(cls, d: dict, *, source: str = "config.json") -> "KimiConfig":
        """Parse a hub ``config.json`` dict; errors name the key and the file."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        lac = d.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ConfigError(f"{source}: missing or malformed 'linear_attn_config'")
        if d.get("q_lora_rank") not in (None, 0):
            raise ConfigError(f"{source}: q_lora_rank={d['q_lora_rank']!r} is not supported "
                              "(Kimi-Linear uses a full-rank q_proj)")
        if d.get("mla_use_nope", True) is not True:
            raise ConfigError(f"{source}: mla_use_nope must be true (Kimi-Linear MLA has no rotary)")

        def get(mapping, key, default=dataclasses.MISSING, where=""):
            if key in mapping:
                return mapping[key]
            if default is dataclasses.MISSING:
                raise ConfigError(f"{source}: missing required key '{where}{key}'")
            return default

        try:
            return cls(
                vocab_size=get(d, "vocab_size"),
                hidden_size=get(d, "hidden_size"),
                num_hidden_layers=get(d, "num_hidden_layers"),
                num_attention_heads=get(d, "num_attention_heads"),
                kv_lora_rank=get(d, "kv_lora_rank"),
                qk_nope_head_dim=get(d, "qk_nope_head_dim"),
                qk_rope_head_dim=get(d, "qk_rope_head_dim"),
                v_head_dim=get(d, "v_head_dim"),
                intermediate_size=get(d, "intermediate_size"),
                moe_intermediate_size=get(d, "moe_intermediate_size", 0),
                num_experts=get(d, "num_experts", 0),
                num_experts_per_token=get(d, "num_experts_per_token", 0),
                num_shared_experts=get(d, "num_shared_experts", 0),
                first_k_dense_replace=get(d, "first_k_dense_replace", 0),
                moe_layer_freq=get(d, "moe_layer_freq", 1),
                routed_scaling_factor=float(get(d, "routed_scaling_factor", 1.0)),
                moe_renormalize=bool(get(d, "moe_renormalize", True)),
                num_expert_group=get(d, "num_expert_group", 1) or 1,
                topk_group=get(d, "topk_group", 1) or 1,
                kda_num_heads=get(lac, "num_heads", where="linear_attn_config."),
                kda_head_dim=get(lac, "head_dim", where="linear_attn_config."),
                short_conv_kernel_size=get(lac, "short_conv_kernel_size", where="linear_attn_config."),
                kda_layers=tuple(get(lac, "kda_layers", where="linear_attn_config.")),
                full_attn_layers=tuple(get(lac, "full_attn_layers", where="linear_attn_config.")),
                rms_norm_eps=float(get(d, "rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(get(d, "tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
                torch_dtype=d.get("dtype", d.get("torch_dtype", "bfloat16")) or "bfloat16",
            )
        except ConfigError as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "KimiConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_hub_dict(d, source=str(path))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hub_dict(), indent=2) + "\n")

    @classmethod
    def from_name(cls, name: str) -> "KimiConfig":
        """A named preset (``tiny``, ``small``, ``medium``, ``kimi-linear-48b``)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def _kimi_48b() -> KimiConfig:
    mla = (4, 8, 12, 16, 20, 24, 27)
    return KimiConfig(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        num_attention_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=9216, moe_intermediate_size=1024, num_experts=256,
        num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
        routed_scaling_factor=2.446, moe_renormalize=True, num_expert_group=1, topk_group=1,
        kda_num_heads=32, kda_head_dim=128, short_conv_kernel_size=4,
        kda_layers=tuple(i for i in range(1, 28) if i not in mla), full_attn_layers=mla,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


def _small_preset(*, vocab, hidden, layers, mla_layers, kda_heads, kda_dim, mla_heads, latent,
                  nope, rope, vdim, ffn, expert_ffn, experts, top_k, groups=1, topk_group=1):
    return KimiConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=mla_heads, kv_lora_rank=latent, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=vdim, intermediate_size=ffn,
        moe_intermediate_size=expert_ffn, num_experts=experts, num_experts_per_token=top_k,
        num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.446,
        moe_renormalize=True, num_expert_group=groups, topk_group=topk_group,
        kda_num_heads=kda_heads, kda_head_dim=kda_dim, short_conv_kernel_size=4,
        kda_layers=tuple(i for i in range(1, layers + 1) if i not in mla_layers),
        full_attn_layers=tuple(mla_layers), bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


PRESETS: dict[str, KimiConfig] = {
    # 4 layers: KDA, KDA, KDA, MLA (the real 3:1 ratio); layer 0 dense, 1..3 MoE.
    "tiny": _small_preset(vocab=512, hidden=64, layers=4, mla_layers=(4,), kda_heads=2, kda_dim=32,
                          mla_heads=2, latent=32, nope=16, rope=8, vdim=16, ffn=128, expert_ffn=32,
                          experts=8, top_k=2),
    # grouped routing exercised (4 groups, keep 2) and MLA in the middle of the stack.
    "small": _small_preset(vocab=1024, hidden=128, layers=6, mla_layers=(3, 6), kda_heads=4,
                           kda_dim=32, mla_heads=4, latent=64, nope=32, rope=16, vdim=32, ffn=256,
                           expert_ffn=64, experts=16, top_k=4, groups=4, topk_group=2),
    # real head sizes (K=V=128, 576-wide latent), few heads and layers: kernel shapes of the real model.
    "medium": _small_preset(vocab=2048, hidden=256, layers=4, mla_layers=(4,), kda_heads=4,
                            kda_dim=128, mla_heads=4, latent=512, nope=128, rope=64, vdim=128,
                            ffn=512, expert_ffn=128, experts=32, top_k=8),
    "kimi-linear-48b": _kimi_48b(),
}
