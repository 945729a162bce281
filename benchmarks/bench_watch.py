"""What watching costs an engine: a 4k-token prefill of transformers' KimiLinearForCausalLM, plain and
inside ``parity.watch`` at its two KDA entry points, with ``max_bytes=0`` (shapes only) and with the
tensors kept (host copies of every input and output).

    python benchmarks/bench_watch.py                      # CPU: transformers' torch KDA, bundled checkpoint
    python benchmarks/bench_watch.py --device cuda        # GPU: fla-core's kernels when installed

Runs alternate (plain, watched, plain, ...) so that drift of a shared machine falls on both; the
figures are medians over ``--repeats`` of each, of the process's CPU time and of wall time. A
watched run is one ``with parity.watch(...)`` block around one prefill, split into its three
parts: entering the watch (the wrappers are in place from the warm-up's block, which made the
one pass over the loaded modules; they stay between blocks, so the plain runs go through them
too, passing calls straight through), the prefill inside the running watch (what watching costs an
engine's work: the wrappers, host copies), and leaving it (the calls file written, a kept run's
tensors with it). A watch around a whole generation or server run pays the first and the last once. On a machine shared with other work
the CPU figures swing by tens of percent from run to run, far more than a watch costs; there the
figure of record is the time the engine's calls spent inside the recorder during the watched
prefill (``Recorder.spent``: every wrapper's work before and after the call, host copies queued
included), against the plain prefill's wall time, and the per-call cost of a watch on a stub that
returns at once. On the CPU the KDA functions are transformers' own torch code (fla-core's kernels
need a GPU): the ones a CPU run watches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
TARGETS = {"kda.chunked": f"{MODULE}:chunk_kimi_delta_attention",
           "kda.recurrent": f"{MODULE}:recurrent_kimi_delta_attention"}


def load(checkpoint: str, device: str, dtype: str):
    import importlib

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    mod = importlib.import_module(MODULE)
    if device == "cpu":
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
            fn = getattr(mod, name)
            setattr(mod, name, getattr(fn, "__wrapped__", fn))
    model = transformers.KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def prefill(model, ids, device):
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return out.logits


def _stub(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, **kwargs):
    """A function with transformers' chunked KDA signature that returns at once: what a watch adds
    to a call, without the call."""
    return value, initial_state


def per_call(tokens: int, calls: int, max_bytes: int) -> tuple[float, float]:
    """(seconds per call of ``_stub`` plain, watched with ``max_bytes``), CPU time, on a prefill's
    shapes (the bundled checkpoint's KDA layers: H=2, K=V=32)."""
    import parity
    from parity.record.watch import same_as

    same_as(TARGETS["kda.chunked"])(_stub)
    me = sys.modules[__name__]
    x = torch.randn(1, tokens, 2, 32, dtype=torch.bfloat16)
    args = (x, x, x, x, x[..., 0])
    kw = {"initial_state": torch.zeros(1, 2, 32, 32), "output_final_state": True, "use_qk_l2norm_in_kernel": True}

    def loop():
        c0 = time.process_time()
        for _ in range(calls):
            me._stub(*args, **kw)
        return (time.process_time() - c0) / calls

    plain = min(loop() for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        with parity.watch({"kda.chunked": f"{__name__}:_stub"}, out=Path(tmp) / "s.safetensors",
                          max_bytes=max_bytes, quiet=True):
            watched = min(loop() for _ in range(3))
    return plain, watched


def main(argv=None) -> int:
    import parity
    from kimi.fixtures import default_checkpoint_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(default_checkpoint_path()))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = load(args.checkpoint, args.device, args.dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(args.device)
    prefill(model, ids, args.device)                       # warm-up
    kda_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    times = {"plain": [], "shapes only (max bytes 0)": [], "tensors kept": []}
    walls = {m: [] for m in times}
    inside = {m: [] for m in times}     # seconds spent in the recorder during the watched prefill
    parts = {m: {"enter": [], "prefill": [], "exit": []} for m in times}
    with tempfile.TemporaryDirectory() as tmp:
        with parity.watch(TARGETS, out=Path(tmp) / "warm.safetensors", max_bytes=2 << 30, quiet=True):
            prefill(model, ids, args.device)                # warm-up: the watch's own first imports
        for r in range(args.repeats):
            for mode in times:
                t0, c0 = time.perf_counter(), time.process_time()
                if mode == "plain":
                    prefill(model, ids, args.device)
                    t1 = t2 = t0
                else:
                    budget = 0 if mode.startswith("shapes") else 2 << 30
                    with parity.watch(TARGETS, out=Path(tmp) / f"{r}.safetensors", max_bytes=budget,
                                      quiet=True) as rec:
                        t1 = time.perf_counter()
                        prefill(model, ids, args.device)
                        t2 = time.perf_counter()
                    inside[mode].append(rec.spent)
                    calls = sum(rec.called.values())
                    if calls < kda_layers:     # else the figures would time a watch that sees nothing
                        print(f"error: the watched prefill made {calls} watched call(s) for {kda_layers} KDA "
                              "layers: the watch does not see this engine's KDA calls", file=sys.stderr)
                        raise SystemExit(2)
                times[mode].append(time.process_time() - c0)
                t3 = time.perf_counter()
                walls[mode].append(t3 - t0)
                for part, sec in (("enter", t1 - t0), ("prefill", t2 - t1), ("exit", t3 - t2)):
                    parts[mode][part].append(sec)
    base = statistics.median(times["plain"])
    wbase = statistics.median(walls["plain"])
    rows = {m: {"cpu_s": statistics.median(t), "overhead": statistics.median(t) / base - 1,
                "wall_s": statistics.median(walls[m]), "wall_overhead": statistics.median(walls[m]) / wbase - 1,
                "in_recorder_s": statistics.median(inside[m]) if inside[m] else 0.0,
                **({} if m == "plain" else
                   {"enter_s": statistics.median(parts[m]["enter"]), "exit_s": statistics.median(parts[m]["exit"]),
                    "prefill_in_watch_s": statistics.median(parts[m]["prefill"]),
                    "prefill_in_watch_overhead": statistics.median(parts[m]["prefill"]) / wbase - 1})}
            for m, t in times.items()}
    print(f"prefill of {args.tokens} tokens, {args.device}, {args.dtype}, median of {args.repeats} "
          f"({torch.get_num_threads()} torch threads):")
    for m, r in rows.items():
        print(f"  {m:28s} cpu {r['cpu_s'] * 1e3:9.1f} ms {100 * r['overhead']:+6.2f} %   "
              f"wall {r['wall_s'] * 1e3:9.1f} ms {100 * r['wall_overhead']:+6.2f} %   "
              f"in the recorder {r['in_recorder_s'] * 1e3:8.3f} ms ({100 * r['in_recorder_s'] / wbase:.4f} % "
              "of the plain wall time)")
        if m != "plain":
            print(f"  {'':28s} = enter {r['enter_s'] * 1e3:.2f} ms + prefill in the running watch "
                  f"{r['prefill_in_watch_s'] * 1e3:.2f} ms ({100 * r['prefill_in_watch_overhead']:+.2f} % of plain) "
                  f"+ exit {r['exit_s'] * 1e3:.2f} ms (the calls file written)")
    plain, watched = per_call(args.tokens, 2000, 0)
    kda_calls = sum(t == "linear_attention" for t in model.config.layer_types)
    added = (watched - plain) * kda_calls
    print(f"per watched call (max bytes 0): {1e6 * (watched - plain):.1f} us of CPU time ({1e6 * plain:.2f} us plain); "
          f"{kda_calls} KDA calls per prefill: {1e3 * added:.3f} ms, {100 * added / base:.4f} % of the plain prefill")
    rows["per call"] = {"plain_s": plain, "watched_s": watched, "calls_per_prefill": kda_calls,
                        "overhead": added / base}
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "device": args.device, "dtype": args.dtype,
                                               "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
