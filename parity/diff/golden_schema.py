"""What a golden file must hold before it is used (``parity.diff.golden.load``): schema, JSON types,
finite numbers, ids inside the vocabulary, and bounds that rounding noise can explain.

A golden is input like any other, and a tampered one must not certify: a bound of Infinity, or
one so large that any logits pass, is an error (exit 2), never a pass; a NaN in ``top_values`` or a
``top_ids`` entry outside the vocabulary is a corrupt file, not a kernel bug.

The bound ceiling. A step's recorded bound is ``e_i + e_j``, the noise of the two tokens' logits
(``parity.classify_step``). Rounding in precision ``u`` through ``L`` layers whose reductions are at
most ``n`` long errs by at most ``L * gamma_n(u)`` relative to the logits (each layer's GEMMs by
``gamma_n``, the norms renormalising between layers; Higham, ASNA 3.1), and a logit's error is never
worth more than the logit itself. So a bound above ``2 * min(1, L * gamma_n(u)) * scale`` is more than
the dtype's noise can explain, with ``scale = max(1, max |top_values|)`` and ``u`` the dtype's unit
roundoff under round-toward-zero (the Triton interpreter's rounding; twice nearest for bf16). The
bundled float32 golden's bounds (the emulated twin's noise, x17 at fp32 for the arithmetic inside the
ops: ``parity.diff.twin``) are 106-448 u * scale, its ceiling about 1,000 u * scale.
"""
from __future__ import annotations

import re

from kimi.config import PRESETS, ConfigError, KimiConfig
from kimi.validate import InvalidInput, as_float, as_int, as_list, as_object, as_path, as_str, field, label
from parity.bounds.core import precision_for
from reference.checks import kda_gate_bound

GOLDEN_FORMAT = "kimi-parity/golden"
GOLDEN_VERSION = 1
MAX_STEPS = 100_000
MAX_TOP_K = 4096
MAX_PROMPT_IDS = 1_000_000
MAX_TEXT = 10_000_000
DTYPES = ("bfloat16", "float32")
KINDS = ("bundled", "synthetic", "directory")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def noise_ceiling(config: KimiConfig, dtype: str, tokens: int, top_values: list[float]) -> float:
    """The largest step bound the rounding noise of ``dtype`` can explain (module docstring);
    ``tokens``: prompt plus decoded tokens (the attention's reduction length)."""
    c = config
    n = max(c.hidden_size, c.intermediate_size, c.moe_intermediate_size * max(1, c.num_shared_experts),
            c.num_attention_heads * c.v_head_dim, c.kda_dim, c.kv_lora_rank, tokens)
    nu = n * precision_for(dtype, rounding="toward-zero").u
    rel = 1.0 if nu >= 0.5 else min(1.0, c.num_hidden_layers * nu / (1.0 - nu))
    scale = max([1.0] + [abs(v) for v in top_values])
    return 2.0 * rel * scale


def _sha256(value, name: str) -> str:
    as_str(value, name, max_len=64)
    if not _SHA256.fullmatch(value):
        raise InvalidInput(f"{name}: expected 64 lowercase hex digits")
    return value


def _checkpoint(info) -> None:
    info = as_object(info, "checkpoint")
    kind = as_str(field(info, "kind", "checkpoint"), "checkpoint.kind", choices=KINDS)
    if kind == "synthetic":
        as_str(field(info, "preset", "checkpoint"), "checkpoint.preset", choices=tuple(PRESETS))
        as_int(field(info, "seed", "checkpoint"), "checkpoint.seed", lo=0, hi=2 ** 32 - 1)
    elif kind == "directory":
        as_path(field(info, "path", "checkpoint"), "checkpoint.path")


def _variants(value) -> None:
    value = as_object(value, "variants")
    for key, v in value.items():
        if key == "moe_combine":
            as_str(v, "variants.moe_combine", choices=("unbiased", "biased"))
        elif key == "kv_norm_eps":
            as_float(v, "variants.kv_norm_eps", lo=0.0, lo_open=True, hi=1.0)
        elif key == "kda_gate":
            try:
                kda_gate_bound(as_str(v, "variants.kda_gate", max_len=64))
            except ValueError:
                raise InvalidInput("variants.kda_gate: expected softplus or lower_bound:<b> with b in [-5, 0)") from None
        else:
            raise InvalidInput(f"variants: unknown variant '{label(key)}'")


def _prompt(value, vocab: int) -> None:
    value = as_object(value, "prompt")
    text = field(value, "text", "prompt", None)
    if text is not None:
        as_str(text, "prompt.text", max_len=MAX_TEXT)
    ids = as_list(field(value, "ids", "prompt"), "prompt.ids", min_len=1, max_len=MAX_PROMPT_IDS)
    for i, t in enumerate(ids):
        as_int(t, f"prompt.ids[{i}]", lo=0, hi=vocab - 1)


def _step(k: int, row, *, vocab: int, k_ids: int) -> None:
    name = f"steps[{k}]"
    row = as_object(row, name)
    if as_int(field(row, "step", name), f"{name}.step") != k:
        raise InvalidInput(f"{name}.step: expected {k} (steps are numbered 0, 1, ... in order)")
    token = as_int(field(row, "token", name), f"{name}.token", lo=0, hi=vocab - 1)
    _sha256(field(row, "logits_sha256", name), f"{name}.logits_sha256")
    ids = as_list(field(row, "top_ids", name), f"{name}.top_ids", min_len=k_ids, max_len=k_ids)
    vals = as_list(field(row, "top_values", name), f"{name}.top_values", min_len=k_ids, max_len=k_ids)
    for i, t in enumerate(ids):
        as_int(t, f"{name}.top_ids[{i}]", lo=0, hi=vocab - 1)
    if len(set(ids)) != len(ids):
        raise InvalidInput(f"{name}.top_ids: an id appears twice")
    if ids[0] != token:
        raise InvalidInput(f"{name}: token {token} is not the first of top_ids (the reference's argmax)")
    for i, v in enumerate(vals):
        as_float(v, f"{name}.top_values[{i}]")
    if any(a < b for a, b in zip(vals, vals[1:])):
        raise InvalidInput(f"{name}.top_values: not in decreasing order")
    as_float(field(row, "bound", name), f"{name}.bound", lo=0.0)


def validate(g) -> dict:
    """``g`` (a parsed golden file) unchanged when it is usable; ``InvalidInput`` naming the first
    field that is not (module docstring)."""
    g = as_object(g, "golden file")
    if g.get("format") != GOLDEN_FORMAT:
        raise InvalidInput(f"not a golden file (format is not {GOLDEN_FORMAT!r})")
    version = g.get("version")
    if version != GOLDEN_VERSION or isinstance(version, bool):
        shown = version if isinstance(version, int) and not isinstance(version, bool) else "missing or not an integer"
        raise InvalidInput(f"golden format version {shown}; this tool reads {GOLDEN_VERSION}")
    _checkpoint(field(g, "checkpoint", "golden file"))
    try:
        config = KimiConfig.from_hub_dict(field(g, "config", "golden file"), source="config")
    except ConfigError as exc:
        raise InvalidInput(str(exc)) from None
    sha = field(g, "weights_sha256", "golden file")
    if sha is not None:
        _sha256(sha, "weights_sha256")
    _variants(field(g, "variants", "golden file"))
    as_object(field(g, "backends", "golden file", {}), "backends")
    dtype = as_str(field(g, "dtype", "golden file"), "dtype", choices=DTYPES)
    vocab = config.vocab_size
    _prompt(field(g, "prompt", "golden file"), vocab)
    top_k = as_int(field(g, "top_k", "golden file"), "top_k", lo=2, hi=MAX_TOP_K)
    steps = as_list(field(g, "steps", "golden file"), "steps", min_len=1, max_len=MAX_STEPS)
    tokens = len(g["prompt"]["ids"]) + len(steps)
    for k, row in enumerate(steps):
        _step(k, row, vocab=vocab, k_ids=min(top_k, vocab))
        ceiling = noise_ceiling(config, dtype, tokens, row["top_values"])
        if row["bound"] > ceiling:
            raise InvalidInput(f"steps[{k}].bound: {row['bound']!r} is more than {dtype} rounding noise "
                               f"can explain (at most {ceiling:.3g} for this model and these logits)")
    return g
