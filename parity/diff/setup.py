"""What the ``diff`` and ``golden`` commands share: resolving the checkpoint, loading both models,
encoding the prompt. Every unusable input raises ``InputError`` with
one line that names it (the CLI prints it as ``error: ...`` and exits 2)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import optimized
import reference
from kimi import tokenizer
from kimi.checkpoint import CheckpointError, open_source
from kimi.config import ConfigError, KimiConfig
from kimi.fixtures import default_checkpoint_path
from kimi.synthetic import SyntheticSource
from parity import memory
from parity.diff.engines import BUILTIN, DUMP_PREFIX, CheckedEngine, EngineError, from_factory
from parity.diff.engines import load_engine as builtin
from parity.diff.engines import router_bias
from parity.errors import InputError
from parity.platform import store_rounding

from .logits import LmHeadSpan

BUILTIN_PROMPT = "The quick brown fox jumps over the lazy dog. "
def check_device(device: str | None) -> str:
    """``None`` -> cuda when there is a GPU, else cpu; ``cuda`` without one is an input error. On
    CPU the Triton kernels run under the interpreter, made faithful for bf16 ``tl.dot`` here."""
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available on this machine")
    return optimized.use(device)


def platform_rounding(dtype: str, device: str) -> str:
    """How the platform's kernels round to ``dtype`` ("nearest", or "toward-zero" under the Triton
    interpreter), measured by ``parity.platform.store_rounding``: the bounds of the diff use it."""
    return store_rounding(dtype, device)


@dataclass
class Checkpoint:
    source: object          # a reference WeightSource
    info: dict              # for reports: {"kind", "path" | "preset"+"seed", "describe"}


def checkpoint_errors() -> tuple:
    """What a broken checkpoint raises, also lazily while the reference streams its weights."""
    return (CheckpointError, ConfigError)


def load_errors() -> tuple:
    """What loading raises for unusable input (a bad variant, dtype or device is a ValueError)."""
    return checkpoint_errors() + (ValueError, KeyError, FileNotFoundError)


def open_checkpoint(path: str | None = None, *, synthetic: str | None = None, seed: int = 0) -> Checkpoint:
    """A checkpoint directory, a synthetic preset, or (neither) the bundled default fixture."""
    if synthetic is not None:
        if path is not None:
            raise InputError("give either a CHECKPOINT or --synthetic PRESET, not both")
        try:
            source = SyntheticSource(KimiConfig.from_name(synthetic), seed)
        except load_errors() as exc:
            raise InputError(one_line(exc)) from None
        return Checkpoint(source, {"kind": "synthetic", "preset": synthetic, "seed": seed,
                                   "describe": source.describe()})
    kind = "directory"
    if path is None:
        path, kind = default_checkpoint_path(), "bundled"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unknown extra tensors: listed by describe(), not fatal
            source = open_source(path)
    except load_errors() as exc:
        raise InputError(one_line(exc)) from None
    return Checkpoint(source, {"kind": kind, "path": str(Path(path)), "describe": source.describe()})


def one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def load_reference(ckpt: Checkpoint, variants: dict):
    try:
        return reference.load(ckpt.source, **variants)
    except load_errors() as exc:
        raise InputError(one_line(exc)) from None


def same_model(a: Checkpoint, b: Checkpoint) -> None:
    """``--optimized-from`` must describe the same architecture as the checkpoint."""
    if a.source.config != b.source.config:
        raise InputError(f"{b.info.get('path', b.info['describe'])}: its config differs from "
                         f"{a.info.get('path', a.info['describe'])}; --optimized-from needs the same model")


def tokenizer_for(ckpt: Checkpoint):
    """The checkpoint's tokenizer (its tiktoken model when it ships one), else byte-level."""
    path = ckpt.info.get("path")
    if path is None:  # synthetic weights: no tokenizer files
        return tokenizer.ByteTokenizer(ckpt.source.config)
    return tokenizer.load_tokenizer(path, ckpt.source.config)


def prompt_ids(ckpt: Checkpoint, *, text: str | None, ids: str | None) -> tuple[list[int], str | None, object]:
    """(token ids, prompt text or None, tokenizer or None) from ``--prompt`` / ``--prompt-ids``,
    or the built-in prompt. Ids must lie in ``[0, vocab_size)``."""
    vocab = ckpt.source.config.vocab_size
    tok = None
    try:
        tok = tokenizer_for(ckpt)
    except (ValueError, OSError, ImportError) as exc:  # no tokenizer: fine for --prompt-ids, fatal for text
        if ids is None:
            raise InputError(f"--prompt needs a tokenizer: {one_line(exc)}") from None
    if ids is not None:
        try:
            out = [int(x) for x in ids.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise InputError(f"--prompt-ids {ids!r}: expected comma-separated integers, e.g. 1,2,3") from None
        text = None
    else:
        text = BUILTIN_PROMPT if text is None else text
        out = [int(t) for t in tok.encode(text)]
    if not out:
        raise InputError("the prompt has no tokens")
    bad = [t for t in out if not 0 <= t < vocab]
    if bad:
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
                         + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))
    return out, text, tok


def engine_checkpoint(ckpt: Checkpoint):
    """What an engine's factory is handed: the checkpoint directory (a str), or for --synthetic
    weights the reference ``WeightSource`` (the only way to reach them)."""
    path = ckpt.info.get("path")
    return str(path) if path is not None else ckpt.source


def load_engine(spec: str, ckpt: Checkpoint, *, dtype: str | None, device: str, variants: dict,
                backends: dict, reference_source=None, free=None, reference_device: str | None = None):
    """``--engine SPEC`` (optimized, transformers, dump:PATH, module:factory) over ``ckpt``, behind
    ``CheckedEngine``. ``reference_source``: the reference's weights (its router bias completes
    traces; default: ``ckpt``'s). ``free(device) -> bytes``: the optimized model's weights (and the
    reference's floor where ``reference_device``, the ``--reference-device`` asked for, puts it
    beside them) are checked against it before anything loads (``parity.memory.check_weights``);
    None: not checked."""
    source = reference_source or ckpt.source
    if spec == "optimized" and free is not None:
        check_fits(ckpt, dtype=dtype or "bfloat16", device=device, free=free, reference_device=reference_device)
    try:
        if spec in BUILTIN or spec.startswith(DUMP_PREFIX):
            target = ckpt.source if spec == "optimized" else engine_checkpoint(ckpt)
            engine = builtin(spec, target, dtype=dtype, device=device, variants=variants, backends=backends)
        else:
            if variants or backends:
                raise EngineError(f"--engine {spec}: --variant and --backend apply to the built-in "
                                  "engines; your engine runs its own semantics")
            engine = from_factory(spec, engine_checkpoint(ckpt), dtype=dtype or "bfloat16", device=device)
        return CheckedEngine(engine, source.config, name=spec, bias=router_bias(source))
    except EngineError as exc:
        raise InputError(one_line(exc)) from None
    except load_errors() as exc:
        raise InputError(one_line(exc)) from None


def check_fits(ckpt: Checkpoint, *, dtype: str, device: str, free, reference_device: str | None) -> None:
    """The optimized model of ``ckpt`` at ``dtype`` fits ``device`` before it loads, with the
    reference's floor beside it where the reference will run there (``parity.memory``)."""
    memory.check_weights(ckpt.source.config, dtype=dtype, device=device, free=free,
                         reference=memory.reference_beside(reference_device, device),
                         synthetic=ckpt.info.get("preset"))


def lm_head_span(ckpt: Checkpoint, device: str):
    """The checkpoint's ``LmHeadSpan`` (the logits' own bound, ``parity.diff.logits``) on ``device``."""
    try:
        return LmHeadSpan(ckpt.source, ckpt.source.config, device=device)
    except checkpoint_errors() as exc:
        raise InputError(one_line(exc)) from None
