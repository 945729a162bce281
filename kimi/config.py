"""The model configuration: one frozen dataclass, parsed from the hub ``config.json``, with presets.

Field names follow the Kimi ``config.json`` keys (spec §(a)); the two nested
``linear_attn_config`` lists are kept **1-indexed**, exactly as the hub writes them, and the
0-indexed layer map is derived (``is_kda_layer``). Ops never take the config: the model reads the
scalars it needs from here and passes them explicitly.

Every value the model reads is checked as JSON types it (``kimi.validate``) before any use:
sizes are JSON integers below the limits of ``LIMITS``, layer lists arrays of integers, flags JSON
booleans, ``rms_norm_eps`` and ``routed_scaling_factor`` finite and positive; ``eos_token_id`` may
be a list (the HF form). Keys that name math the model fixes (``hidden_act``,
``moe_router_activation_func``, ``use_grouped_topk``, ``mla_use_nope``, ``q_lora_rank``) must,
when present, name that math: a config describing another model is refused, never run as this one.
Keys the model does not read (``rope_theta``, ``head_dim``, ...) are ignored. Errors name the key,
never echo a string.

The KDA gate: ``linear_attn_config.gate_lower_bound`` (a number in [-5, 0)) makes it the bounded
gate ``b sigmoid(exp(A_log) (g_raw + dt_bias))`` of the later KDA models (Kimi-K3, GLM-5.3);
``safe_gate: true`` with no bound means b = -5 (transformers' GLM-5.3 config does the same); neither
key: the softplus gate of Kimi-Linear-48B. ``kda_A_log`` is not a config key: a bounded-gate
checkpoint whose KDA layers hold no ``A_log`` (``kimi.checkpoint`` sees it) drops that term.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .validate import (InvalidInput, as_bool, as_float, as_int, as_list, as_object, as_str, field,
                       read_json_file)
from .validate import kind as kind_of


def kda_gate_name(lower_bound) -> str:
    """The ``kda_gate`` variant of a gate's b (None: ``"softplus"``): ``"lower_bound:-5"``."""
    if lower_bound is None:
        return "softplus"
    r = repr(float(lower_bound))
    return "lower_bound:" + (r[:-2] if r.endswith(".0") else r)


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi-Linear model."""


MAX_LAYERS = 1024
# Upper limits of the sizes (kimi-linear-48b has 27 layers, 32 heads, vocabulary 163,840, 256
# experts, hidden 2,304, FFN 9,216): generous for any real model, small enough that nothing built
# from a config (the layer map, the tensor table) can exhaust memory.
LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_hidden_layers": MAX_LAYERS,
    "num_attention_heads": 1024, "kv_lora_rank": 1 << 16, "qk_nope_head_dim": 4096,
    "qk_rope_head_dim": 4096, "v_head_dim": 4096, "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20, "num_experts": 1 << 16, "num_experts_per_token": 1 << 16,
    "num_shared_experts": 1024, "first_k_dense_replace": MAX_LAYERS, "moe_layer_freq": MAX_LAYERS,
    "num_expert_group": 1 << 16, "topk_group": 1 << 16, "kda_num_heads": 1024, "kda_head_dim": 4096,
    "short_conv_kernel_size": 64,
}
POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
            "short_conv_kernel_size", "moe_layer_freq", "num_expert_group", "topk_group")
# the config.json key of the fields kept under another name
HUB_KEYS = {"kda_num_heads": "linear_attn_config.num_heads", "kda_head_dim": "linear_attn_config.head_dim",
            "short_conv_kernel_size": "linear_attn_config.short_conv_kernel_size",
            "kda_layers": "linear_attn_config.kda_layers",
            "full_attn_layers": "linear_attn_config.full_attn_layers", "torch_dtype": "dtype",
            "gate_lower_bound": "linear_attn_config.gate_lower_bound"}
MAX_CONFIG_BYTES = 16 << 20  # a hub config.json is a few kB
MAX_TENSORS = 1_000_000  # 50x the 48B model's 20,493


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
    eos_token_id: int | tuple[int, ...] | None = None  # a tuple: HF's list of end tokens
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # the KDA gate: None the softplus gate, b in [-5, 0) the bounded gate; kda_A_log False: the bounded
    # gate without the exp(A_log) factor (a checkpoint without A_log tensors)
    gate_lower_bound: float | None = None
    kda_A_log: bool = True

    def __post_init__(self):
        try:
            self._check_types()
            self._check_layers()
            self._check_moe()
            self._check_size()
        except InvalidInput as exc:
            raise ConfigError(str(exc)) from None

    def _check_types(self):
        for name, hi in LIMITS.items():
            as_int(getattr(self, name), HUB_KEYS.get(name, name), lo=1 if name in POSITIVE else 0, hi=hi)
        as_bool(self.moe_renormalize, "moe_renormalize")
        as_bool(self.tie_word_embeddings, "tie_word_embeddings")
        as_float(self.rms_norm_eps, "rms_norm_eps", lo=0.0, lo_open=True, hi=1.0)
        as_float(self.routed_scaling_factor, "routed_scaling_factor", lo=0.0, lo_open=True, hi=1e6)
        as_str(self.torch_dtype, "dtype", max_len=64)
        if self.gate_lower_bound is not None:
            b = as_float(self.gate_lower_bound, HUB_KEYS["gate_lower_bound"], lo=-5.0, hi=0.0)
            if b == 0.0:
                raise InvalidInput(f"{HUB_KEYS['gate_lower_bound']}: 0.0 is outside its domain (expected < 0)")
        as_bool(self.kda_A_log, "kda_A_log")
        if not self.kda_A_log and self.gate_lower_bound is None:
            raise InvalidInput("A_log: the softplus KDA gate needs A_log (only the bounded gate has a form without it)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            for t in self.special_ids(name):
                as_int(t, name, lo=0, hi=self.vocab_size - 1)

    def special_ids(self, name: str) -> tuple[int, ...]:
        """The ids of a special-token field (``eos_token_id`` may hold several; None: none)."""
        value = getattr(self, name)
        if value is None:
            return ()
        if isinstance(value, tuple):
            if not value or len(value) > 1024:
                raise InvalidInput(f"{name}: expected 1 to 1024 ids, got {len(value)}")
            return value
        return (value,)

    def _check_layers(self):
        n = self.num_hidden_layers
        seen: dict[int, str] = {}
        for name in ("kda_layers", "full_attn_layers"):
            key = HUB_KEYS[name]
            ids = getattr(self, name)
            if not isinstance(ids, tuple):
                raise InvalidInput(f"{key}: expected a tuple of layer numbers, got {type(ids).__name__}")
            for x in ids:
                as_int(x, key, lo=1, hi=n)
                if x in seen:
                    raise InvalidInput(f"linear_attn_config: layer {x} is listed twice ({seen[x]} and {key})")
                seen[x] = key
        if len(seen) != n:
            missing = next(i for i in range(1, n + 1) if i not in seen)
            raise InvalidInput(f"linear_attn_config: kda_layers + full_attn_layers (1-indexed) must cover "
                               f"layers 1..{n} exactly; layer {missing} is in neither")
        if self.intermediate_size == 0 and not all(self.is_moe_layer(i) for i in range(n)):
            raise InvalidInput("intermediate_size: expected a positive integer (a layer has a dense MLP)")

    def _check_moe(self):
        if not self.has_moe:
            return
        if self.moe_intermediate_size == 0:
            raise InvalidInput("moe_intermediate_size: expected a positive integer (the model has MoE layers)")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise InvalidInput(f"num_experts_per_token: expected 1..{self.num_experts}, "
                               f"got {self.num_experts_per_token}")
        if self.num_experts % self.num_expert_group:
            raise InvalidInput(f"num_expert_group: {self.num_expert_group} does not divide "
                               f"num_experts {self.num_experts}")
        if not 0 < self.topk_group <= self.num_expert_group:
            raise InvalidInput(f"topk_group: expected 1..{self.num_expert_group}, got {self.topk_group}")

    def _check_size(self):
        # each limit alone is generous; their product must not make a tensor table that cannot fit
        moe = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        count = 3 + 16 * self.num_hidden_layers + moe * (3 * self.num_experts + 5)
        if count > MAX_TENSORS:
            raise InvalidInput(f"num_experts: {self.num_experts} experts in {moe} MoE layers make {count} tensors, "
                               f"more than the limit of {MAX_TENSORS}")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def kda_dim(self) -> int:
        """Width of the KDA q/k/v projections: H * K."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kda_gate(self) -> str:
        """The KDA gate this config describes, as the ``kda_gate`` variant names it: ``"softplus"`` or
        ``"lower_bound:<b>"``."""
        return kda_gate_name(self.gate_lower_bound)

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
                **({} if self.gate_lower_bound is None else {"gate_lower_bound": self.gate_lower_bound}),
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.torch_dtype,
        }
        return d

    @classmethod
    def from_hub_dict(cls, d: dict, *, source: str = "config.json") -> "KimiConfig":
        """Parse a hub ``config.json`` dict (also the one transformers' ``save_pretrained`` writes);
        errors name the file and the key."""
        try:
            return cls(**_hub_fields(d, source))
        except (ConfigError, InvalidInput) as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "KimiConfig":
        path = Path(path)
        try:
            d = read_json_file(path, max_bytes=MAX_CONFIG_BYTES)
        except InvalidInput as exc:
            raise ConfigError(str(exc)) from None
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


def _ints(value, name: str) -> tuple:
    """A JSON array of integers (layer numbers), typed here: it is compared as a set before the
    constructor checks the ranges."""
    return tuple(as_int(x, f"{name}[{i}]") for i, x in enumerate(as_list(value, name, max_len=MAX_LAYERS)))


def _grouping(value):
    """``num_expert_group`` / ``topk_group``: null or 0 (HF's "no grouping") is one group."""
    return 1 if value is None or (type(value) is int and value == 0) else value


def _special(value, name: str):
    """A special-token id, or (HF form) a list of them: kept as a tuple."""
    if isinstance(value, list):
        return tuple(as_list(value, name, max_len=1024, min_len=1))
    return value


# keys whose only value this model implements, when present (spec §(a))
FIXED = {"hidden_act": ("silu", "SwiGLU experts and MLP"),
         "moe_router_activation_func": ("sigmoid", "the sigmoid router")}
LAYER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
MLP_TYPES = ("dense", "sparse")


def _per_layer(d: dict, key: str) -> list:
    """A transformers per-layer list: one entry per layer."""
    types = as_list(d[key], key, max_len=MAX_LAYERS)
    n = d.get("num_hidden_layers")
    if isinstance(n, int) and len(types) != n:
        raise InvalidInput(f"{key}: {len(types)} entries for num_hidden_layers {n}")
    return types


def _linear_attn(d: dict, source: str) -> dict:
    """The KDA fields from the hub's ``linear_attn_config``, or from the flat keys transformers
    writes (``layer_types``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``);
    when both are present they must agree."""
    hub = None
    if "linear_attn_config" in d:
        lac = as_object(d["linear_attn_config"], "linear_attn_config")

        def sub(key):
            return field(lac, key, f"{source}: linear_attn_config")

        hub = dict(kda_num_heads=sub("num_heads"), kda_head_dim=sub("head_dim"),
                   short_conv_kernel_size=sub("short_conv_kernel_size"),
                   kda_layers=_ints(sub("kda_layers"), "linear_attn_config.kda_layers"),
                   full_attn_layers=_ints(sub("full_attn_layers"), "linear_attn_config.full_attn_layers"),
                   gate_lower_bound=_gate_lower_bound(lac))
    if "layer_types" not in d:
        if hub is None:
            raise InvalidInput(f"{source}: missing required key 'linear_attn_config' (or transformers' "
                               "'layer_types')")
        return hub
    types = _per_layer(d, "layer_types")
    for i, t in enumerate(types):
        as_str(t, f"layer_types[{i}]", choices=tuple(LAYER_TYPES))
    flat = dict(kda_layers=tuple(i + 1 for i, t in enumerate(types) if t == "linear_attention"),
                full_attn_layers=tuple(i + 1 for i, t in enumerate(types) if t == "full_attention"))
    if hub is not None:
        if (set(hub["kda_layers"]), set(hub["full_attn_layers"])) != tuple(map(set, flat.values())):
            raise InvalidInput("layer_types disagrees with linear_attn_config's kda_layers/full_attn_layers")
        return hub
    flat.update(kda_num_heads=field(d, "linear_num_heads", source),
                kda_head_dim=field(d, "linear_head_dim", source),
                short_conv_kernel_size=field(d, "linear_conv_kernel_dim", source))
    return flat


def _gate_lower_bound(lac: dict):
    """The bounded KDA gate's b from ``linear_attn_config`` (None: the softplus gate):
    ``gate_lower_bound`` when it is a number; -5 when it is null or absent and ``safe_gate`` is true."""
    safe = as_bool(lac.get("safe_gate", False), "linear_attn_config.safe_gate")
    b = lac.get("gate_lower_bound")
    if b is not None:
        return b   # typed by KimiConfig
    return -5.0 if safe else None


def _moe_layout(d: dict) -> dict:
    """``first_k_dense_replace`` and ``moe_layer_freq``, from the hub keys or from transformers'
    ``mlp_layer_types`` (dense layers first, then MoE layers: the layouts both describe)."""
    out = dict(first_k_dense_replace=d.get("first_k_dense_replace", 0), moe_layer_freq=d.get("moe_layer_freq", 1))
    if "mlp_layer_types" not in d:
        return out
    types = _per_layer(d, "mlp_layer_types")
    for i, t in enumerate(types):
        as_str(t, f"mlp_layer_types[{i}]", choices=MLP_TYPES)
    k = next((i for i, t in enumerate(types) if t == "sparse"), len(types))
    if any(t == "dense" for t in types[k:]):
        raise InvalidInput("mlp_layer_types: dense layers after a MoE layer are not a layout this model has "
                           "(expected dense layers first, then MoE layers)")
    if "first_k_dense_replace" not in d and "moe_layer_freq" not in d:
        return dict(first_k_dense_replace=k, moe_layer_freq=1)
    if out["moe_layer_freq"] != 1 or out["first_k_dense_replace"] != k:
        raise InvalidInput("mlp_layer_types disagrees with first_k_dense_replace/moe_layer_freq")
    return out


def _hub_fields(d, source: str) -> dict:
    """The constructor's arguments from a hub config dict, as JSON has them (``__post_init__``
    checks types, limits and domains); only what the hub layout itself constrains is checked here."""
    d = as_object(d, source)
    if d.get("q_lora_rank") not in (None, 0):
        raise InvalidInput(f"q_lora_rank: {kind_of(d['q_lora_rank'])} is not supported (Kimi-Linear uses a "
                           "full-rank q_proj; expected null or 0)")
    if d.get("mla_use_nope", True) is not True:
        raise InvalidInput("mla_use_nope: must be true (Kimi-Linear MLA has no rotary)")
    for key, (value, why) in FIXED.items():
        if key in d and d[key] != value:
            raise InvalidInput(f"{key}: expected \"{value}\" ({why}), got {kind_of(d[key])}")
    if not as_bool(d.get("use_grouped_topk", True), "use_grouped_topk") and _grouping(d.get("num_expert_group")) != 1:
        raise InvalidInput("use_grouped_topk: false with num_expert_group above 1 is not supported (the router "
                           "of this model selects within groups; expected true, or one group)")

    def get(key, default=dataclasses.MISSING):
        return field(d, key, source) if default is dataclasses.MISSING else d.get(key, default)

    dtype = d.get("dtype", d.get("torch_dtype"))
    return dict(**_linear_attn(d, source), **_moe_layout(d),
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_hidden_layers=get("num_hidden_layers"), num_attention_heads=get("num_attention_heads"),
        kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
        intermediate_size=get("intermediate_size"), moe_intermediate_size=get("moe_intermediate_size", 0),
        num_experts=get("num_experts", 0), num_experts_per_token=get("num_experts_per_token", 0),
        num_shared_experts=get("num_shared_experts", 0), routed_scaling_factor=get("routed_scaling_factor", 1.0),
        moe_renormalize=get("moe_renormalize", True),
        num_expert_group=_grouping(d.get("num_expert_group")), topk_group=_grouping(d.get("topk_group")),
        rms_norm_eps=get("rms_norm_eps", 1e-5), tie_word_embeddings=get("tie_word_embeddings", False),
        bos_token_id=d.get("bos_token_id"), eos_token_id=_special(d.get("eos_token_id"), "eos_token_id"),
        pad_token_id=d.get("pad_token_id"), torch_dtype="bfloat16" if dtype is None else dtype,
    )


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
# tiny with the bounded KDA gate (b = -5) of the later KDA models
PRESETS["tiny-bounded"] = dataclasses.replace(PRESETS["tiny"], gate_lower_bound=-5.0)
