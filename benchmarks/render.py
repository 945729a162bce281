"""The measured tables of docs/BENCHMARKS.md, from benchmark JSON files (``harness.save``'s format):
one table per file, each row with ours, the peer, the floor, the ratios and the command that
reproduces it.

    python3 benchmarks/render.py benchmarks/results/kda.json benchmarks/results/mla.json ...

Times in ms. "ours" is the eager call (the Python call and Triton's launcher included), "graph" the
CUDA-graph replay (how a decode step runs it). ``ours / floor`` takes the graph replay where there
is one; ``peer / ours`` compares eager with eager (the peers run eagerly).
"""
from __future__ import annotations

import json
import sys

#: the parameters that vary within a benchmark's rows (the others are in its heading)
SHAPE = {"kda.fused_chunked": ("B", "T"), "kda.fused_recurrent_decode": ("B",), "mla.paged_decode": ("B", "S"),
         "moe.layer": ("B",), "conv.short_conv": ("B", "T", "C"), "conv.short_conv_step_": ("B", "C"),
         "norm.gated_rms_norm": ("T", "H", "V"), "model.decode_step": ("B",), "model.load": ("preset",)}


def command(op: str, p: dict) -> str:
    """The command that measures the row (its script also measures the others named there)."""
    if op == "kda.fused_chunked":
        return f"bench_kda.py --decode-B --prefill-T {p['T'] if p['B'] == 1 else ''}".rstrip()
    if op == "kda.fused_recurrent_decode":
        return f"bench_kda.py --prefill-T --decode-B {p['B']}"
    if op == "model.decode_step":
        return f"bench_model.py --batch {p['B']} --steps {p.get('steps', 32)}"
    if op == "model.load":
        return "bench_model.py"
    family = op.split(".")[0]
    return f"bench_ops.py --only {family}" if family in ("conv", "norm", "mla", "moe") else ""


def _ms(x) -> str:
    if x is None:
        return "–"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def row(r: dict) -> str:
    p = r["params"]
    shape = ", ".join(f"{k}={p[k]}" for k in SHAPE.get(r["op"], tuple(p)) if k in p)
    peer = r.get("fla_ms") if r.get("fla_ms") is not None else r.get("baseline_ms")
    graph = (r.get("extra") or {}).get("graph_ms")
    ours, floor = r.get("ours_ms"), r.get("floor_ms")
    return (f"| {r['op']} | {shape} | {_ms(ours)} | {_ms(graph)} | {_ms(peer)} | {_ms(floor)} | "
            f"{_ratio(graph or ours, floor)} | {_ratio(peer, ours)} | `{command(r['op'], p)}` |")


def render(paths: list[str]) -> str:
    out = []
    for path in paths:
        payload = json.loads(open(path).read())
        env = payload["environment"]
        peers = sorted({"fla-core" if r.get("fla_ms") is not None else r.get("baseline") or "–"
                        for r in payload["results"]})
        out.append(f"{path}: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
                   f"fla {env.get('fla')}; peer: {', '.join(peers)}.\n")
        out.append("| op | shape | ours | graph | peer | floor | ours / floor | peer / ours | command |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        out += [row(r) for r in payload["results"]]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1:]))
