"""What a call of the float64 model reports besides its logits: progress and the KDA core's trace.

``model.progress``, when set, is called after every layer with ``{"call", "layer", "layers",
"tokens", "elapsed_s"}`` (``LayerProgress``). With ``model.trace_kda_core`` a trace also receives,
per KDA layer, the core's own inputs after the fused prologue, the state it started from and the
gated norm's output (``trace_kda_core``): the localization's bound replays the recurrence on them.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from . import kda
from .executor import device_of


class LayerProgress:
    """Calls ``callback`` (if any) after each of ``layers`` layers of a ``call`` on ``tokens`` tokens."""

    def __init__(self, callback: Callable[[dict], None] | None, call: str, layers: int, tokens: int):
        self.callback, self.call, self.layers, self.tokens = callback, call, layers, tokens
        self.t0 = time.perf_counter()

    def done(self, i: int) -> None:
        """Layer ``i`` (0-based) has run."""
        if self.callback is not None:
            self.callback({"call": self.call, "layer": i + 1, "layers": self.layers,
                           "tokens": self.tokens, "elapsed_s": time.perf_counter() - self.t0})


def trace_kda_core(trace: dict, i: int, parts: list, initial_state, xp) -> None:
    """Layer ``i``'s KDA core inputs (l2-normalized q, k, the log decay g, beta, and v) over the
    call's segments ``parts`` (each ``(prologue args, v, normed)``), the state it started from
    (``initial_state`` ``[HV, K, V]``, None: zeros) and the gated norm's output, into ``trace``."""
    cores = [kda._prologue(*args) + (v,) for args, v, _ in parts]
    p = f"layers.{i}.kda."
    for n, j in (("q", 0), ("k", 1), ("g", 2), ("beta", 3), ("v", 4)):
        trace[p + n] = xp.concat([c[j][0] for c in cores], axis=0)
    trace[p + "normed"] = xp.concat([o for _, _, o in parts], axis=0)
    HV, K, V = trace[p + "g"].shape[1], trace[p + "g"].shape[2], trace[p + "v"].shape[2]
    trace[p + "initial_state"] = (xp.zeros((HV, K, V), dtype=xp.float64, device=device_of(trace[p + "v"]))
                                  if initial_state is None else initial_state)
