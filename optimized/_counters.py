"""Launch counters: every public optimized op records itself here, so a parity check can prove the
optimized kernel actually ran (no silent fallback to torch or to the reference)."""
from __future__ import annotations

from collections import Counter

launches: Counter[str] = Counter()


def record(op: str) -> None:
    """Call once per public op invocation, e.g. ``record("kda.chunked")``."""
    launches[op] += 1


def snapshot() -> Counter[str]:
    return Counter(launches)


def reset() -> None:
    launches.clear()
