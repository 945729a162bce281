"""The JSON report of ``parity diff`` (schema: ``docs/diff-report-schema.json``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from parity.atomic import atomic_write  # noqa: F401  (re-exported for plot, golden, the CLI)
from parity.environment import environment as _environment

REPORT_FORMAT = "kimi-parity/diff-report"
REPORT_VERSION = 3  # 3: ops replayed on the engine's inputs, the certified twin's noise


def environment(*, device: str, dtype: str) -> dict:
    """What ran (``parity.environment``: versions, device, git revision, how Triton ran) plus the
    optimized dtype."""
    env = _environment(device)
    env["dtype"] = dtype
    return env


def build_report(result, *, checkpoint: dict, config, variants: dict, env: dict, prompt: dict,
                 backends: dict, optimized_checkpoint: dict | None = None, engine: str = "optimized") -> dict:
    """The report dict of one ``run_diff`` result (see docs/diff-report-schema.json). ``engine``: the
    ``--engine`` spec that was held to the reference."""
    loc = result.localization
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "checkpoint": checkpoint,
        "optimized_checkpoint": optimized_checkpoint,
        "engine": {"name": engine, "traced": result.traced, "follow": result.follow},
        "config": config.to_hub_dict(),
        "variants": variants,
        "backends": backends,
        "environment": env,
        "prompt": prompt,
        "mode": result.mode,
        "steps": [s.to_dict() for s in result.steps],
        "splits": result.splits,
        "localization": loc.to_dict() if loc is not None else None,
        "summary": result.summary(),
    }


def _json_safe(x):
    """JSON has no NaN/Inf: every non-finite number anywhere in the report is written as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: str | Path, report: dict) -> Path:
    return atomic_write(path, json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")
