"""``parity diff --plot``: one PNG with per-step error and bound, margins, verdicts and router flips."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .report import atomic_write
from .runner import DiffResult

COLORS = {"match": "tab:green", "near-tie": "tab:orange", "diverged": "tab:red"}
MARKERS = {"match": "o", "near-tie": "^", "diverged": "X"}


def _pos(values) -> np.ndarray:
    """Log axes cannot show 0 or None: those become NaN (a gap in the line)."""
    a = np.array([np.nan if v is None else v for v in values], dtype=float)
    return np.where(a > 0, a, np.nan)


def write_plot(result: DiffResult, path: str | Path, *, moe_layers: list[int] | None = None,
               title: str = "") -> Path:
    """Three panels over the steps: max |logit diff| with the noise bound; the reference margin with
    the bound and a marker per verdict; router flips by MoE layer (in noise / past their bound).
    Written atomically (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([s.step for s in result.steps])
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 2]})
    ax1.plot(steps, _pos([s.max_abs_diff for s in result.steps]), color="tab:blue", lw=1,
             label="max |logit diff|")
    ax1.plot(steps, _pos([s.bound for s in result.steps]), color="black", ls="--", lw=1,
             label="noise bound")
    ax1.set_yscale("log")
    ax1.set_ylabel("logits")
    ax2.plot(steps, _pos([s.ref_gap for s in result.steps]), color="tab:purple", lw=1,
             label="reference top-1 - top-2 gap")
    ax2.plot(steps, _pos([s.bound for s in result.steps]), color="black", ls="--", lw=1,
             label="noise bound")
    ax2.set_yscale("log")
    ax2.set_ylabel("margin")
    for verdict in COLORS:
        sel = [s for s in result.steps if s.verdict == verdict]
        if sel:
            # a match sits on the gap line; a flip at its margin between the two tokens
            ax2.scatter([s.step for s in sel], _pos([s.ref_gap if verdict == "match" else s.ref_margin
                                                     for s in sel]),
                        c=COLORS[verdict], marker=MARKERS[verdict], s=36, zorder=3,
                        label=f"{verdict} ({len(sel)})")
    flips = [(s.step, f) for s in result.steps for f in s.router]
    for within, color, label in ((True, "tab:orange", "router flip in noise"),
                                 (False, "tab:red", "router flip past bound")):
        pts = [(st, f.layer) for st, f in flips if f.within_noise == within]
        if pts:
            ax3.scatter(*zip(*pts), c=color, marker="s", s=30, label=f"{label} ({len(pts)})")
    ax3.set_ylabel("MoE layer")
    ax3.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    ax3.xaxis.set_major_locator(MaxNLocator(integer=True))
    layers = sorted(set(moe_layers or []) | {f.layer for _, f in flips})
    if layers:
        ax3.set_yticks(layers)
        ax3.set_ylim(layers[0] - 0.5, layers[-1] + 0.5)
    if not flips:
        ax3.text(0.5, 0.5, "no router flips", transform=ax3.transAxes, ha="center", va="center",
                 color="gray")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title or f"parity diff ({result.mode}, {result.dtype}): {result.summary()['line']}",
                 fontsize=9, wrap=True)
    fig.tight_layout()
    try:
        return atomic_write(path, writer=lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
