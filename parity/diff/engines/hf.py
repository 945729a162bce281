"""The ``transformers`` engine: transformers' own ``KimiLinearForCausalLM``, traced through hooks.

The model is loaded with ``from_pretrained`` from the same checkpoint directory the reference reads:
transformers' conversion mapping for ``kimi_linear`` (``transformers/conversion_mapping.py``, the
same from 5.17 to 5.25) renames the hub layout on load, so no converted copy is written. It renames
``block_sparse_moe.`` to ``mlp.`` (the MoE layers of a hub checkpoint, and every layer of one that
transformers saved), moves ``f_a_proj``, ``f_b_proj``, ``dt_bias`` and ``A_log`` under
``forget_gate``, concatenates ``q/k/v_conv1d`` into one ``conv1d`` and packs the experts' ``w1/w3``
into ``gate_up_proj`` and ``w2`` into ``down_proj``. A key the model expects but the checkpoint
lacks would be initialized at random: that is refused here, as is a config that transformers reads
into another layer layout than the reference.

Forward hooks fill the trace under the optimized model's names (``parity/diff/engines/trace.py``): each
decoder layer's ``self_attn`` output (mixer), ``mlp`` output (ffn) and its own output (hidden),
``model.norm`` (final_norm), and each MoE gate's router logits (scores = their sigmoid) and top-k
indices. ``.hf_model`` is the transformers model itself, for a user's own hooks.

transformers' KimiLinear combines the experts with unbiased scores and normalizes the MLA latent
with eps 1e-6 (``KimiLinearRMSNorm``'s default), and its KDA forget gate is the softplus one (it reads
no ``gate_lower_bound``): it runs ``moe_combine=unbiased, kv_norm_eps=1e-6, kda_gate=softplus``.

Which KDA and short-conv code runs is chosen by transformers when it imports the model: fla-core's
and causal-conv1d's kernels when those packages import, else its own PyTorch functions. The
kernels are Triton/CUDA only (fla-core 0.6.0 on a CPU tensor: "0 active drivers"), so on CPU the
engine runs transformers' PyTorch functions (the originals the kernel wrappers keep as
``__wrapped__``), swapped in for its own calls only; ``variants["kernels"]`` says what ran.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from pathlib import Path

import torch

from parity.peers.transformers import chosen

from .checked import EngineError

MIN_VERSION = 5
VARIANTS = {"moe_combine": "unbiased", "kv_norm_eps": 1e-6, "kda_gate": "softplus"}
TORCH_DTYPES = ("bfloat16", "float32")
# the model's functions transformers may hand to an outside kernel package at import
KERNEL_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update", "causal_conv1d_forward")


def _import():
    try:
        import transformers  # here: an optional dependency (kimi-parity[peers]), needed by this engine only
    except ImportError:
        raise EngineError("--engine transformers needs transformers>=5 with KimiLinear "
                          "(pip install 'kimi-parity[peers]')") from None
    major = int(transformers.__version__.split(".")[0])
    if major < MIN_VERSION or not hasattr(transformers, "KimiLinearForCausalLM"):
        raise EngineError(f"--engine transformers needs transformers>=5 with KimiLinear; "
                          f"transformers {transformers.__version__} has none (pip install 'kimi-parity[peers]')")
    return transformers


@contextlib.contextmanager
def _torch_functions(module, names: list[str]):
    """transformers' own PyTorch functions in place of the outside kernels ``names``, for one call."""
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, chosen(saved[n])[0])
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


@contextlib.contextmanager
def _quiet(transformers):
    """Loading bars and 'falling back to the PyTorch implementation' notes off for the call."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


class TransformersEngine:
    """transformers' KimiLinear behind the engine protocol (module docstring)."""

    def __init__(self, checkpoint, *, dtype: str, device: str, config):
        if not isinstance(checkpoint, (str, Path)):
            raise EngineError("--engine transformers loads a checkpoint directory (from_pretrained); "
                              "--synthetic weights have none")
        if dtype not in TORCH_DTYPES:
            raise EngineError(f"--engine transformers: dtype {dtype!r}; expected one of {', '.join(TORCH_DTYPES)}")
        self.transformers = tf = _import()
        self.torch, self.config, self.device = torch, config, torch.device(device)
        with _quiet(tf):
            model, info = tf.KimiLinearForCausalLM.from_pretrained(
                str(checkpoint), dtype=getattr(torch, dtype), output_loading_info=True)
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise EngineError(f"--engine transformers: {checkpoint}: transformers found no weight for "
                              f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        self.hf_model = model.to(self.device).eval()
        self._check_layout()
        self._modeling, self._swap, kernels = self._kernels()
        self.variants = {**VARIANTS, "dtype": dtype, "device": str(self.device),
                         "transformers": tf.__version__, "kernels": kernels}
        params = inspect.signature(self.hf_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in 5.2x
        self._trace: dict | None = None
        self._hooks = self._install_hooks()

    def _check_layout(self) -> None:
        hf, c = self.hf_model.config, self.config
        for i in range(c.num_hidden_layers):
            mixer, ffn = c.layer_kind(i)
            theirs = ("kda" if hf.layer_types[i] == "linear_attention" else "mla",
                      "moe" if hf.mlp_layer_types[i] == "sparse" else "dense")
            if theirs != (mixer, ffn):
                raise EngineError(f"--engine transformers reads this config as layer {i} = {theirs[0]} + "
                                  f"{theirs[1]}; the reference reads {mixer} + {ffn}")

    def _kernels(self):
        """(modeling module, outside kernels to swap for transformers' own, what runs per function)."""
        module = importlib.import_module(type(self.hf_model).__module__)
        swap, runs = [], {}
        for name in KERNEL_FUNCTIONS:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            own, impl = chosen(fn)
            where = f"{impl.__module__}.{impl.__name__}"
            if impl is own:
                runs[name] = "transformers (PyTorch)"
            elif self.device.type == "cpu":
                swap.append(name)
                runs[name] = f"transformers (PyTorch), not {where} (a GPU kernel)"
            else:
                runs[name] = where
        return module, swap, runs

    # -- hooks ---------------------------------------------------------------------------------
    def _install_hooks(self) -> list:
        torch = self.torch
        handles = []

        def put(name, fn=lambda out: out):
            def hook(module, args, out):
                if self._trace is not None:
                    x = fn(out[0] if isinstance(out, tuple) else out)
                    self._trace[name] = x.detach().reshape(-1, x.shape[-1]).clone()
            return hook

        def router(i):
            def hook(module, args, out):
                if self._trace is not None:
                    logits, _, ids = out  # (router_logits fp32 [T, E], top-k weights, top-k ids)
                    self._trace[f"layers.{i}.router.scores"] = torch.sigmoid(logits.detach().float()).clone()
                    self._trace[f"layers.{i}.router.ids"] = ids.detach().clone()
            return hook

        base = self.hf_model.model
        for i, layer in enumerate(base.layers):
            handles.append(layer.self_attn.register_forward_hook(put(f"layers.{i}.mixer")))
            handles.append(layer.mlp.register_forward_hook(put(f"layers.{i}.ffn")))
            handles.append(layer.register_forward_hook(put(f"layers.{i}.hidden")))
            if self.config.is_moe_layer(i):
                handles.append(layer.mlp.gate.register_forward_hook(router(i)))
        handles.append(base.norm.register_forward_hook(put("final_norm")))
        return handles

    # -- the protocol --------------------------------------------------------------------------
    def _run(self, ids: list[int], cache, trace: dict | None):
        torch = self.torch
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        self._trace = trace
        try:
            with torch.inference_mode(), _quiet(self.transformers), _torch_functions(self._modeling, self._swap):
                out = self.hf_model(input_ids=x, use_cache=True, **{self._cache_kw: cache})
        finally:
            self._trace = None
        return out.logits[0]

    def prefill(self, token_ids, *, trace: dict | None = None):
        """``(logits [T, vocab], cache)``: a fresh ``DynamicCache``, filled by the call."""
        from transformers.cache_utils import DynamicCache  # optional dependency: see _import

        cache = DynamicCache(config=self.hf_model.config)
        return self._run([int(t) for t in token_ids], cache, trace), cache

    def decode(self, token_id, cache, *, trace: dict | None = None):
        """``(logits [vocab], cache)``; ``cache`` is updated in place."""
        return self._run([int(token_id)], cache, trace)[-1], cache


def load(checkpoint, *, dtype: str, device: str, config) -> TransformersEngine:
    return TransformersEngine(checkpoint, dtype=dtype, device=device, config=config)
