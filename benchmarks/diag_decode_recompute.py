"""Where a bf16 greedy decode and the recompute path (one forward over the same tokens) pick different
tokens, say why: per differing step, the reference margin between the two tokens against their
logit bounds, each path's worst error in bound units, and the router top-k flips of each path
against the reference at that position (the tests' bound model: tests/optimized/test_model_parity).

    python benchmarks/diag_decode_recompute.py --preset tiny medium --steps 64 [--no-graphs]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(preset: str, steps: int, graphs: bool, device: str) -> None:
    import numpy as np
    import torch

    import optimized
    import reference
    from reference.config import KimiConfig
    from reference.synthetic import SyntheticSource
    from tests.optimized.test_model_parity import PROMPT, lm_head_weight, logit_bound, router_flips

    if device == "cpu":
        optimized.install_faithful_bf16_dot()  # the interpreter's bf16 tl.dot, as on a GPU
    config = KimiConfig.from_name(preset)
    source = SyntheticSource(config, 0)
    model = optimized.load(source, device=device, dtype="bfloat16", cuda_graphs=graphs if device == "cuda" else None)
    logits, cache = model.prefill(PROMPT)
    inc, tokens, dec_traces = [logits[-1]], [int(logits[-1].argmax())], []
    for _ in range(steps - 1):
        tr = {}
        step, cache = model.decode(tokens[-1], cache, trace=tr if not graphs else None)
        dec_traces.append(tr)
        inc.append(step)
        tokens.append(int(step.argmax()))
    ids = PROMPT + tokens[:-1]
    rec_trace, ref_trace = {}, {}
    rec = model.forward(ids, trace=rec_trace)[len(PROMPT) - 1:].double().cpu().numpy()
    inc = torch.stack(inc).double().cpu().numpy()
    ref_all = reference.load(source).forward(ids, trace=ref_trace)
    S0 = len(PROMPT) - 1
    ref = np.asarray(ref_all[S0:])
    bound = logit_bound(config, np.arange(S0, len(ids)) + 1, np.asarray(ref_trace["final_norm"][S0:]),
                        lm_head_weight(source), "bfloat16")
    flips = router_flips(config, ref_trace, rec_trace)
    print(f"== {preset}, {steps} steps, graphs={graphs}: recompute router flips vs reference "
          f"(layer, pos, margin, noise): {flips[:12]}")
    worst_ir = (np.abs(inc - rec) / bound).max(1)
    print(f"   |inc - rec| / bound per step: max {worst_ir.max():.3g} at step {int(worst_ir.argmax())}; "
          f"median {np.median(worst_ir):.3g}")
    diff = [s for s in range(steps) if int(rec[s].argmax()) != tokens[s]]
    print(f"   differing steps: {diff}")
    for s in diff[:8]:
        a, b = tokens[s], int(rec[s].argmax())
        r = ref[s]
        print(f"   step {s} (pos {S0 + s}): inc {a} rec {b} ref {int(r.argmax())}; ref margin r[a]-r[b] "
              f"{r[a] - r[b]:.4g}, bounds {bound[s, a]:.4g} + {bound[s, b]:.4g}; "
              f"inc margin {inc[s, a] - inc[s, b]:.4g}, rec margin {rec[s, a] - rec[s, b]:.4g}; "
              f"worst/bound inc {(np.abs(inc[s] - r) / bound[s]).max():.3g} rec {(np.abs(rec[s] - r) / bound[s]).max():.3g}")
    if not graphs and diff:
        # the incremental path's router decisions against the recompute path's, step by step
        for s in diff[:4]:
            if s == 0:
                continue
            tr, pos = dec_traces[s - 1], S0 + s
            for i in range(config.num_hidden_layers):
                key = f"layers.{i}.router.ids"
                if key in tr:
                    d = sorted(tr[key][0].tolist()), sorted(rec_trace[key][pos].tolist())
                    if d[0] != d[1]:
                        sel_r = rec_trace[f"layers.{i}.router.selection"][pos].double()
                        print(f"     step {s} layer {i}: decode picked {d[0]}, recompute {d[1]}; "
                              f"recompute scores {[round(float(sel_r[e]), 5) for e in set(d[0]) ^ set(d[1])]}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", nargs="+", default=["tiny", "medium"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    for p in args.preset:
        run(p, args.steps, not args.no_graphs, args.device)


if __name__ == "__main__":
    main()
