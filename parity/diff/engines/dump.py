"""The ``dump:PATH`` engine: a safetensors file of per-step logits (and optional traces) that any
engine, in any language, writes; read back and replayed through the engine protocol.

Format: docs/dump-format.md (the container of ``parity.files``, header schema
``parity/schemas/dump.schema.json``); a writer that needs only NumPy and safetensors:
``parity/diff/engines/dump_writer.py``. Everything is validated when the file is opened, before the
reference runs: the header (format, version, config, prompt, dtype, mode, steps), every tensor's
name, dtype and shape, token ids inside the vocabulary. The replay checks the rest as it goes: the
prompt it is handed is the dump's, and in forced mode each token the diff feeds is the one the dump
consumed (else the dump did not follow the plan). Every problem is a ``DumpError`` (an
``EngineError``) with one line naming the file.

``record(engine, path, ...)`` runs a Python engine through a plan (or greedily) and writes its dump.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from kimi.config import ConfigError, KimiConfig
from kimi.validate import label
from parity import files

from .checked import EngineError
from .dump_writer import write_dump
from .trace import expected, optional, widths

FORMAT = "kimi-parity/dump"
VERSION = 1
METADATA_KEY = files.METADATA_KEY
LOGIT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
INT_DTYPES = ("I64", "I32")
MODES = ("forced", "free")
MAX_STEPS = 100_000  # as parity diff --steps (parity.cli.args.MAX_STEPS)


class DumpError(EngineError):
    """A dump that cannot be used (one line naming the file)."""


DUMP = files.Format(FORMAT, VERSION, schema="dump", noun="dump", error=DumpError)


def _header(path: Path) -> tuple[dict, dict]:
    """(the header JSON, {tensor name: TensorInfo}): the container's checks (``parity.files``: the
    safetensors layout, strict JSON, format, version, schema ``parity/schemas/dump.schema.json``),
    then a prompt and a step count within bounds."""
    got = files.read_header(path, DUMP)
    if not got.head["prompt_ids"] or got.head["steps"] > MAX_STEPS:
        raise DumpError(f"{path}: header: expected a prompt and 1 to {MAX_STEPS} steps")
    return got.head, got.tensors


def read_header(path) -> dict:
    """The dump's header JSON (``prompt_ids``, ``mode``, ``dtype``, ``steps``, ...), validated, without
    reading its tensors: a folder of dumps is listed as a corpus before any is loaded."""
    return _header(Path(path))[0]


def _same_config(path: Path, theirs: dict, config) -> None:
    try:
        ran = KimiConfig.from_hub_dict(theirs, source=f"{path}: header config")
    except ConfigError as exc:
        raise DumpError(str(exc)) from None
    # the weights' storage dtype in config.json is no part of the model: the header's dtype says how it ran
    differs = [f for f in config.__dataclass_fields__ if f != "torch_dtype" and getattr(ran, f) != getattr(config, f)]
    if differs:
        field = differs[0]
        what = "another vocabulary" if field == "vocab_size" else "another config"
        raise DumpError(f"{path}: the dump ran {what}: {field} {getattr(ran, field)!r}, the checkpoint has "
                        f"{getattr(config, field)!r}")


class DumpEngine:
    """A dump replayed through the engine protocol. ``prompt_ids``, ``tokens`` (``[steps]``: the token
    consumed at each step, ``tokens[0]`` the last prompt token), ``mode``, ``dtype``, ``steps``,
    ``traced`` and ``engine_name`` come from the file."""

    def __init__(self, path, config):
        self.path = path = Path(path)
        if not path.is_file():
            raise DumpError(f"{path}: no such dump file")
        head, infos = _header(path)
        _same_config(path, head["config"], config)
        self.config, self.engine_name = config, head.get("engine") or ""
        self.prompt_ids, self.mode = list(head["prompt_ids"]), head["mode"]
        self.dtype, self.steps = head["dtype"], head["steps"]
        self.variants = {"dtype": self.dtype, "dump": str(path)}
        self._check_tensors(infos)
        self.tensors = self._load(list(infos))
        self.tokens = [int(t) for t in self.tensors.pop("tokens").tolist()]
        self.logits = self.tensors.pop("logits")
        # read back as float32 (exact); the diff judges their storage against the run's dtype
        self.stored_logits_dtype = LOGIT_DTYPES[infos["logits"].dtype]
        self._check_tokens()
        self.traced = bool(self.tensors)

    # -- validation ----------------------------------------------------------------------------
    def _check_tensors(self, infos: dict) -> None:
        c, path, N = self.config, self.path, self.steps
        rows = len(self.prompt_ids) - 1 + N
        need, extra, width = expected(c), optional(c), widths(c)
        want = {"logits": ((N, c.vocab_size), LOGIT_DTYPES), "tokens": ((N,), INT_DTYPES)}
        traced = [k for k in infos if k in need]
        if traced and len(traced) < len(need):
            first = next(k for k in need if k not in infos)
            raise DumpError(f"{path}: traces are all or nothing: {first} is missing")
        for name in (*need, *extra):
            if name in infos:
                kinds = INT_DTYPES if name.endswith(".ids") else tuple(LOGIT_DTYPES)
                want[name] = ((rows, width[{**need, **extra}[name]]), kinds)
        for name in infos:
            if name not in want:
                raise DumpError(f"{path}: unknown tensor '{label(name)}' (names: docs/dump-format.md)")
        for name, (shape, kinds) in want.items():
            if name not in infos:
                raise DumpError(f"{path}: no {name!r} tensor")
            got = infos[name]
            if got.shape != shape:
                why = " (a missing step?)" if name in ("logits", "tokens") and got.shape[:1] != (N,) else ""
                raise DumpError(f"{path}: {name}: shape {got.shape}, expected {shape}{why}")
            if got.dtype not in kinds:
                raise DumpError(f"{path}: {name}: dtype {got.dtype}, expected one of {', '.join(kinds)}")

    def _load(self, names: list[str]) -> dict:
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {n: f.get_tensor(n) for n in names}
        except (SafetensorError, OSError) as exc:
            raise DumpError(f"{self.path}: cannot read its tensors ({' '.join(str(exc).split())})") from None

    def _check_tokens(self) -> None:
        V, path = self.config.vocab_size, self.path
        for what, ids in (("prompt_ids", self.prompt_ids), ("tokens", self.tokens)):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise DumpError(f"{path}: {what}: token id {bad[0]} is outside the vocabulary [0, {V})")
        if self.tokens[0] != self.prompt_ids[-1]:
            raise DumpError(f"{path}: tokens[0] is {self.tokens[0]}; it is the token consumed at step 0, "
                            f"the last prompt token {self.prompt_ids[-1]}")
        for name, t in self.tensors.items():
            if name.endswith(".ids") and t.numel() and not (0 <= int(t.min()) and int(t.max()) < self.config.num_experts):
                raise DumpError(f"{path}: {name}: expert id outside [0, {self.config.num_experts})")

    # -- the protocol --------------------------------------------------------------------------
    def _trace(self, trace: dict | None, lo: int, hi: int) -> None:
        if trace is not None:
            trace.update({name: t[lo:hi] for name, t in self.tensors.items()})

    def prefill(self, token_ids, *, trace: dict | None = None):
        ids = [int(t) for t in token_ids]
        if ids != self.prompt_ids:
            raise DumpError(f"{self.path}: the dump's prompt ({len(self.prompt_ids)} tokens) is not the "
                            f"one given ({len(ids)} tokens)")
        self._trace(trace, 0, len(ids))
        return self.logits[0], 0

    def decode(self, token_id, step: int, *, trace: dict | None = None):
        k = step + 1
        if k >= self.steps:
            raise DumpError(f"{self.path}: the dump holds {self.steps} steps; step {k} was asked for")
        if int(token_id) != self.tokens[k]:
            raise DumpError(f"{self.path}: step {k} consumed token {self.tokens[k]}, but the plan has "
                            f"{int(token_id)} (the reference's greedy token): the dump did not follow the "
                            "plan (write one with parity diff CKPT --plan plan.json)")
        pos = len(self.prompt_ids) - 1 + k
        self._trace(trace, pos, pos + 1)
        return self.logits[k], k


def _host(x) -> np.ndarray:
    """A tensor or array as NumPy: floats as float32 (exact for bf16 and fp16), ids as int64."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return (x.float() if x.is_floating_point() and x.dtype != torch.float64 else x).numpy()
    return np.asarray(x)


def record(engine, path, *, config, dtype: str, prompt_ids: list[int], steps: int,
           tokens: list[int] | None = None, name: str = "") -> Path:
    """Run ``engine`` (the protocol) and write its dump to ``path``: forced on ``tokens`` (a plan's,
    ``[steps]``, ``tokens[0]`` the last prompt token) or, without them, greedy on its own argmax
    (mode ``free``). ``dtype``: the engine's compute dtype, for the header. Traces are written when
    the engine fills them."""
    prompt = [int(t) for t in prompt_ids]
    fed = [prompt[-1]]
    traces: dict[str, list] = {}
    rows = []

    def keep(logits, trace):
        rows.append(_host(logits).reshape(-1, config.vocab_size)[-1])
        for k, v in trace.items():
            v = _host(v)
            traces.setdefault(k, []).append(v.reshape(-1, v.shape[-1]))

    trace: dict = {}
    logits, cache = engine.prefill(prompt, trace=trace)
    keep(logits, trace)
    for k in range(1, steps):
        fed.append(int(tokens[k]) if tokens is not None else int(np.argmax(rows[-1])))
        trace = {}
        logits, cache = engine.decode(fed[-1], cache, trace=trace)
        keep(logits, trace)
    return write_dump(path, config=config.to_hub_dict(), prompt_ids=prompt, tokens=fed,
                      logits=np.stack(rows), dtype=dtype,
                      mode="forced" if tokens is not None else "free", engine=name,
                      traces={k: np.concatenate(v) for k, v in traces.items()})
