"""Regenerate the measured tables of docs/BENCHMARKS.md from benchmark JSON files.

    python benchmarks/render.py results/*.json > docs/benchmarks-tables.md
"""
from __future__ import annotations

import json
import sys


def _fmt(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}"


def render(paths: list[str]) -> str:
    out = []
    for path in paths:
        payload = json.loads(open(path).read())
        env = payload["environment"]
        out.append(f"### `{payload['command']}`\n")
        out.append(f"Device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
                   f"fla {env.get('fla')}, revision `{(env.get('git_revision') or 'n/a')[:12]}`.\n")
        out.append("| op | shape | ours (ms) | p20–p80 | comparator (ms) | floor (ms) | ours / floor | comparator / ours | notes |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in payload["results"]:
            shape = ", ".join(f"{k}={v}" for k, v in r["params"].items())
            comp = r.get("fla_ms") if r.get("fla_ms") is not None else r.get("baseline_ms")
            comp_name = "fla" if r.get("fla_ms") is not None else (r.get("baseline") or "")
            spread = r.get("ours_spread_ms")
            floor = r.get("floor_ms")
            ours = r.get("ours_ms")
            notes = r.get("notes", "")
            if r.get("extra"):
                notes = (notes + " " + ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}"
                                                 for k, v in r["extra"].items())).strip()
            out.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["op"], shape, _fmt(ours), f"{_fmt(spread[0])}–{_fmt(spread[1])}" if spread else "–",
                f"{_fmt(comp)} {comp_name}".strip() if comp is not None else "–", _fmt(floor, 4),
                _fmt(ours / floor, 2) if ours and floor else "–",
                _fmt(comp / ours, 2) if comp and ours else "–", notes))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1:]))
