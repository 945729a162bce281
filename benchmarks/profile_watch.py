"""Where a watch's time goes: one ``with parity.watch(...)`` block around a prefill (bench_watch.py's
model, targets and prefill), split into entering the watch, the prefill inside it and leaving it,
with the host's own profile of the block (cProfile, the watch's functions) and the device calls
the block makes (torch.profiler: synchronizations and copies, against a plain prefill's).

    python benchmarks/profile_watch.py --device cuda [--tokens 4096] [--out DIR] [--bench-json PATH]

Prints a table per mode; with ``--out``, writes ``profile-<mode>.txt`` (the cProfile listing);
with ``--bench-json``, runs bench_watch.py first in the same process (the kernels compiled and
tuned once) and writes its figures there.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# device calls that make the host wait, or move bytes
COUNTED = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
           "cudaMemcpyAsync", "cudaHostAlloc", "cudaEventRecord", "aten::_local_scalar_dense", "aten::copy_")


def block(mode: str, model, ids, device: str, tmp: Path, n: int):
    """Run one block of ``mode``; (enter, prefill, exit) seconds."""
    import parity
    from bench_watch import TARGETS, prefill

    t0 = time.perf_counter()
    if mode == "plain":
        prefill(model, ids, device)
        return 0.0, time.perf_counter() - t0, 0.0
    with parity.watch(TARGETS, out=tmp / f"{mode}{n}.safetensors", max_bytes=0 if mode == "shapes" else 2 << 30,
                      quiet=True):
        t1 = time.perf_counter()
        prefill(model, ids, device)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def device_calls(fn) -> dict:
    """name -> (count, host ms) of the COUNTED calls ``fn()`` makes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    out = Counter()
    ms = Counter()
    for e in prof.events():
        if e.name in COUNTED:
            out[e.name] += 1
            ms[e.name] += e.cpu_time_total / 1e3
    return {k: (out[k], ms[k]) for k in out}


def main(argv=None) -> int:
    from bench_watch import load, prefill
    from kimi.fixtures import default_checkpoint_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(default_checkpoint_path()))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--bench-json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.bench_json:
        import bench_watch

        bench_watch.main(["--checkpoint", args.checkpoint, "--device", args.device, "--tokens", str(args.tokens),
                          "--repeats", str(args.repeats), "--json", args.bench_json])
        sys.stdout.flush()
    model = load(args.checkpoint, args.device, "bfloat16")
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    prefill(model, ids, args.device)
    import parity

    print(f"profile of one watch block around a {args.tokens}-token prefill, {args.device}, parity from "
          f"{Path(parity.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mode in ("plain", "shapes", "kept"):
            block(mode, model, ids, args.device, tmp, -1)                   # warm
            splits = sorted((block(mode, model, ids, args.device, tmp, i) for i in range(args.repeats)),
                            key=sum)
            enter, pre, leave = splits[len(splits) // 2]
            print(f"{mode:7s} block {1e3 * (enter + pre + leave):8.2f} ms = enter {1e3 * enter:7.2f} + prefill "
                  f"{1e3 * pre:7.2f} + exit {1e3 * leave:7.2f} (median of {args.repeats})")
            calls = device_calls(lambda: block(mode, model, ids, args.device, tmp, 100))
            print("        device calls: " + ", ".join(f"{k} {c} ({ms:.2f} ms)" for k, (c, ms) in sorted(calls.items())))
            pr = cProfile.Profile()
            pr.enable()
            block(mode, model, ids, args.device, tmp, 200)
            pr.disable()
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
            lines = [ln for ln in text.getvalue().splitlines() if "parity" in ln or "synchron" in ln
                     or "fsync" in ln or "{method 'to'" in ln or "get_referrers" in ln]
            print("        cProfile (cumulative, the watch's own functions):")
            for ln in lines[:14]:
                print("         " + ln.strip())
            if args.out:
                Path(args.out, f"profile-{mode}.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
