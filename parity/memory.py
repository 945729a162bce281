"""Whether a run fits its devices, asked before it allocates: one ``error:`` line with the numbers
and the ways out (exit 2) instead of an allocator's traceback after a minute of loading.

Two checks, each from exact byte counts of what the run will hold (tests hold them equal to the
loaded tensors' bytes), never from a guess:

- ``check_weights``, before the optimized model loads (``parity diff``, ``golden``, ``capture``,
  the certified twin): its resident weights (``optimized.weights.resident_bytes``) and, where the
  float64 reference runs on the same device, the least the reference holds there (its weight LRU
  and a one-token call, ``reference.memory.call_bytes``), against the device's free memory.
- ``check_batch``, before a corpus prefills its first batch (``parity diff --prompts --batch B``):
  B prompts' caches at their full length (prompt + steps): the optimized engine's
  (``optimized.cache.sequence_bytes``: KDA conv and recurrent state per KDA layer, the paged MLA
  latents per MLA layer, at its dtype) on its device; the float64 reference's
  (``reference.cache.cache_bytes``) and, for an engine that fills traces, the replay's own float64
  caches of the same shapes, on the reference's device. An engine of your own holds caches this
  module cannot count: only the reference's side is counted for it.

Both count what the run must hold at least (activations, the allocator's slack, a twin's caches and
the pool's spare blocks come on top), so a run refused here could not have fit; one that passes and
still runs out is one line as well (``parity.cli.main``). The free-memory source is a parameter
(``free(device) -> bytes or None``; the CLI passes ``args.free_memory``), so a test can say "this
device has 10 GiB" on any machine. Unknown free memory (None) is never refused.
"""
from __future__ import annotations

from typing import Callable

import torch

from kimi.config import PRESETS
from optimized.cache import sequence_bytes
from optimized.weights import resident_bytes
from parity.errors import InputError
from reference.cache import cache_bytes
from reference.executor import free_bytes as free
from reference.memory import call_bytes

FreeMemory = Callable[[str], "int | None"]
GIB = 2 ** 30


def free_bytes(device: str) -> int | None:
    """The real free memory of ``device`` (``cpu``: the host's MemAvailable; ``cuda``: free GPU
    memory plus what torch's allocator holds unused): ``reference.executor.free_bytes``."""
    return free(device)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def weight_bytes(config, dtype: str) -> int:
    """Resident bytes of the optimized model of ``config`` at ``dtype`` (exact)."""
    return resident_bytes(config, getattr(torch, dtype))


def reference_floor(config) -> int:
    """The least the float64 reference holds on its device: its weight LRU and a one-token call
    (a longer call checks its own estimate before it runs, ``reference.memory``)."""
    return call_bytes(config, 1)


def reference_beside(device: str | None, engine_device: str) -> bool:
    """Whether the reference (``--reference-device`` ``device``) will run on ``engine_device``, as
    far as is known before anything loads: ``cpu`` and ``cuda`` as given; ``auto`` without a GPU is
    the CPU; ``auto`` with one is decided by the memory the engine leaves
    (``parity.diff.reference_device.resolve``): not beside."""
    if device in ("cpu", "cuda"):
        return device == engine_device
    if device is None:
        return False
    return engine_device == "cpu" and not torch.cuda.is_available()


def check_weights(config, *, dtype: str, device: str, free: FreeMemory, reference: bool = False,
                  synthetic: str | None = None, what: str = "the optimized model") -> int:
    """``InputError`` (one line: the bytes needed, the bytes free, the ways out) when ``what``'s
    weights at ``dtype`` (and, with ``reference``, the reference's floor beside them) exceed
    ``free(device)``. ``synthetic``: the preset the weights come from (smaller presets that fit
    are named). Returns the bytes needed."""
    need = weight_bytes(config, dtype) + (reference_floor(config) if reference else 0)
    have = free(device)
    if have is None or need <= have:
        return need
    beside = " and the float64 reference's floor beside them" if reference else ""
    where = "host memory available" if device == "cpu" else f"free on {device}"
    raise InputError(f"{what}'s weights ({dtype}){beside} need {gib(need)} on {device}, {gib(have)} {where}; "
                     f"nothing was loaded. Ways out: {'; '.join(_ways_out(config, dtype, device, free, need, synthetic))}")


def _ways_out(config, dtype: str, device: str, free: FreeMemory, need: int, synthetic: str | None) -> list[str]:
    ways = ["a GPU with more memory" if device.startswith("cuda") else "a machine with more memory"]
    if device.startswith("cuda"):
        host = free("cpu")
        if host is not None and host >= need:
            ways.append(f"--device cpu (the host has {gib(host)} available; the Triton interpreter is slow)")
    elif torch.cuda.is_available():
        gpu = free("cuda")
        if gpu is not None and gpu >= need:
            ways.append(f"--device cuda ({gib(gpu)} free)")
    have = free(device) or 0
    if dtype != "bfloat16" and weight_bytes(config, "bfloat16") <= have:
        ways.append(f"--dtype bfloat16 ({gib(weight_bytes(config, 'bfloat16'))} of weights)")
    if synthetic is not None:
        smaller = [(name, weight_bytes(c, dtype)) for name, c in _presets() if name != synthetic]
        fitting = [(name, n) for name, n in smaller if n <= have]
        if fitting:
            name, n = max(fitting, key=lambda x: x[1])
            ways.append(f"a smaller preset (--synthetic {name}: {gib(n)} of weights)")
    return ways


def _presets():
    return PRESETS.items()


def batch_bytes(config, lengths: list[int], *, engine_dtype: str | None, replay: bool) -> tuple[list[int], list[int]]:
    """Per prompt of full length ``lengths[k]`` (prompt + steps): (the engine's cache bytes, 0 for
    an engine whose caches are not counted (``engine_dtype`` None); the reference's float64 cache
    bytes, twice with ``replay``: the replay's caches of the same shapes)."""
    eng = [0 if engine_dtype is None else sequence_bytes(config, n, dtype=getattr(torch, engine_dtype))
           for n in lengths]
    ref = [cache_bytes(config, n) * (2 if replay else 1) for n in lengths]
    return eng, ref


def largest_batch(config, lengths: list[int], *, engine_dtype: str | None, engine_device: str,
                  reference_device: str, replay: bool, free: FreeMemory) -> tuple[int, dict]:
    """The most prompts of ``lengths`` (the longest first: any batch may be those) whose caches fit
    every device at once, and ``{device: (bytes per prompt of the longest, free or None)}``."""
    eng, ref = batch_bytes(config, sorted(lengths, reverse=True), engine_dtype=engine_dtype, replay=replay)
    per = {}
    for device, sizes in ((engine_device, eng), (reference_device, ref)):
        per.setdefault(device, [0] * len(sizes))
        per[device] = [a + b for a, b in zip(per[device], sizes)]
    fits, out = len(lengths), {}
    for device, sizes in per.items():
        have = free(device)
        out[device] = (sizes[0] if sizes else 0, have)
        if have is None:
            continue
        total, k = 0, 0
        for n in sizes:
            if total + n > have:
                break
            total, k = total + n, k + 1
        fits = min(fits, k)
    return fits, out


def check_batch(config, lengths: list[int], batch: int, *, engine_dtype: str | None, engine_device: str,
                reference_device: str, replay: bool, free: FreeMemory, default: bool = False) -> None:
    """``InputError`` when ``batch`` prompts of ``lengths`` cannot hold their caches at once (see
    the module docstring), naming the largest batch that fits. ``default``: ``batch`` was not
    given (the message says so). A batch is refused, never lowered: the run is the one asked for."""
    batch = min(batch, len(lengths))
    fits, per = largest_batch(config, lengths, engine_dtype=engine_dtype, engine_device=engine_device,
                              reference_device=reference_device, replay=replay, free=free)
    if fits >= batch:
        return
    where = "; ".join(f"{gib(n)} a prompt on {d}, {gib(have)} free" for d, (n, have) in per.items() if have is not None)
    if fits == 0:
        raise InputError(f"not even one prompt's caches fit ({where}); nothing was decoded. Ways out: shorter "
                         "prompts or fewer --steps, a device with more memory")
    raise InputError(f"--batch {batch}{' (the default)' if default else ''}: the caches of {batch} prompts of up to {max(lengths)} tokens (prompt + steps) "
                     f"cannot fit ({where}); the largest batch that fits is {fits}: give --batch {fits}")
