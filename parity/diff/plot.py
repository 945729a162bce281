"""``parity diff --plot``: one PNG with per-step error and bound, margins, verdicts and router flips;
over a corpus (``--prompts``), one PNG of KL per prompt, units per op and verdicts."""
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
    import matplotlib   # here: only a --plot pays for matplotlib, and the Agg backend is chosen before pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # why: optional: --plot only
    from matplotlib.ticker import MaxNLocator  # why: optional: --plot only

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


RUN_COLORS = {"match": "tab:green", "near-tie": "tab:orange", "past-bound": "tab:purple", "diverged": "tab:red"}


def write_corpus_plot(result, path: str | Path) -> Path:
    """``parity diff --prompts ... --plot``: one PNG over the corpus (a ``corpus.CorpusResult``): KL
    per prompt (mean and max over its steps) coloured by the prompt's verdict; each op's error in
    units of its bound over the prompts (1 = at the bound); the prompts per verdict."""
    import matplotlib   # here: only a --plot pays for matplotlib, and the Agg backend is chosen before pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # why: optional: --plot only

    units = result.op_units()
    names = list(units)
    # one op label per column: the figure widens with the ops (54 at 48B), the labels stand upright
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(max(10.0, 0.2 * len(names)), 9.5),
                                        gridspec_kw={"height_ratios": [3, 3, 2]})
    idx = [p.index for p in result.prompts]
    kl = [[s["kl"] for s in p.steps] for p in result.prompts]
    mean = _pos([np.mean([k for k in ks if k is not None]) if any(k is not None for k in ks) else None
                 for ks in kl])
    top = _pos([max((k for k in ks if k is not None), default=None) for ks in kl])
    colors = [RUN_COLORS[p.verdict] for p in result.prompts]
    ax1.scatter(idx, mean, c=colors, marker="o", s=30, zorder=3, label="mean over steps")
    ax1.scatter(idx, top, c=colors, marker="^", s=30, zorder=3, label="max over steps")
    ax1.set_yscale("log")
    ax1.set_xlabel("prompt")
    ax1.set_ylabel("KL(ref || engine), nats")
    for i, name in enumerate(names):
        vals = _pos([p.units[name][1] for p in result.prompts if name in p.units])
        bad = [p.verdict in ("diverged", "past-bound") for p in result.prompts if name in p.units]
        ax2.scatter(np.full(len(vals), i) + np.linspace(-0.2, 0.2, len(vals)), vals,
                    c=["tab:red" if b else "tab:blue" for b in bad], s=14, alpha=0.7)
    ax2.axhline(1.0, color="black", ls="--", lw=1, label="its bound")
    ax2.set_xticks(range(len(names)))
    upright = len(names) > 16
    ax2.set_xticklabels(names, rotation=90 if upright else 30, ha="center" if upright else "right", fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel("median error / bound")
    if not names:
        ax2.text(0.5, 0.5, "no traces: no op replayed", transform=ax2.transAxes, ha="center", va="center",
                 color="gray")
    counts = result.summary()["verdicts"]
    ax3.bar(list(counts), list(counts.values()), color=[RUN_COLORS[v] for v in counts])
    ax3.set_ylabel("prompts")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"parity diff corpus: {result.line()}", fontsize=9, wrap=True)
    fig.tight_layout()
    try:
        return atomic_write(path, writer=lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
