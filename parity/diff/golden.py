"""Golden files: the reference's answer, frozen, so CI can hold the optimized path to it without
recomputing the float64 reference.

``record`` decodes ``steps`` tokens on both paths (forced mode, exactly as ``parity diff``) and keeps,
per step, the reference's greedy token, the SHA-256 of its float64 logits (little-endian bytes: a
re-recording on any machine must reproduce it bit for bit), the ``top_k`` largest reference logits
with their ids, and the noise bound of that step (``classify_step``'s bound at record time, at the
recorded dtype, from the certified twin's noise: ``parity.diff.noise``, never the engine's own). A run with a diverged step is not recorded: a golden
certifies the optimized path as it was when it agreed with the reference.

``check`` runs only the optimized path, teacher-forced on the golden tokens, and compares:

* tokens, byte for byte: the optimized greedy token must be the golden one. A different token is a
  ``near-tie`` when the golden top-k holds it and the reference's margin between the two is within
  the step's bound, else ``diverged``;
* values, against the bound: ``max |opt[id] - golden[id]|`` over the top-k ids must not exceed the
  step's recorded bound (``diverged`` otherwise).

File format (JSON, ``format`` = "kimi-parity/golden", ``version`` = 1): ``checkpoint`` (what was
loaded: kind, path or preset+seed), ``config`` (hub dict), ``weights_sha256`` (over every tensor's
name, storage dtype, shape and stored bytes; null above 1 GiB), ``variants``, ``backends``,
``dtype``, ``environment``, ``prompt`` {text, ids}, ``top_k``, ``steps[]`` {step, token,
logits_sha256, top_ids, top_values, bound}, ``summary``. Floats are written with Python's ``repr``,
which reads back to the same double. ``load`` checks all of it before use (``parity.diff.golden_schema``):
a corrupt or tampered golden is unusable input, never a verdict on the kernels.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kimi.checkpoint import RAW_NUMPY
from kimi.validate import InvalidInput, read_json_file
from parity.diff import run_diff
from parity.diff.golden_schema import GOLDEN_FORMAT, GOLDEN_VERSION, validate
from parity.diff.numerics import finite_or_none
from parity.diff.report import atomic_write
from parity.metrics import to_numpy

TOP_K = 16
FINGERPRINT_MAX_BYTES = 1 << 30
MAX_GOLDEN_BYTES = 256 << 20  # 100,000 steps of top-16 logits: ~100 MB


class GoldenError(ValueError):
    """A golden file that cannot be used (wrong format or version, malformed)."""


def logits_digest(logits: np.ndarray) -> str:
    """SHA-256 of a logit vector as little-endian float64 bytes."""
    return hashlib.sha256(np.ascontiguousarray(logits, dtype="<f8").tobytes()).hexdigest()


def weights_fingerprint(source) -> str | None:
    """SHA-256 over every tensor (name, storage dtype, shape, stored bytes), in name order; None when
    the weights exceed 1 GiB (reading them all would cost more than the check)."""
    names = sorted(source.names())
    total = 0
    for n in names:
        total += math.prod(source.shape(n)) * RAW_NUMPY[source.storage_dtype(n)].itemsize
    if total > FINGERPRINT_MAX_BYTES:
        return None
    h = hashlib.sha256()
    for n in names:
        raw = np.ascontiguousarray(source.get_raw(n))
        h.update(f"{n}|{source.storage_dtype(n)}|{tuple(source.shape(n))}\n".encode())
        h.update(raw.tobytes())
    return h.hexdigest()


def _top(logits: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    k = min(k, logits.shape[0])
    ids = np.argsort(-logits, kind="stable")[:k]
    return [int(i) for i in ids], [float(logits[i]) for i in ids]


def record(ref_model, opt_model, prompt_ids: list[int], *, config, steps: int, dtype: str,
           rounding: str = "nearest", top_k: int = TOP_K, on_step: Callable | None = None) -> tuple[dict, object]:
    """Decode on both paths and return ``(golden steps + summary, DiffResult)``; the caller adds the
    header (``make_golden``). Refuses nothing itself: the caller decides what a diverged run means."""
    kept: dict[int, dict] = {}

    def keep(step, r, o):
        ids, vals = _top(r, top_k)
        kept[step] = {"logits_sha256": logits_digest(r), "top_ids": ids, "top_values": vals}

    result = run_diff(ref_model, opt_model, prompt_ids, config=config, steps=steps, mode="forced",
                      dtype=dtype, rounding=rounding, on_step=on_step, on_logits=keep, twin_every_step=True)
    rows = [{"step": s.step, "token": s.ref_token, **kept[s.step], "bound": s.bound} for s in result.steps]
    return {"top_k": top_k, "steps": rows}, result


def make_golden(body: dict, *, checkpoint: dict, config, weights_sha256: str | None, variants: dict,
                backends: dict, dtype: str, environment: dict, prompt: dict, summary: dict) -> dict:
    return {"format": GOLDEN_FORMAT, "version": GOLDEN_VERSION, "checkpoint": checkpoint,
            "config": config.to_hub_dict(), "weights_sha256": weights_sha256, "variants": variants,
            "backends": backends, "dtype": dtype, "environment": environment, "prompt": prompt,
            **body, "summary": summary}


def write(path: str | Path, golden: dict) -> Path:
    return atomic_write(path, json.dumps(golden, indent=1, allow_nan=False) + "\n")


def load(path: str | Path) -> dict:
    """Read and validate a golden file (``GoldenError`` names the file and the field)."""
    path = Path(path)
    if not path.exists():
        raise GoldenError(f"{path}: no such golden file")
    try:
        g = read_json_file(path, max_bytes=MAX_GOLDEN_BYTES)
    except InvalidInput as exc:
        raise GoldenError(f"{str(exc).replace(': not valid JSON', ': not a JSON golden file', 1)}") from None
    try:
        return validate(g)
    except InvalidInput as exc:
        raise GoldenError(f"{path}: {exc}") from None


@dataclass
class GoldenStep:
    step: int
    token: int          # golden (reference) token
    opt_token: int
    verdict: str        # match | near-tie | diverged
    max_abs_diff: float # over the golden top-k ids
    bound: float
    margin: float | None  # reference margin golden token vs opt token (None: opt token not in top-k)
    reason: str | None = None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["max_abs_diff"] = finite_or_none(self.max_abs_diff)
        return d


@dataclass
class GoldenCheck:
    steps: list[GoldenStep] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        v = [s.verdict for s in self.steps]
        return "diverged" if "diverged" in v else ("near-tie" if "near-tie" in v else "match")

    def summary_line(self) -> str:
        n = len(self.steps)
        c = {k: sum(s.verdict == k for s in self.steps) for k in ("match", "near-tie", "diverged")}
        line = f"golden: {c['match']}/{n} steps match, {c['near-tie']} near-tie, {c['diverged']} diverged"
        bad = next((s for s in self.steps if s.verdict == "diverged"), None)
        if bad is not None:
            line += f" (first: step {bad.step}, {bad.reason})"
        return line


def check(golden: dict, opt_model, *, vocab_size: int, steps: int | None = None,
          on_step: Callable | None = None) -> GoldenCheck:
    """Run the optimized path forced on the golden tokens; compare tokens (exact) and the top-k values
    (within each step's bound). The reference is not run. ``steps``: check only the first ones."""
    prompt = [int(t) for t in golden["prompt"]["ids"]]
    out = GoldenCheck()
    cache = None
    for row in golden["steps"][:steps]:
        step = row["step"]
        if step == 0:
            logits, cache = opt_model.prefill(prompt)
        else:
            logits, cache = opt_model.decode(int(golden["steps"][step - 1]["token"]), cache)
        o = to_numpy(logits).reshape(-1, vocab_size)[-1]
        ids, vals, bound = np.asarray(row["top_ids"]), np.asarray(row["top_values"], dtype=float), row["bound"]
        err = float(np.max(np.abs(o[ids] - vals))) if np.all(np.isfinite(o[ids])) else math.inf
        opt_token = int(np.argmax(o)) if np.all(np.isfinite(o)) else -1
        margin, verdict, reason = None, "match", None
        if opt_token != row["token"]:
            where = np.flatnonzero(ids == opt_token)
            if where.size:
                margin = float(vals[list(ids).index(row["token"])] - vals[where[0]])
            if margin is not None and margin <= bound:
                verdict = "near-tie"
            else:
                verdict = "diverged"
                reason = (f"token {opt_token} != golden {row['token']}, margin "
                          + (f"{margin:.3g} > bound {bound:.3g}" if margin is not None else "beyond the golden top-k"))
        if verdict != "diverged" and not err <= bound:
            verdict, reason = "diverged", f"top-{len(ids)} logits off by {err:.3g} > bound {bound:.3g}"
        rec = GoldenStep(step=step, token=int(row["token"]), opt_token=opt_token, verdict=verdict,
                         max_abs_diff=err, bound=float(bound), margin=margin, reason=reason)
        out.steps.append(rec)
        if on_step is not None:
            on_step(rec)
    return out
