"""The JSON report of ``parity diff`` (schema: ``docs/diff-report-schema.json``) and atomic writes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

REPORT_FORMAT = "kimi-parity/diff-report"
REPORT_VERSION = 1


def atomic_write(path: str | Path, data: bytes | str | None = None, *, writer=None) -> Path:
    """Write ``data`` (or call ``writer(file)``) to a temporary file beside ``path``, then rename it
    over ``path``: a reader sees the old file or the whole new one, never half of it, and a failure
    leaves no partial file behind."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if writer is not None:
                writer(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def environment(*, device: str, dtype: str) -> dict:
    """What ran (``parity.environment``: versions, device, git revision, how Triton ran) plus the
    optimized dtype."""
    from parity.environment import environment as _environment

    env = _environment(device)
    env["dtype"] = dtype
    return env


def build_report(result, *, checkpoint: dict, config, variants: dict, env: dict, prompt: dict,
                 backends: dict, optimized_checkpoint: dict | None = None) -> dict:
    """The report dict of one ``run_diff`` result (see docs/diff-report-schema.json)."""
    loc = result.localization
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "checkpoint": checkpoint,
        "optimized_checkpoint": optimized_checkpoint,
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


def write_json(path: str | Path, report: dict) -> Path:
    return atomic_write(path, json.dumps(report, indent=1, allow_nan=False) + "\n")
