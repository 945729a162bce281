"""The environment a certificate was made in: versions, device, git revision, backends."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def git_revision() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if rev else None
    except (OSError, subprocess.SubprocessError):
        rev, dirty = None, None
    return {"revision": rev, "dirty": dirty}


def environment(device: str) -> dict:
    import hypothesis
    import numpy
    import torch

    env = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "numpy": numpy.__version__, "torch": torch.__version__, "hypothesis": hypothesis.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(),
        "git": git_revision(),
        "hypothesis_profile": os.environ.get("PARITY_HYPOTHESIS_PROFILE", "ci") or "ci",
        # the float64 reference's executor (the ops run on NumPy unless a command says otherwise)
        "reference": {"executor": "numpy", "device": "cpu", "library": f"numpy {numpy.__version__}"},
    }
    try:
        import optimized

        env["backend_info"] = optimized.backend_info()
    except Exception as exc:  # the optimized package failed to import: the certificate says so
        env["backend_info"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env
