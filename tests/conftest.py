"""Test harness: pytest-xdist workers one per GPU, and the backend chosen for ``--parity-device``.

The device of every test is the parity plugin's ``parity_device`` fixture (``--parity-device``,
default auto: cuda when a GPU is present); the plugin chooses the backend for it
(``optimized.use``): kernels compiled for it, or on the CPU run under the faithful Triton
interpreter.
"""
import os
import subprocess

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # pytest-xdist: each worker gets its share of the cores, not torch's whole pool each
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them, found without
    initialising CUDA (the variable is read once, when CUDA starts)."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return [d.strip() for d in outer.split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in listed.splitlines() if l.startswith("GPU "))]


def _pin_worker_to_one_gpu() -> None:
    """Worker gwN of pytest-xdist sees GPU N mod the visible count (the pattern of Triton's and
    flash-attention's test conftests), so ``pytest -n 8`` on an 8-GPU host uses each GPU once; an
    outer CUDA_VISIBLE_DEVICES is respected (its Nth entry). Before torch initialises CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or _WORKERS < 2:
        return
    gpus = _visible_gpus()
    if len(gpus) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


_pin_worker_to_one_gpu()

