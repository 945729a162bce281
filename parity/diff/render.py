"""Terminal output of ``parity diff``: the per-step table (rich) and the localization section."""
from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.table import Table

from .runner import DiffResult, StepRecord

STYLE = {"match": "green", "near-tie": "yellow", "diverged": "bold red"}
FULL_TABLE_STEPS = 64  # longer runs show only the steps worth reading


def _num(x: float) -> str:
    return "-" if x is None else f"{x:.3g}"


def _tok(t: int, decode: Callable[[int], str] | None) -> str:
    """The id, and its text when that prints as something (a lone UTF-8 continuation byte does not)."""
    if decode is None:
        return str(t)
    try:
        text = decode(t)
    except Exception:  # a token the tokenizer cannot show on its own is still a token
        return str(t)
    return f"{t} {text!r}" if text.strip() and text.isprintable() and "\ufffd" not in text else str(t)


def _router(s: StepRecord) -> str:
    if not s.router:
        return ""
    shown = [f"L{f.layer}@{f.position} {','.join(map(str, f.swapped_out))}->{','.join(map(str, f.swapped_in))}"
             f" {'noise' if f.within_noise else 'PAST BOUND'}" for f in s.router[:2]]
    more = f" +{len(s.router) - 2}" if len(s.router) > 2 else ""
    return "; ".join(shown) + more


def step_table(result: DiffResult, *, decode: Callable[[int], str] | None = None) -> Table:
    """One row per step (all of them up to 64 steps, else only non-matching steps and router flips)."""
    rows = result.steps
    hidden = 0
    if len(rows) > FULL_TABLE_STEPS:
        keep = [s for s in rows if s.verdict != "match" or s.router or s.nonfinite]
        hidden, rows = len(rows) - len(keep), keep
    table = Table(title=f"parity diff ({result.mode}, {result.dtype})",
                  caption=f"{hidden} matching steps without router flips not shown (--json has all)"
                  if hidden else None)
    for name, justify in (("step", "right"), ("ref", "left"), ("opt", "left"), ("verdict", "left"),
                          ("max|dlogit|", "right"), ("KL", "right"), ("ref gap", "right"),
                          ("margin", "right"), ("bound", "right"), ("router flips", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "router flips")
    for s in rows:
        verdict = s.verdict + (" (router)" if s.cause == "router" else "") + (" *" if s.anchored else "")
        table.add_row(str(s.step), _tok(s.ref_token, decode), _tok(s.opt_token, decode),
                      f"[{STYLE[s.verdict]}]{verdict}[/]", _num(s.max_abs_diff), _num(s.kl),
                      _num(s.ref_gap), "-" if s.verdict == "match" else _num(s.ref_margin),
                      _num(s.bound), _router(s))
    return table


def print_result(result: DiffResult, console: Console, *, decode=None) -> None:
    """The table, the localization of a divergence, free-mode splits; the summary line last."""
    console.print(step_table(result, decode=decode))
    if result.mode == "free":
        console.print("* = split: " + ("the engine's tokens stand (it already ran): the reference followed them"
                                       if result.follow == "engine" else
                                       "the engine was re-anchored to the reference token"))
        for sp in result.splits:
            again = f"re-converged at step {sp['reconverged_at']}" if sp["reconverged_at"] is not None \
                else "did not re-converge"
            console.print(f"split at step {sp['step']} ({sp['verdict']}): {again}")
    loc = result.localization
    if loc is not None:
        where = "the run (no step diverged)" if loc is result.final else f"step {loc.step}"
        # describe() says "not localized: ..." itself when nothing is named
        head = " localized" if loc.localized else " explained" if loc.shown is not None else ""
        console.print(f"{where}{head}: {loc.describe()}", markup=False)
        if loc.nonfinite:
            console.print(f"first NaN/Inf in the optimized path: {loc.nonfinite['name']}", markup=False)
        if loc.backend_hint:
            console.print(f"confirm: rerun with {loc.backend_hint} (that family then runs the reference "
                          "math on the optimized side)", markup=False)
        worst = sorted(loc.entries, key=lambda e: -max(e.units, e.spike_units))[:3]
        console.print("each check on the engine's own inputs, in units of its bound (largest, level or worst "
                      "position): " + ", ".join(f"{e.name} {max(e.units, e.spike_units):.3g}" for e in worst),
                      markup=False)
    nonfinite = next((s for s in result.steps if s.nonfinite), None)
    if nonfinite is not None and (loc is None or not loc.nonfinite):
        console.print(f"first NaN/Inf: step {nonfinite.step}, {nonfinite.nonfinite['name']}", markup=False)
    console.print(f"noise that may excuse a token flip: {result.twin}", markup=False)
    console.print(result.summary()["line"], markup=False, highlight=False, soft_wrap=True)  # one line: greppable
