"""The float64 reference in the CLI: where it runs (``--reference-device``), sharing the optimized
model's weights on one GPU, per-layer progress on stderr, and memory errors as one line.

- ``--reference-device cpu``: NumPy on every core. ``cuda``: torch float64 on the GPU; when both
  models load the same checkpoint onto the GPU, the reference reads the optimized model's
  resident weights (``optimized.weights.named_views``): the 48B model's 98 GB of bf16 weights
  once, upcast to float64 layer by layer. ``auto`` (default): ``cuda`` when a GPU is present and
  the reference fits beside the engine (it reads the engine's resident weights, or
  ``AUTO_FREE_BYTES`` are free on the GPU after the engine loaded), else ``cpu``; the run's
  header and report say where it ran.
- progress: a long prefill (``LONG_S`` seconds in, or ``TTY_TOKENS`` tokens on a terminal) prints
  ``reference prefill: layer i/n`` lines on stderr; never on stdout, never in a report.
- memory: a call the reference refuses before allocating (``reference.DoesNotFit``) or a device
  that runs out during the run becomes one ``error:`` line naming what did not fit, how much, and
  what to try (``--reference-device cpu``), exit 2.
"""
from __future__ import annotations

import contextlib
import sys

import torch

import reference
from optimized.weights import named_views
from parity.diff.setup import load_errors, one_line
from parity.errors import InputError, is_out_of_memory, memory_line
from reference import DoesNotFit

DEVICES = ("auto", "cpu", "cuda")
AUTO_FREE_BYTES = 16 << 30  # free GPU memory ``auto`` wants for a reference that reads its weights
# from the checkpoint (a float64 weight LRU, a layer's activations, a long prompt's attention blocks)
LONG_S = 1.0  # a prefill still running after this long reports every layer
TTY_TOKENS = 512  # on a terminal, a prefill of this many tokens reports from its first layer


def resolve(device: str, share=None) -> str:
    """``device`` (cpu, cuda, auto) as cpu or cuda; ``share``: the engine whose resident GPU
    weights the reference would read (``auto`` then takes the GPU)."""
    if device != "auto":
        return device
    if not torch.cuda.is_available():
        return "cpu"
    if _on_gpu(share):
        return "cuda"
    free, _ = torch.cuda.mem_get_info()
    return "cuda" if free >= AUTO_FREE_BYTES else "cpu"


def _on_gpu(model) -> bool:
    return model is not None and str(getattr(model, "device", "")).startswith("cuda")


def load(ckpt, variants: dict, device: str, *, share=None):
    """The reference model of ``ckpt`` on ``device`` (cpu, cuda, auto: ``resolve``); ``share``: an
    optimized model loaded from the same checkpoint whose resident weights the reference reads
    (CUDA only). Progress is attached; ``where(model)`` says where it runs."""
    device = resolve(device, share)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--reference-device cuda: no CUDA device is available on this machine")
    shared = None
    if device == "cuda" and _on_gpu(share):
        shared = named_views(share.weights, ckpt.source.config)
    try:
        model = reference.load(ckpt.source, device=device, shared_weights=shared, **variants)
    except load_errors() as exc:
        raise InputError(one_line(exc)) from None
    model.progress = Progress(sys.stderr)
    return model


def where(model) -> str:
    """cpu or cuda: where the reference ``model`` runs (for ``memory_errors``' advice)."""
    return "cuda" if model.executor.device.startswith("cuda") else "cpu"


def info(model) -> dict:
    """For reports: the executor, its device and library, and whether it shared the weights."""
    out = dict(model.executor.info())
    out["shared_weights"] = model.shares_weights
    return out


class Progress:
    """``model.progress`` callback: per-layer lines on ``stream`` during long prefills."""

    def __init__(self, stream, *, long_s: float = LONG_S, tty_tokens: int = TTY_TOKENS):
        self.stream, self.long_s, self.tty_tokens = stream, long_s, tty_tokens
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, event: dict) -> None:
        if event["call"] == "decode":
            return
        long = event["elapsed_s"] >= self.long_s or (self.tty and event["tokens"] >= self.tty_tokens)
        if long:
            print(f"reference {event['call']}: layer {event['layer']}/{event['layers']} "
                  f"({event['tokens']} tokens, {event['elapsed_s']:.1f} s)", file=self.stream, flush=True)


@contextlib.contextmanager
def memory_errors(reference_device: str, optimized_device: str | None = None):
    """Turn running out of memory into one ``InputError`` line: what did not fit (the engine and
    its call where the engine guard marked it, ``parity.errors.memory_line``) and what to try."""
    try:
        yield
    except DoesNotFit as exc:  # the reference's own estimate, before it allocated
        raise InputError(f"{_one(exc)}; {_hint(reference_device)}") from None
    except (MemoryError, RuntimeError) as exc:  # NumPy, torch on the GPU, torch's CPU allocator
        if not is_out_of_memory(exc):
            raise
        raise InputError(f"{memory_line(exc, gpu=optimized_device)}; {_hint(reference_device)}") from None


def _hint(reference_device: str) -> str:
    if reference_device == "cuda":
        return "try --reference-device cpu (the float64 reference then leaves the GPU to the optimized model) or a shorter prompt"
    return "try a shorter prompt or a machine with more memory"


def _one(exc) -> str:
    return " ".join(str(exc).split())
