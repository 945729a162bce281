"""Speed and memory of the float64 reference at the kimi-linear-48b scale, and the GPU suite that
measures every target of docs/BENCHMARKS.md "The float64 reference" in one device call.

    python benchmarks/reference_model.py decode [--device cuda] [--share] [--prefill-tokens 32768] [--batch B] [--profile STEPS]
    python benchmarks/reference_model.py cpu-checkpoint [--experts 16] [--dir /dev/shm/kimi48b-e16]
    python benchmarks/reference_model.py cli -- diff --synthetic kimi-linear-48b --device cuda ...
    python benchmarks/reference_model.py corpus [--prompts 100] [--steps 128] [--batch 32] [--out DIR] [--report-every 60]
    python benchmarks/reference_model.py corpus-shards [--prompts 16] [--steps 16] [--batch 16] [--shards 2] [--shard-batch 8]
    python benchmarks/reference_model.py gpu-suite --out $OUT [--budget 470]

Each prints (and ``--json`` writes) one JSON object. ``decode``: the 48B model (synthetic weights;
with ``--share`` the optimized bf16 model is loaded first on the same GPU and the reference reads
its weights), a prompt prefill, then timed decode steps of the reference (and of the optimized
model), peak GPU and host memory; ``--prefill-tokens N`` adds a reference prefill of N tokens
(last-position logits) beside the resident optimized model. ``cpu-checkpoint``: the CPU target,
"a decode step from a checkpoint": a machine with 64 GB of disk cannot hold the 98 GB checkpoint,
so this writes the 48B model with ``--experts`` routed experts per layer instead of 256 (same
shapes; every token still reads 8 routed experts + the shared one per layer: the same per-token
work, except the router GEMV over 16 rows instead of 256, 0.5% of the step's weights) to a RAM
disk and times NumPy decode steps from it on every core (``--batch B``: and one ``decode_batch`` of
B sequences against their B ``decode`` calls). ``cli``: a ``parity`` command in this
process, timed, with its peak GPU and host memory. ``corpus``: ``parity diff --prompts`` over
a corpus of random prompts (8 to 64 tokens) of the preset's synthetic model, end to end, its
report and plot written beside the result. ``corpus-shards``: that corpus whole and as shards,
and whether the shards' merge equals the whole report. ``gpu-suite``: all of it under a wall-time
budget, each part in its own process under a timeout, results in ``$OUT/reference-gpu-suite.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CFG_48B = "kimi-linear-48b"


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def _gpu_peak() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"gpu_peak_allocated_GB": torch.cuda.max_memory_allocated() / 1e9,
            "gpu_peak_reserved_GB": torch.cuda.max_memory_reserved() / 1e9,
            "gpu_total_GB": torch.cuda.get_device_properties(0).total_memory / 1e9}


def _gpu_allocated(*, reset: bool = False, peak: bool = False) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def _sync(ex):
    ex.synchronize()
    return time.perf_counter()


def _ids(vocab: int, n: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, n)


# -- decode: the reference (and the optimized model) at 48B -------------------------------------------

OPT_STEPS = 11  # the optimized model's decode steps timed beside the reference's (the first is warm-up)


def cmd_decode(args) -> dict:
    import numpy as np

    import reference
    from kimi.config import KimiConfig
    from kimi.synthetic import SyntheticSource

    cfg = KimiConfig.from_name(args.preset)
    src = SyntheticSource(cfg, 0)
    out = {"part": "decode", "preset": args.preset, "device": args.device, "share": args.share}
    opt = shared = None
    if args.share:
        import optimized
        from optimized.weights import named_views

        optimized.use(args.device)
        t0 = time.perf_counter()
        opt = optimized.load(src, device=args.device, dtype="bfloat16")
        shared = named_views(opt.weights, cfg)
        out["optimized_load_s"] = time.perf_counter() - t0
    ref = reference.load(src, device=args.device, shared_weights=shared,
                         weight_cache_bytes=args.weight_cache_mb << 20)
    ex = ref.executor
    out["executor"] = ex.info()
    ids = _ids(cfg.vocab_size, args.prompt_tokens + max(3 * (args.steps + 1), OPT_STEPS) + args.profile + 8)
    t0 = _sync(ex)
    _, cache = ref.prefill(ids[:args.prompt_tokens], logits="last")
    out["ref_prefill_s"] = _sync(ex) - t0
    at = {"t": args.prompt_tokens, "cache": cache}

    def steps(n):
        # host_issue: when the step's last check began, i.e. the host had issued all its work
        # (against the wall: whether the host or the device sets the pace)
        times, issued, verify = [], [], ref._w.verify
        for _ in range(n):
            marks = []
            ref._w.verify = lambda: (marks.append(time.perf_counter()), verify())[1]
            t0 = _sync(ex)
            try:
                _, at["cache"] = ref.decode(int(ids[at["t"]]), at["cache"])
            finally:
                ref._w.verify = verify
            times.append(_sync(ex) - t0)
            issued.append(marks[-1] - t0)
            at["t"] += 1
        return {"first": times[0], "median": statistics.median(times[1:]), "steps": times[1:],
                "host_issue_median": statistics.median(issued[1:])}
    # the step as a user gets it (CUDA graphs where the model has them: the first step eager, the
    # second captured), then eagerly on the same machine
    out["ref_decode_s"] = steps(args.steps + 1)
    graphs = ref.graphs
    if graphs is not None:
        out["graphs"] = {"parts": len(graphs), "disabled": graphs.disabled}
        out["host_syncs_graphed"] = _sync_sites(lambda: steps(2))
        if args.profile and ex.device != "cpu":  # the replayed kernels: what the device itself spends
            try:
                out["profile_graphed"] = _kernels(ex, lambda: steps(2), 1)
            except Exception as exc:
                out["profile_graphed"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        ref.graphs = None
        out["ref_decode_eager_s"] = steps(args.steps + 1)
        ref.graphs = graphs
    cache = at["cache"]
    if opt is not None:
        import torch

        ol, oc = opt.prefill([int(i) for i in ids[:args.prompt_tokens]])
        times = []
        for t in range(args.prompt_tokens, args.prompt_tokens + OPT_STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ol, oc = opt.decode(int(ids[t]), oc)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["optimized_decode_ms"] = statistics.median(times[1:]) * 1e3
        del ol, oc
    if args.batch > 1:
        out["decode_batch"] = _decode_batch(ref, cfg, args.batch, args.prompt_tokens, args.profile)
    if args.profile:  # the eager step's parts (a graph replays them out of the profiler's sight)
        graphs, ref.graphs = ref.graphs, None
        out["profile"] = _profile_decode(ref, ids, at["t"], cache, args.profile)
        ref.graphs = graphs
    out.update(_gpu_peak())  # decode-phase peaks (the long prefill below resets the counter)
    if args.prefill_tokens:
        n = args.prefill_tokens
        out["long_prefill"] = {"tokens": n, "estimate_GB": ref.memory_estimate(n, logits="last") / 1e9,
                               "free_GB": (ex.free_bytes() or 0) / 1e9}
        long_ids = _ids(cfg.vocab_size, n, 1)
        base = _gpu_allocated(reset=True)
        held = {}

        def prefill():
            held["logits"], _ = ref.prefill(long_ids, logits="last")
        try:
            prof = _profiled(ref, prefill, 1, parts=PREFILL_PARTS, kernels=False)
            logits = held["logits"]
            out["long_prefill"]["s"] = prof["wall_ms_per_step"] / 1e3
            out["long_prefill"]["parts_s"] = {k: v / 1e3 for k, v in prof["parts_ms_per_step"].items()}
            # the estimate must bound what the call really held at its peak
            out["long_prefill"]["measured_peak_GB"] = (_gpu_allocated(peak=True) - base) / 1e9
            out["long_prefill"]["finite"] = bool(np.isfinite(ex.to_numpy(logits)).all())
        except (MemoryError, RuntimeError) as exc:  # DoesNotFit, or torch's OutOfMemoryError
            out["long_prefill"]["error"] = " ".join(str(exc).split())[:400]
        out["long_prefill"].update(_gpu_peak())
    out["host_peak_rss_GB"] = _rss_gb()
    return out


# -- where a reference decode step's time goes ---------------------------------------------------------

PROFILED = ("_embed", "_kda_step", "_mla_step", "_moe", "_dense", "_lm_head")  # a decode step's parts
PREFILL_PARTS = ("_embed", "_kda", "_mla", "_moe", "_dense", "_lm_head",  # a prefill's, and inside them
                 "_kda_in", "_kda_out", "_route", "_experts_out")  # (these counted in their layer's too)


def _profile_decode(ref, ids, start: int, cache, steps: int) -> dict:
    """Where ``steps`` decode steps of ``ref`` spend their time (``_profiled``)."""
    state = {"cache": cache, "t": start}

    def step():
        _, state["cache"] = ref.decode(int(ids[state["t"]]), state["cache"])
        state["t"] += 1
    return _profiled(ref, step, steps)


def _profiled(ref, step, steps: int, *, parts: tuple = PROFILED, kernels: bool = True) -> dict:
    """Where ``steps`` calls of ``step()`` (a reference decode step, or a prefill with ``parts =
    PREFILL_PARTS``) spend their time: the wall seconds of each of the model's ``parts`` (the
    executor synchronized around every call, so the parts add up to the step), of the weight
    fetches and products inside them (``weights``: the LRU, the bf16 -> float64 upcast, on the host
    or the device, and ``linear``'s products) and of the end-of-call finiteness check (``verify``);
    then, with ``kernels`` on CUDA, the device's kernels under torch.profiler: kernels per step,
    device-busy milliseconds per step against the wall, and the top kernels by device time; and
    where one step makes the host wait on the device (``_sync_sites``)."""
    import torch

    ex = ref.executor
    spent: dict[str, float] = {}

    def timed(name, fn):
        def run(*a, **k):
            t0 = _sync(ex)
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + _sync(ex) - t0
        return run

    class TimedWeights:
        def __init__(self, w):
            self._inner = w

        def __call__(self, name):
            return timed("weights", self._inner)(name)

        def __getattr__(self, attr):
            a = getattr(self._inner, attr)
            return timed(attr if attr == "verify" else "weights", a) if attr in ("verify", "rows", "linear") else a

    saved = {n: getattr(ref, n) for n in parts}
    saved_w = ref._w
    for n in parts:
        setattr(ref, n, timed(n.lstrip("_").removesuffix("_step"), saved[n]))
    ref._w = TimedWeights(saved_w)
    try:
        t0 = _sync(ex)
        for _ in range(steps):
            step()
        wall = _sync(ex) - t0
    finally:
        for n, f in saved.items():
            setattr(ref, n, f)
        ref._w = saved_w
    out = {"steps": steps, "wall_ms_per_step": wall / steps * 1e3,
           "parts_ms_per_step": {k: v / steps * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
           "note": "parts timed with a device sync around every call; weights and verify are inside the parts"}
    if not kernels or ex.device == "cpu" or not torch.cuda.is_available():
        return out
    try:
        out["profiler"] = _kernels(ex, step, max(1, min(steps, 3)))
    except Exception as exc:  # a profiler that cannot run here costs this figure, not the part's others
        out["profiler"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        out["host_syncs"] = _sync_sites(step)
    except Exception as exc:
        out["host_syncs"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def _sync_sites(step) -> dict:
    """Where one call of ``step()`` makes the host wait for the device (torch's sync debug mode:
    ``.item()``, ``bool()``, ``.tolist()``, copies to the host), counted by the innermost line of this
    repository's code on the stack: the waits a CUDA graph of the step would have to remove."""
    import collections
    import traceback
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()
    root = str(ROOT)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(root) and "/benchmarks/" not in f.filename]
        at = frames[-1] if frames else None
        sites[f"{Path(at.filename).relative_to(root)}:{at.lineno} {at.name}" if at else "elsewhere"] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return {"per_step": sum(sites.values()), "sites": dict(sites.most_common(20))}


def _kernels(ex, step, n: int) -> dict:
    """torch.profiler over ``n`` calls of ``step()`` on CUDA: kernels and device-busy time per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = _sync(ex)
        for _ in range(n):
            step()
        wall = _sync(ex) - t0
    events = prof.key_averages()

    def dev(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # the kernels themselves: an op (aten::copy_) also carries its kernels' device time, which would
    # count that time twice
    kernels = [e for e in events if dev(e) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy_us = sum(dev(e) for e in kernels)
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaMemcpyAsync", "cudaMemcpy"))
    return {
        "steps": n, "wall_ms_per_step": wall / n * 1e3, "device_busy_ms_per_step": busy_us / n / 1e3,
        "kernels_per_step": sum(e.count for e in kernels) / n, "copies_and_syncs_per_step": syncs / n,
        "top": [{"name": e.key[:90], "calls_per_step": e.count / n, "device_ms_per_step": dev(e) / n / 1e3}
                for e in sorted(kernels, key=dev, reverse=True)[:25]]}


# -- the CPU target: decode steps from a checkpoint on a RAM disk ---------------------------------

def _reduced_config(preset: str, experts: int, layers: int | None = None):
    """``preset`` with ``experts`` routed experts per layer, and its first ``layers`` layers only
    (every layer keeps its kind: KDA or MLA, dense or MoE)."""
    from kimi.config import KimiConfig

    cfg = dataclasses.replace(KimiConfig.from_name(preset), num_experts=experts)
    if layers is None or layers >= cfg.num_hidden_layers:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=layers,
                               kda_layers=tuple(i for i in cfg.kda_layers if i <= layers),
                               full_attn_layers=tuple(i for i in cfg.full_attn_layers if i <= layers))


def _write_checkpoint(cfg, directory: Path) -> float:
    """The synthetic model of ``cfg`` as a sharded bf16 checkpoint (generated on the GPU when there
    is one: the same bits as NumPy's, without the host's hashing). Returns the seconds it took."""
    from kimi.checkpoint import save_checkpoint
    from kimi.synthetic import SyntheticSource
    from kimi.tensors import storage_dtype

    src = SyntheticSource(cfg, 0)
    raw = _gpu_raw(src) or src.get_raw

    class Lazy(dict):
        def __iter__(self):
            return iter(src.names())

        def __getitem__(self, name):
            return raw(name)

    t0 = time.perf_counter()
    save_checkpoint(directory, cfg, Lazy(), dtypes=storage_dtype, shard_max_bytes=4 << 30, overwrite=True)
    return time.perf_counter() - t0


def _gpu_raw(src):
    """``name -> storage bits`` (uint16 for bf16) generated on the GPU, or None without one."""
    import numpy as np

    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from optimized.synthetic import DeviceGenerator

    gen = DeviceGenerator(src, "cuda")

    def raw(name):
        t = gen(name).cpu()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    return raw


def cmd_cpu_checkpoint(args) -> dict:
    import numpy as np

    import reference
    from reference.executor import cpu_count

    cfg = _reduced_config(args.preset, args.experts, args.layers)
    directory = Path(args.dir)
    if shutil.disk_usage(directory.parent).free < 3 * _checkpoint_bytes(cfg):  # a small /dev/shm
        directory = Path(tempfile.gettempdir()) / directory.name
    out = {"part": "cpu-checkpoint", "preset": args.preset, "experts": args.experts,
           "layers": cfg.num_hidden_layers, "dir": str(directory), "cores": cpu_count()}
    if _config_of(directory) != cfg:  # none there yet, or another model's
        out["write_s"] = _write_checkpoint(cfg, directory)
    out["checkpoint_GB"] = sum(f.stat().st_size for f in directory.iterdir()) / 1e9
    ref = reference.load(directory, weight_cache_bytes=args.weight_cache_mb << 20)
    out["executor"] = ref.executor.info()
    ids = _ids(cfg.vocab_size, args.prompt_tokens + args.steps)
    t0 = time.perf_counter()
    _, cache = ref.prefill(ids[:args.prompt_tokens], logits="last")
    out["prefill_s"] = time.perf_counter() - t0
    steps, layers = [], []
    ref.progress = lambda p: layers[-1].append(p["elapsed_s"])
    for t in range(args.prompt_tokens, len(ids)):
        layers.append([])
        t0 = time.perf_counter()
        logits, cache = ref.decode(int(ids[t]), cache)
        steps.append(time.perf_counter() - t0)
        layers[-1].append(steps[-1])
    ref.progress = None
    out["decode_s"] = {"median": statistics.median(steps), "steps": steps}
    out["decode_layers_s"] = _layer_breakdown(cfg, layers)
    if args.batch > 1:
        out["decode_batch"] = _decode_batch(ref, cfg, args.batch, args.prompt_tokens, args.profile)
    if args.sweep:
        out["stream_sweep"] = _stream_sweep(ref.source, cfg)
    out["finite"] = bool(np.isfinite(logits).all())
    out["host_peak_rss_GB"] = _rss_gb()
    if args.cleanup:
        shutil.rmtree(directory, ignore_errors=True)
    return out


BATCH_REPEATS = 5  # decode_batch calls timed: the best and the median


def _decode_batch(ref, cfg, B: int, prompt_tokens: int, profile: int = 0) -> dict:
    """Seconds of one ``decode_batch`` of B sequences (prompts of 1..2x ``prompt_tokens`` tokens;
    the best and the median of ``BATCH_REPEATS``) against their B ``decode`` calls (once), and
    whether every row is bitwise its decode, on any executor (synchronized around each timing);
    ``profile``: also where that many ``decode_batch`` calls spend their time (``_profiled``)."""
    import numpy as np

    ex = ref.executor
    rng = np.random.default_rng(1)
    caches = [ref.prefill(_ids(cfg.vocab_size, int(n), seed=b), logits="last")[1]
              for b, n in enumerate(rng.integers(1, 2 * prompt_tokens + 1, B))]
    tokens = [int(t) for t in rng.integers(0, cfg.vocab_size, B)]
    t0 = _sync(ex)
    rows = [ex.to_numpy(ref.decode(t, c)[0]) for t, c in zip(tokens, caches)]
    alone = _sync(ex) - t0
    batch = []
    for _ in range(BATCH_REPEATS):
        t0 = _sync(ex)
        logits, _ = ref.decode_batch(tokens, caches)
        batch.append(_sync(ex) - t0)
    logits = ex.to_numpy(logits)
    out = {"B": B, "alone_s": alone, "batch_s": min(batch), "batch_median_s": statistics.median(batch),
           "batch_runs_s": batch, "speedup": alone / min(batch),
           "bitwise": all(np.array_equal(logits[b], rows[b]) for b in range(B))}
    if profile:
        out["profile"] = _profiled(ref, lambda: ref.decode_batch(tokens, caches), profile)
    return out


def _stream_sweep(src, cfg) -> dict:
    """Milliseconds of one streamed product (``reference.streamed``, T = 1) on the lm_head and on a
    routed expert's w1, best of a few, for block sizes x task counts: the kernel's speed on this
    machine's cores, to choose ``streamed.BLOCK``."""
    import numpy as np

    from kimi.tensors import expert_name
    from reference import streamed
    from reference.executor import cpu_count

    names = {"lm_head": "lm_head.weight", "expert_w1": expert_name(cfg.first_k_dense_replace, 0, "w1")}
    x = {k: np.random.default_rng(0).standard_normal(src.shape(n)[1]) for k, n in names.items()}
    repeats = {"lm_head": 3, "expert_w1": 30}
    saved = streamed.BLOCK, streamed.THREADS
    rows = []
    try:
        for block in (1 << 16, 1 << 17, 1 << 18, 1 << 19):
            for threads in sorted({t for t in (2, 4, 8, cpu_count()) if t <= cpu_count()}):
                streamed.BLOCK, streamed.THREADS = block, threads
                row = {"block": block, "threads": threads}
                for k, n in names.items():
                    streamed.source_linear(src, n, x[k])  # warm
                    best = min(_timed(lambda: streamed.source_linear(src, n, x[k])) for _ in range(repeats[k]))
                    row[f"{k}_ms"] = best * 1e3
                rows.append(row)
    finally:
        streamed.BLOCK, streamed.THREADS = saved
    shapes = {k: list(src.shape(n)) for k, n in names.items()}
    return {"default_block": saved[0], "default_threads": saved[1], "shapes": shapes, "rows": rows}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _layer_breakdown(cfg, marks: list[list[float]]) -> dict:
    """Median seconds per decode step by layer kind (``kda+dense``, ``kda+moe``, ``mla+moe``, ...;
    the first layer's time includes the embedding row) and ``head`` (final norm, lm_head and the
    call's checks), from each step's elapsed time after every layer followed by the step's total."""
    import statistics as st

    kinds: dict[str, list[float]] = {}
    for m in marks:
        for i, dt in enumerate(b - a for a, b in zip([0.0] + m[:-1], m)):
            if i < cfg.num_hidden_layers:
                kind = "kda" if cfg.is_kda_layer(i) else "mla"
                kind += "+moe" if cfg.is_moe_layer(i) else "+dense"
            else:
                kind = "head"
            kinds.setdefault(kind, []).append(dt)
    per_step = {k: len(v) // len(marks) for k, v in kinds.items()}
    return {k: {"layers": per_step[k], "median_s": st.median(v), "per_step_s": st.median(v) * per_step[k]}
            for k, v in kinds.items()}


def _config_of(directory: Path):
    from kimi.config import ConfigError, KimiConfig

    try:
        return KimiConfig.from_json(directory / "config.json")
    except (ConfigError, OSError):
        return None


def _checkpoint_bytes(cfg) -> int:
    from kimi.tensors import num_parameters

    return 2 * num_parameters(cfg)


# -- a parity command, timed ------------------------------------------------------------------------------

def cmd_cli(args) -> dict:
    from parity.cli import main

    t0 = time.perf_counter()
    code = main(args.argv)
    out = {"part": "cli", "argv": args.argv, "exit": code, "wall_s": time.perf_counter() - t0}
    out.update(_gpu_peak())
    out["host_peak_rss_GB"] = _rss_gb()
    return out


# -- a corpus diff at 48B ----------------------------------------------------------------------------

def write_corpus(path: Path, n: int, vocab: int, lo: int = 8, hi: int = 64, seed: int = 0) -> list[int]:
    """``n`` prompts of random token ids, ``lo`` to ``hi`` tokens each (ragged), as JSONL; their lengths."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, n).tolist()
    with open(path, "w") as f:
        for k in lengths:
            f.write(json.dumps({"ids": rng.integers(0, vocab, k).tolist()}) + "\n")
    return lengths


def cmd_corpus(args) -> dict:
    """``parity diff --prompts`` over a synthetic corpus of the preset, end to end in this process
    (the model loads included), its corpus report and plot in ``--out``."""
    from kimi.config import KimiConfig
    from parity.cli import main

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = out_dir / "corpus-prompts.jsonl"
    lengths = write_corpus(prompts, args.prompts, KimiConfig.from_name(args.preset).vocab_size)
    argv = ["diff", "--synthetic", args.preset, "--prompts", str(prompts), "--steps", str(args.steps),
            "--batch", str(args.batch), "--json", str(out_dir / "corpus.json"), "--plot", str(out_dir / "corpus.png"),
            "--no-progress"] + (["--shard", args.shard] if args.shard else [])
    spent: dict[str, float] = {}
    t0 = time.perf_counter()
    with _timed_parts(spent), _reporting(spent, t0, every=args.report_every):
        code = main(argv)
    out = {"part": "corpus", "argv": argv, "exit": code, "wall_s": time.perf_counter() - t0,
           "prompts": args.prompts, "prompt_tokens": [min(lengths), max(lengths)], "steps": args.steps,
           "batch": args.batch, "parts_s": spent,
           "note": "parts_s: wall seconds inside each (the device synchronized around every call); the "
                   "judge's share excludes the replay and the twin it calls"}
    report = out_dir / "corpus.json"
    if report.exists():
        summary = json.loads(report.read_text())["summary"]
        out["report"] = {k: summary[k] for k in ("line", "verdicts", "kl", "near_ties", "router_flips")}
    out.update(_gpu_peak())
    out["host_peak_rss_GB"] = _rss_gb()
    return out


def cmd_corpus_shards(args) -> dict:
    """The corpus of ``corpus`` run whole (``--batch``), then as ``--shards`` shards (``--shard-batch``)
    each in this process, the shard reports merged by ``parity diff merge``: whether the merge equals
    the whole corpus's report. On a GPU reference a batch's rows differ from other batch sizes' in the
    last bits, so every string, integer and verdict must be equal and every float within 1e-6
    relative (or 1e-9 absolute); the wall times are left out."""
    from kimi.config import KimiConfig
    from parity.cli import main

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = out_dir / "corpus-prompts.jsonl"
    write_corpus(prompts, args.prompts, KimiConfig.from_name(args.preset).vocab_size)
    base = ["diff", "--synthetic", args.preset, "--prompts", str(prompts), "--steps", str(args.steps), "--no-progress"]
    runs, reports = [], []
    for k in range(args.shards + 1):
        shard = [] if k == 0 else ["--shard", f"{k}/{args.shards}"]
        report = out_dir / ("whole.json" if k == 0 else f"shard-{k}.json")
        t0 = time.perf_counter()
        code = main(base + ["--batch", str(args.batch if k == 0 else args.shard_batch), "--json", str(report)] + shard)
        runs.append({"shard": shard[1] if shard else None, "exit": code, "wall_s": time.perf_counter() - t0})
        reports.append(report)
    merged = out_dir / "merged.json"
    merge_exit = main(["diff", "merge", *map(str, reversed(reports[1:])), "--json", str(merged)])
    whole, both = ({k: v for k, v in json.loads(f.read_text()).items() if k != "seconds"} if f.exists() else {}
                   for f in (reports[0], merged))
    missing = [f.name for f in (*reports, merged) if not f.exists()]  # a run that failed wrote none
    differ = [f"{name}: not written" for name in missing] or _differences(both, whole, "report")
    out = {"part": "corpus-shards", "prompts": args.prompts, "steps": args.steps, "batch": args.batch,
           "shards": args.shards, "shard_batch": args.shard_batch, "runs": runs, "merge_exit": merge_exit,
           "whole_line": whole.get("summary", {}).get("line"), "differences": len(differ), "first": differ[:10],
           "equal": not differ and merge_exit == runs[0]["exit"]}
    out["exit"] = 0 if out["equal"] else 1
    out.update(_gpu_peak())
    return out


def _differences(got, want, where: str) -> list[str]:
    """Where ``got`` differs from ``want``: strings, integers and booleans exactly, floats beyond
    1e-6 relative and 1e-9 absolute (NaN equal to NaN)."""
    import math

    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else type(got).__name__}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: length"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in _differences(a, b, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        same = (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


CORPUS_PARTS = {  # what a corpus diff's time is spent in: (module, class or None, attribute)
    "reference prefill": ("reference.model", "Model", "prefill"),
    "reference decode_batch": ("reference.model", "Model", "decode_batch"),
    "engine prefill": ("optimized.model", "Model", "prefill"),
    "engine decode_batch": ("optimized.model", "Model", "decode_batch"),
    "replay of prompts": ("parity.diff.replay", "Replay", "add"),
    "replay of decode steps": ("parity.diff.batch", None, "replay_batch"),
    "replay routers": ("parity.diff.replay", "_Batch", "router"),
    "replay KDA read-out of prompts": ("parity.diff.replay", None, "readout_amplification"),
    "judge": ("parity.diff.runner", "PromptRun", "judge"),
    "twin": ("parity.diff.twin", "Twin", "logits"),
    "lm_head span": ("parity.diff.logits", "LmHeadSpan", "__init__"),
}


@contextlib.contextmanager
def _reporting(spent: dict, t0: float, *, every: float):
    """Within it, ``spent`` is printed to stderr every ``every`` seconds (0: never), so that a run
    cut short by its time limit still tells where its time went."""
    import threading

    done = threading.Event()

    def report():
        while not done.wait(every):
            now = dict(spent)  # one copy (the run's thread adds to it meanwhile)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(now.items(), key=lambda kv: -kv[1]))
            print(f"[{time.perf_counter() - t0:.0f} s] {parts}", file=sys.stderr, flush=True)

    thread = threading.Thread(target=report, daemon=True)
    if every > 0:
        thread.start()
    try:
        yield
    finally:
        done.set()


@contextlib.contextmanager
def _timed_parts(spent: dict):
    """Within it, the callables of ``CORPUS_PARTS`` add their wall time to ``spent`` (the device
    synchronized before and after each); a part called inside another is subtracted from it."""
    import importlib

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    stack: list[float] = []  # time spent in nested parts, per open call

    def wrap(name, fn):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                sync()
                dt = time.perf_counter() - t0
                inner = stack.pop()
                spent[name] = spent.get(name, 0.0) + dt - inner
                if stack:
                    stack[-1] += dt
        return run

    saved = []
    for name, (module, cls, attr) in CORPUS_PARTS.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


# -- the GPU suite ------------------------------------------------------------------------------------

def _env() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import array_api_compat
        import numpy
        import torch

        out.update(numpy=numpy.__version__, torch=torch.__version__, array_api_compat=array_api_compat.__version__,
                   cuda=torch.cuda.is_available(),
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            out.update(gpu_free_GB=free / 1e9, gpu_total_GB=total / 1e9)
    except ImportError as exc:
        out["import_error"] = str(exc)
    out["cores"] = len(os.sched_getaffinity(0))
    return out


def cmd_gpu_suite(args) -> dict:
    """Every part under the budget, in order of value; a part that cannot start in the time left
    is recorded as skipped with its reason. Fails fast (exit 2) without CUDA or array-api-compat."""
    t_start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suite = {"part": "gpu-suite", "budget_s": args.budget, "environment": _env(), "parts": {}}
    result_path = out_dir / "reference-gpu-suite.json"

    def save():
        result_path.write_text(json.dumps(suite, indent=1) + "\n")

    env = suite["environment"]
    if "import_error" in env or not env.get("cuda"):
        suite["error"] = env.get("import_error") or "no CUDA device"
        save()
        hint = " (carry its wheel: benchmarks/run_reference_gpu.sh)" if "import_error" in env else ""
        print(f"error: {suite['error']}{hint}", file=sys.stderr)
        raise SystemExit(2)
    save()
    py = [sys.executable]
    me = [*py, str(Path(__file__).resolve())]
    steps = str(args.steps)
    parts = [  # name, expected seconds, timeout seconds, command
        ("cuda_agreement_tests", 90, 180,
         [*py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", "tests/reference/test_executors.py"]),
        ("decode_48b_shared", 80, 200,
         [*me, "decode", "--device", "cuda", "--share", "--steps", "5", "--prefill-tokens", str(args.long_prefill)]),
        ("diff_48b_128", 120, 300,
         [*me, "cli", "--", "diff", "--synthetic", CFG_48B, "--device", "cuda", "--reference-device", "cuda",
          "--steps", steps, "--no-progress", "--json", str(out_dir / "diff-48b.json")]),
        ("golden_48b_128", 120, 300,
         [*me, "cli", "--", "golden", "record", "--synthetic", CFG_48B, "--device", "cuda", "--dtype", "bfloat16",
          "--reference-device", "cuda", "--steps", steps, "--out", str(out_dir / "golden-48b.json")]),
        ("cpu_checkpoint_decode", 100, 240,
         [*me, "cpu-checkpoint", "--dir", args.ram_dir, "--steps", "3", "--cleanup"]),
    ]
    if args.parts:
        known = {p[0]: p for p in parts}
        unknown = [n for n in args.parts if n not in known]
        if unknown:
            raise SystemExit(f"error: --parts: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        parts = [known[n] for n in args.parts]
    for name, expect, limit, cmd in parts:
        left = args.budget - (time.monotonic() - t_start)
        if left < expect:
            suite["parts"][name] = {"skipped": f"{left:.0f} s left of the budget, the part takes about {expect} s"}
            save()
            continue
        suite["parts"][name] = _run_part(cmd, min(limit, left), out_dir / f"{name}.log")
        save()
        print(f"[{time.monotonic() - t_start:.0f} s] {name}: {json.dumps(suite['parts'][name])[:300]}",
              file=sys.stderr, flush=True)
    suite["wall_s"] = time.monotonic() - t_start
    save()
    return suite


def _run_part(cmd: list[str], limit: float, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"{cmd}\n--- timed out after {limit:.0f} s\n{exc.stdout or ''}\n{exc.stderr or ''}")
        return {"timed_out_s": limit}
    log.write_text(f"{cmd}\n--- exit {p.returncode}\n{p.stdout}\n--- stderr\n{p.stderr}")
    res = {"exit": p.returncode, "wall_s": time.perf_counter() - t0}
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    try:
        res["result"] = json.loads(last)
    except json.JSONDecodeError:
        res["tail"] = (p.stdout + p.stderr).strip().splitlines()[-3:]
    return res


# -- main ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--preset", default=CFG_48B)
    d.add_argument("--device", default="cuda")
    d.add_argument("--share", action="store_true", help="load the optimized model first and share its weights")
    d.add_argument("--prompt-tokens", type=int, default=19)
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--prefill-tokens", type=int, default=0, help="a long reference prefill (0: none)")
    d.add_argument("--weight-cache-mb", type=int, default=64)
    d.add_argument("--batch", type=int, default=1,
                   help="also time one decode_batch of B sequences against their B decode calls")
    d.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also time STEPS decode steps part by part, and profile the device's kernels")
    c = sub.add_parser("cpu-checkpoint")
    c.add_argument("--preset", default=CFG_48B)
    c.add_argument("--experts", type=int, default=16)
    c.add_argument("--layers", type=int, default=None, help="the first N layers only (a local check)")
    c.add_argument("--dir", default="/dev/shm/kimi48b-e16")
    c.add_argument("--prompt-tokens", type=int, default=8)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--weight-cache-mb", type=int, default=64)
    c.add_argument("--cleanup", action="store_true", help="delete the checkpoint afterwards")
    c.add_argument("--batch", type=int, default=1,
                   help="also time one decode_batch of B sequences against their B decode calls")
    c.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="skip the streamed-product sweep (block size x threads)")
    cl = sub.add_parser("cli")
    cl.add_argument("argv", nargs=argparse.REMAINDER)
    g = sub.add_parser("gpu-suite")
    g.add_argument("--out", default=os.environ.get("OUT", "out"))
    g.add_argument("--budget", type=float, default=450.0, help="wall-time budget in seconds")
    g.add_argument("--steps", type=int, default=128)
    g.add_argument("--long-prefill", type=int, default=32768)
    g.add_argument("--parts", nargs="+", default=None, metavar="PART",
                   help="run only these parts, in this order (default: every part, in order of value)")
    g.add_argument("--ram-dir", default="/dev/shm/kimi48b-e16")
    co = sub.add_parser("corpus", help="parity diff --prompts over a synthetic corpus, end to end")
    co.add_argument("--preset", default=CFG_48B)
    co.add_argument("--prompts", type=int, default=100)
    co.add_argument("--steps", type=int, default=128)
    co.add_argument("--batch", type=int, default=32)
    co.add_argument("--shard", default=None, metavar="I/N")
    co.add_argument("--out", default=os.environ.get("OUT", "out"))
    co.add_argument("--report-every", type=float, default=60.0, metavar="S",
                    help="print the time spent so far, part by part, every S seconds (0: never)")
    cs = sub.add_parser("corpus-shards", help="the corpus whole and as shards: does their merge equal it")
    cs.add_argument("--preset", default=CFG_48B)
    cs.add_argument("--prompts", type=int, default=16)
    cs.add_argument("--steps", type=int, default=16)
    cs.add_argument("--batch", type=int, default=16)
    cs.add_argument("--shards", type=int, default=2)
    cs.add_argument("--shard-batch", type=int, default=8)
    cs.add_argument("--out", default=os.environ.get("OUT", "out"))
    for p in (d, c, cl, g, co, cs):
        p.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if args.cmd == "cli":
        args.argv = [a for a in args.argv if a != "--"]
    result = {"decode": cmd_decode, "cpu-checkpoint": cmd_cpu_checkpoint, "cli": cmd_cli,
              "gpu-suite": cmd_gpu_suite, "corpus": cmd_corpus,
              "corpus-shards": cmd_corpus_shards}[args.cmd](args)
    text = json.dumps(result)
    print(text)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result.get("exit", 0) in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
