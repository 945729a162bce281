"""Loading a ``WeightSource`` onto the device: every tensor of spec §(c), resident, in the model dtype.

Layout on the device (``ModelWeights``), built once by ``load_weights``:

* projection / expert / embedding weights in the model ``dtype`` (bf16 in production; float32 or
  float64 for lifted runs), row-vector convention (``y = x @ W.T``); the q/k/v and the low-rank
  gate/beta projections of a KDA layer are concatenated row-wise into one matrix (one GEMM per
  layer input), the gate's and the output gate's up-projections ``f_b``, ``g_b`` stacked into one
  ``[2, HV*K, rank]`` block (one batched GEMM), likewise MLA ``q_proj`` with ``kv_a_proj_with_mqa``, and the ``gate_proj`` /
  ``up_proj`` of a dense MLP or shared expert (``gate``, ``up`` are adjacent views of one block);
* ``A_log [HV]``, ``dt_bias [HV*K]``, ``e_score_correction_bias [E]`` and the router weight
  ``[E, D]`` in float32 whatever the model dtype (spec b.0: gate and router run in fp32);
  with a float64 model they stay float64;
* conv weights reshaped ``[C, 1, W] -> [C, W]`` and the q/k/v taps stacked into one ``[3C, W]``
  (the conv is depthwise, so one launch over the concatenated q/k/v projections is exact);
* routed experts stacked per MoE layer: ``w1, w3 [E, F, D]``, ``w2 [E, D, F]``.

Bits: tensors are read with ``WeightSource.get_raw`` (the storage bits) and widened/rounded by torch
on the device, so a bf16 checkpoint is resident bit for bit at bf16 and exactly at float32/float64.
A ``SyntheticSource`` loaded onto CUDA is generated on the device (``optimized.synthetic``): same
bits, no host round trip (the real 48B model fits on one H200 without a 98 GB file).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kimi.checkpoint import CheckpointError
from kimi.config import KimiConfig
from kimi.tensors import expected_tensors

from . import synthetic

_STORAGE_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                  "float64": torch.float64}


def raw_to_torch(raw: np.ndarray, storage_dtype: str) -> torch.Tensor:
    """Storage bits from ``WeightSource.get_raw`` -> a CPU tensor of the storage dtype (no rounding)."""
    raw = np.ascontiguousarray(raw)
    if storage_dtype == "bfloat16":
        if raw.dtype != np.uint16:
            raise TypeError(f"bf16 storage expected as uint16 bits, got {raw.dtype}")
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    if storage_dtype not in _STORAGE_TORCH:
        raise TypeError(f"unsupported storage dtype {storage_dtype!r}")
    return torch.from_numpy(raw.astype(np.dtype(storage_dtype), copy=False))


@dataclass
class KDAWeights:
    w_in: torch.Tensor  # [3*H*K + rank_f + rank_g + HV, D]: q, k, v, f_a, g_a, b_proj rows
    conv: torch.Tensor  # [2*H*K + HV*V, W]: q, k, v conv taps stacked (the conv is depthwise)
    f_b: torch.Tensor  # [HV*K, rank_f]
    g_b: torch.Tensor  # [HV*V, rank_g]
    fg_b: torch.Tensor | None  # [2, HV*K, rank]: f_b and g_b as one block (f_b, g_b its views) when their shapes agree
    A_log: torch.Tensor | None  # [HV] fp32 (None: a bounded-gate checkpoint without it)
    dt_bias: torch.Tensor  # [HV*K] fp32
    o_norm: torch.Tensor  # [V]
    o_proj: torch.Tensor  # [D, HV*V]
    splits: tuple[int, ...]  # row counts of w_in's blocks


@dataclass
class MLAWeights:
    w_in: torch.Tensor  # [N*(P+R) + L + R, D]: q_proj then kv_a_proj_with_mqa rows
    kv_norm: torch.Tensor  # [L]
    w_kvb: torch.Tensor  # [N*(P+Vh), L]
    o_proj: torch.Tensor  # [D, N*Vh]
    splits: tuple[int, ...]


@dataclass
class DenseWeights:
    gate: torch.Tensor  # [F, D]
    up: torch.Tensor  # [F, D]
    down: torch.Tensor  # [D, F]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, D] fp32
    bias: torch.Tensor  # [E] fp32 (e_score_correction_bias)
    w1: torch.Tensor  # [E, F, D] gate
    w2: torch.Tensor  # [E, D, F] down
    w3: torch.Tensor  # [E, F, D] up
    shared: DenseWeights | None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: KDAWeights | MLAWeights
    ffn: DenseWeights | MoEWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, D]
    layers: list[LayerWeights] = field(default_factory=list)
    norm: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None

    def nbytes(self) -> int:
        seen, total = set(), 0

        def walk(obj):
            nonlocal total
            if isinstance(obj, torch.Tensor):
                if obj.data_ptr() not in seen:
                    seen.add(obj.data_ptr())
                    total += obj.numel() * obj.element_size()
            elif isinstance(obj, (list, tuple)):
                for o in obj:
                    walk(o)
            elif hasattr(obj, "__dataclass_fields__"):
                for name in obj.__dataclass_fields__:
                    walk(getattr(obj, name))

        walk(self)
        return total


class _Fetcher:
    """name -> tensor on the device in the storage dtype, from a source (host read or on-device
    generation)."""

    def __init__(self, source, device: torch.device):
        self.source = source
        self.device = device
        self.generate = None
        if device.type == "cuda":
            if synthetic.is_synthetic(source):
                self.generate = synthetic.DeviceGenerator(source, device)

    def __call__(self, name: str) -> torch.Tensor:
        if self.generate is not None:
            return self.generate(name)
        storage = self.source.storage_dtype(name)
        t = raw_to_torch(self.source.get_raw(name), storage).to(self.device)
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{self._where(name)}: {name}: {bad} non-finite value(s) (NaN/Inf)")
        return t

    def _where(self, name: str) -> str:
        where = getattr(self.source, "_where", None)
        return where(name) if callable(where) else self.source.describe()


def load_weights(source, *, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    """Read every tensor of ``source`` (a ``WeightSource``) onto ``device``; see the module doc."""
    cfg: KimiConfig = source.config
    fetch = _Fetcher(source, device)
    small = torch.float64 if dtype == torch.float64 else torch.float32

    def w(name, to=dtype):
        return fetch(name).to(to)

    def conv(name):
        t = w(name)
        if t.dim() == 3:
            t = t.reshape(t.shape[0], t.shape[2])
        return t.contiguous()

    def cat(names):
        parts = [w(n) for n in names]
        return torch.cat(parts, 0).contiguous(), tuple(p.shape[0] for p in parts)

    def dense(prefix):
        # gate and up adjacent in one [2F, D] block: moe.swiglu runs them as one GEMM
        gate_up, (F, _) = cat([prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        return DenseWeights(gate_up[:F], gate_up[F:], w(prefix + "down_proj.weight"))

    weights = ModelWeights(embed=w("model.embed_tokens.weight"))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.is_kda_layer(i):
            w_in, splits = cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                a + "f_a_proj.weight", a + "g_a_proj.weight", a + "b_proj.weight"])
            taps = torch.cat([conv(a + f"{x}_conv1d.weight") for x in "qkv"], 0).contiguous()
            f_b, g_b, fg_b = w(a + "f_b_proj.weight"), w(a + "g_b_proj.weight"), None
            if f_b.shape == g_b.shape:  # one batched GEMM for both up-projections of a layer
                fg_b = torch.stack([f_b, g_b])
                f_b, g_b = fg_b[0], fg_b[1]
            mixer = KDAWeights(
                w_in=w_in, conv=taps, f_b=f_b, g_b=g_b, fg_b=fg_b,
                A_log=w(a + "A_log", small).reshape(-1).contiguous() if cfg.kda_A_log else None,
                dt_bias=w(a + "dt_bias", small).reshape(-1).contiguous(),
                o_norm=w(a + "o_norm.weight"), o_proj=w(a + "o_proj.weight"), splits=splits)
        else:
            w_in, splits = cat([a + "q_proj.weight", a + "kv_a_proj_with_mqa.weight"])
            mixer = MLAWeights(w_in=w_in, kv_norm=w(a + "kv_a_layernorm.weight"),
                               w_kvb=w(a + "kv_b_proj.weight"), o_proj=w(a + "o_proj.weight"),
                               splits=splits)
        if cfg.is_moe_layer(i):
            m = p + "block_sparse_moe."
            E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            stacked = {k: torch.empty((E, D, F) if k == "w2" else (E, F, D), dtype=dtype, device=device)
                       for k in ("w1", "w2", "w3")}
            for e in range(E):
                for k, t in stacked.items():
                    t[e].copy_(fetch(f"{m}experts.{e}.{k}.weight"))
            shared = None
            if cfg.num_shared_experts > 0:
                s = m + "shared_experts."
                shared = dense(s)
            ffn = MoEWeights(router=w(m + "gate.weight", small),
                             bias=w(m + "gate.e_score_correction_bias", small).reshape(-1).contiguous(),
                             shared=shared, **stacked)
        else:
            f = p + "mlp."
            ffn = dense(f)
        weights.layers.append(LayerWeights(input_norm=w(p + "input_layernorm.weight"),
                                           post_norm=w(p + "post_attention_layernorm.weight"),
                                           mixer=mixer, ffn=ffn))
    weights.norm = w("model.norm.weight")
    # tied embeddings: the checkpoint holds no lm_head.weight (kimi.tensors.expected_tensors)
    weights.lm_head = weights.embed if cfg.tie_word_embeddings else w("lm_head.weight")
    return weights


SMALL_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias", ".block_sparse_moe.gate.weight")
# kept in float32 whatever the model dtype (float64 in a float64 model): spec b.0, gate and router


def resident_bytes(config: KimiConfig, dtype: torch.dtype) -> int:
    """Bytes ``load_weights`` keeps resident for ``config`` at ``dtype``, counted from the tensor
    table (``kimi.tensors.expected_tensors``), before anything is read: every tensor once at
    ``dtype`` (fusing and stacking copy, they do not duplicate), the gate and router parameters
    (``SMALL_SUFFIXES``) at float32 (float64 in a float64 model), no ``lm_head`` of its own when
    the embeddings are tied. Equals ``ModelWeights.nbytes()`` of the loaded model (a test holds
    them equal)."""
    size = torch.empty((), dtype=dtype).element_size()
    small = 8 if dtype == torch.float64 else 4
    total = 0
    for name, shape in expected_tensors(config).items():
        n = 1
        for s in shape:
            n *= s
        total += n * (small if name.endswith(SMALL_SUFFIXES) else size)
    return total


def named_views(weights: ModelWeights, config: KimiConfig) -> dict[str, torch.Tensor]:
    """``{checkpoint tensor name: view}`` of resident ``weights``: every tensor of spec §(c) as a view
    into the fused/stacked blocks (no copy; shapes as stored here, e.g. conv taps ``[C, W]``). The
    float64 reference reads these instead of its source (``reference.load(..., shared_weights=)``),
    so one GPU holds the 48B model's bf16 weights once for both paths. Values are the checkpoint's
    exactly at any model dtype that holds them (bf16, float32, float64)."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = weights.lm_head
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = lw.input_norm, lw.post_norm
        mx = lw.mixer
        if isinstance(mx, KDAWeights):
            names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
            out.update({a + f"{n}.weight": t for n, t in zip(names, mx.w_in.split(mx.splits))})
            C = (mx.conv.shape[0]) // 3
            out.update({a + f"{x}_conv1d.weight": mx.conv[j * C:(j + 1) * C] for j, x in enumerate("qkv")})
            out.update({a + "f_b_proj.weight": mx.f_b, a + "g_b_proj.weight": mx.g_b,
                        a + "dt_bias": mx.dt_bias, a + "o_norm.weight": mx.o_norm, a + "o_proj.weight": mx.o_proj})
            if mx.A_log is not None:
                out[a + "A_log"] = mx.A_log
        else:
            q, kv_a = mx.w_in.split(mx.splits)
            out.update({a + "q_proj.weight": q, a + "kv_a_proj_with_mqa.weight": kv_a,
                        a + "kv_a_layernorm.weight": mx.kv_norm, a + "kv_b_proj.weight": mx.w_kvb,
                        a + "o_proj.weight": mx.o_proj})
        ffn = lw.ffn
        if isinstance(ffn, MoEWeights):
            m = p + "block_sparse_moe."
            out[m + "gate.weight"], out[m + "gate.e_score_correction_bias"] = ffn.router, ffn.bias
            for k in ("w1", "w2", "w3"):
                stacked = getattr(ffn, k)
                out.update({f"{m}experts.{e}.{k}.weight": stacked[e] for e in range(stacked.shape[0])})
            if ffn.shared is not None:
                out.update(_dense_views(m + "shared_experts.", ffn.shared))
        else:
            out.update(_dense_views(p + "mlp.", ffn))
    return out


def _dense_views(prefix: str, d: DenseWeights) -> dict[str, torch.Tensor]:
    return {prefix + "gate_proj.weight": d.gate, prefix + "up_proj.weight": d.up, prefix + "down_proj.weight": d.down}
