"""The environment a certificate was made in: versions, device, git revision, backends."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import hypothesis
import numpy
import torch
import triton

import optimized


def git_revision(root=None, file=None) -> dict:
    """``{"revision", "dirty"}`` of the git work tree holding ``root`` (default: this repository):
    HEAD, and whether tracked files have uncommitted changes or ``file`` (given) is modified or
    untracked. Both None outside a work tree, without git, or when the work tree ignores ``file``
    (a package installed in a virtual environment inside it is not its source)."""
    root = str(root or Path(__file__).resolve().parent.parent)

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        rev = git("rev-parse", "HEAD") or None
        if rev and file is not None and subprocess.run(["git", "-C", root, "check-ignore", "-q", str(file)],
                                                       capture_output=True, timeout=10).returncode == 0:
            rev = None
        dirty = None
        if rev:
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
            if file is not None:
                dirty = dirty or bool(git("status", "--porcelain", "--", str(file)))
    except (OSError, subprocess.SubprocessError):
        rev, dirty = None, None
    return {"revision": rev, "dirty": dirty}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else ``platform.processor()``, else "cpu": the CPU picks
    the BLAS kernels, whose order of sums decides the reference's last bits."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment(device: str) -> dict:
    env = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "numpy": numpy.__version__, "torch": torch.__version__, "hypothesis": hypothesis.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "git": git_revision(),
        "hypothesis_profile": os.environ.get("PARITY_HYPOTHESIS_PROFILE", "ci") or "ci",
        # the float64 reference's executor (the ops run on NumPy unless a command says otherwise)
        "reference": {"executor": "numpy", "device": "cpu", "library": f"numpy {numpy.__version__}"},
    }
    try:
        env["backend_info"] = optimized.backend_info()
    except Exception as exc:  # the backend could not be described: the certificate says so
        env["backend_info"] = {"error": f"{type(exc).__name__}: {exc}"}
    env["triton"] = triton.__version__
    return env
