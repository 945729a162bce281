"""The whole optimized model's decode step at the real 48B dimensions: tokens/s at B=1 and B=64
against the memory-traffic floor of what one step must read.

    python benchmarks/bench_model.py --out model.json
    python benchmarks/bench_model.py --smoke --out /tmp/model.json   # preset "tiny", CPU + interpreter

The weights are random: ``optimized.load(SyntheticSource(cfg, seed=0), device="cuda",
dtype="bfloat16")`` generates every tensor on the GPU (``optimized.synthetic``; no checkpoint, no
host copy: the host's peak RSS is printed to show it). Each sequence is prefilled with a random
prompt, then decoded greedily, timed two ways: ``model.greedy`` (the reported time: every step's
inputs built up front, each argmax fed back on the device, the host queueing steps while the GPU
runs, as a serving loop with device-side sampling) and a loop of ``model.decode`` (B=1) /
``model.decode_batch`` (B=64) calls that reads each argmax back to the host (``per_call_ms``: the
host's per-step work and sync included). One extra traced step (not timed) reads the router ids to
count the experts the step really touches.

Floor (bytes / 4.3 TB/s, ``harness.Result``) of one step for B sequences: every resident weight the
step reads once (attention/KDA, dense layer, router, shared experts, final norm, lm_head; the B
embedding rows; per MoE layer the distinct routed experts the B tokens chose: 8 at B=1) plus each
sequence's carried state (KDA recurrent and conv state read and written, the MLA latent rows read).
``active_params`` is the parameter count of one token (B=1): about 3B for the 48B model.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402
from benchmarks.bench_ops import on_gpu, sync  # noqa: E402
from benchmarks.harness import (HBM_BYTES_PER_S, Result, add_pdl_option, apply_pdl, kernel_profile,  # noqa: E402
                                save, show_kernel_profile)
from kimi.config import KimiConfig  # noqa: E402
from kimi.synthetic import SyntheticSource  # noqa: E402

GB = 1e9


def _tensors(obj):
    """Every tensor inside a weights dataclass / list (ints and tuples of ints skipped)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def step_traffic(model, experts_touched: dict[int, int], B: int, context: int, pool) -> dict:
    """Bytes one decode step of B sequences (each with ``context`` cached positions) must move, from
    the resident layout (fp32 router included), and the parameter count behind them."""
    from optimized.weights import MoEWeights

    W, c = model.weights, model.config
    seen: set[int] = set()
    acc = {"param_bytes": 0, "params": 0}

    def add(t: torch.Tensor, count: int = 1, *, whole: bool = True):
        if whole:
            if t.data_ptr() in seen:
                return
            seen.add(t.data_ptr())
        acc["param_bytes"] += count * t.numel() * t.element_size()
        acc["params"] += count * t.numel()

    if not c.tie_word_embeddings:  # tied: the lm_head reads the whole table anyway
        add(W.embed[0], B, whole=False)
    for i, lw in enumerate(W.layers):
        for t in _tensors([lw.input_norm, lw.post_norm, lw.mixer]):
            add(t)
        ffn = lw.ffn
        if isinstance(ffn, MoEWeights):
            for t in _tensors([ffn.router, ffn.bias, ffn.shared]):
                add(t)
            n = experts_touched[i]
            for stacked in (ffn.w1, ffn.w2, ffn.w3):
                add(stacked[0], n, whole=False)
        else:
            for t in _tensors(ffn):
                add(t)
    add(W.norm)
    add(W.lm_head)
    state = 0
    for st in pool.kda.values():  # read + write one slot's rows
        state += 2 * B * (st.conv[0].numel() * st.conv[0].element_size()
                          + st.state[0].numel() * st.state[0].element_size())
    for cache in pool.mla.values():  # read the context's latent rows, write one
        state += B * (context + 1) * (cache.L + cache.R) * cache.kv.element_size()
    return {**acc, "state_bytes": state, "bytes": acc["param_bytes"] + state}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # Linux: KiB


def _gpu_gb(fn_name: str) -> float | None:
    return getattr(torch.cuda, fn_name)() / GB if on_gpu() else None


def bench_decode(model, B: int, prompt_len: int, steps: int, warmup: int, seed: int, common: dict,
                 profile: bool = False) -> Result:
    c = model.config
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, c.vocab_size, size=(B, prompt_len))
    params = {"preset": common["preset"], "B": B, "prompt": prompt_len, "steps": steps, "dtype": "bfloat16"}
    if B > 1 and not hasattr(model, "decode_batch"):
        return Result("model.decode_step", params, None, notes="no batched decode API: not measured")

    # the pool holds the whole run from the start: a growing pool doubles its paged cache when it
    # runs out, and the decode step's CUDA graph is recaptured then (tens of ms inside the timed
    # loop); a server sizes its pool up front too
    block = 64  # the pool's default MLA page
    blocks_per_seq = -(-(prompt_len + warmup + 1 + 2 * steps) // block)
    pool = model.new_pool(B, block_size=block, num_blocks=B * blocks_per_seq)
    sync()
    t0 = time.perf_counter()
    caches, toks = [], []
    for b in range(B):
        logits, cache = model.prefill(prompts[b], cache=pool.new_sequence())
        caches.append(cache)
        toks.append(int(logits[-1].argmax()))
    sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3  # includes first-call compiles
    print(f"  B={B}: prefilled {B} x {prompt_len} tokens in {prefill_ms:.0f} ms", flush=True)

    def step(trace=None):
        if B == 1:
            logits, _ = model.decode(toks[0], caches[0], trace=trace)
            return [int(logits.argmax())]
        logits, _ = model.decode_batch(toks, caches, trace=trace)
        return logits.argmax(-1).tolist()

    t0 = time.perf_counter()
    for _ in range(warmup):  # the first decode compiles the decode kernels
        toks = step()
    sync()
    warm_ms = (time.perf_counter() - t0) * 1e3
    trace: dict = {}
    toks = step(trace)  # not timed: which experts does a step touch?
    touched = {i: int(torch.unique(trace[f"layers.{i}.router.ids"]).numel())
               for i in range(c.num_hidden_layers) if c.is_moe_layer(i)}
    del trace
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = step()
    sync()
    per_call_ms = (time.perf_counter() - t0) / steps * 1e3
    ms = per_call_ms
    # the reference model has no greedy: its time is the loop's; greedy replays the graph the loop
    # above captured (same pool, same B)
    if hasattr(model, "greedy"):
        t0 = time.perf_counter()
        toks = model.greedy(toks, caches, steps)[:, -1].tolist()
        sync()
        ms = (time.perf_counter() - t0) / steps * 1e3
    context = prompt_len + warmup + 1 + steps  # mean cached positions over the two timed runs
    notes = ("model.greedy, wall clock per step (host work included, queued ahead of the GPU)"
             if hasattr(model, "greedy") else "decode loop, wall clock per step (host overhead included)")
    traffic = step_traffic(model, touched, B, context, caches[0].pool)
    floor_ms = traffic["bytes"] / HBM_BYTES_PER_S * 1e3
    extra = {
        "tokens_per_s": B * 1e3 / ms,
        "per_call_ms": per_call_ms,
        "per_call_tokens_per_s": B * 1e3 / per_call_ms,
        "floor_tokens_per_s": B * 1e3 / floor_ms,
        "params_per_step_B": traffic["params"] / 1e9,
        "param_GB": traffic["param_bytes"] / GB,
        "state_GB": traffic["state_bytes"] / GB,
        "experts_touched_mean": float(np.mean(list(touched.values()))) if touched else 0.0,
        "prefill_ms": prefill_ms,
        "warmup_ms": warm_ms,
        "decode_tile": getattr(model, "decode_tile", None),
        **common["extra"],
    }
    peak = _gpu_gb("max_memory_allocated")
    if peak is not None:
        extra["peak_gpu_GB"] = peak
    print(f"  B={B}: {ms:.3f} ms/step, {extra['tokens_per_s']:.1f} tok/s (per call: {per_call_ms:.3f} "
          f"ms/step); floor {floor_ms:.3f} ms "
          f"({extra['floor_tokens_per_s']:.1f} tok/s; weights {traffic['param_bytes'] / GB:.2f} GB, "
          f"states {traffic['state_bytes'] / GB:.3f} GB); experts touched per MoE layer "
          f"{extra['experts_touched_mean']:.1f}", flush=True)
    if profile and on_gpu():  # where the GPU time of a step goes, kernel by kernel
        show_kernel_profile(f"decode step B={B}", kernel_profile(step, reps=3))
    for cache in caches:
        cache.release()
    return Result("model.decode_step", params, ms, bytes_moved=traffic["bytes"],
                  notes=notes, extra=extra)


def first_layers(cfg: KimiConfig, n: int) -> KimiConfig:
    """``cfg`` cut to its first ``n`` layers (each keeps its kind: KDA or MLA, dense or MoE)."""
    return replace(cfg, num_hidden_layers=n, kda_layers=tuple(i for i in cfg.kda_layers if i <= n),
                   full_attn_layers=tuple(i for i in cfg.full_attn_layers if i <= n))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="model.json")
    ap.add_argument("--smoke", action="store_true", help="preset 'tiny' on CPU (Triton interpreter)")
    ap.add_argument("--preset", default=None, help="default: kimi-linear-48b (--smoke: tiny)")
    ap.add_argument("--batch", type=int, nargs="*", default=None, help="default: 1 64 (--smoke: 1 5)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; --smoke 8)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; --smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps (default 3; --smoke 1)")
    ap.add_argument("--profile", action="store_true", help="print the kernels of a step (torch.profiler)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the preset's first N layers only (the 48B model's bf16 weights need more than an "
                         "80 GB card: 16 of its 27 layers fit); the floor counts the same layers")
    add_pdl_option(ap)
    args = ap.parse_args(argv)
    apply_pdl(args.pdl)
    if not on_gpu() and not args.smoke:
        ap.error("no CUDA device: the 48B model needs the GPU (use --smoke on CPU)")
    optimized.use("cuda" if on_gpu() else "cpu")   # on CPU the faithful interpreter
    smoke = args.smoke
    preset = args.preset or ("tiny" if smoke else "kimi-linear-48b")
    batches = args.batch or ([1, 5] if smoke else [1, 64])  # smoke: 5 > the CPU decode tile of 4
    prompt = args.prompt or (8 if smoke else 32)
    steps = args.steps or (2 if smoke else 32)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    dev = "cuda" if on_gpu() else "cpu"
    cfg = KimiConfig.from_name(preset)
    if args.layers is not None:
        if not 1 <= args.layers <= cfg.num_hidden_layers:
            ap.error(f"--layers: expected 1 to {cfg.num_hidden_layers} for {preset}, got {args.layers}")
        cfg = first_layers(cfg, args.layers)
        preset = f"{preset} (first {args.layers} layers)"

    from kimi.tensors import num_parameters

    rss0 = _rss_gb()
    sync()
    t0 = time.perf_counter()
    model = optimized.load(SyntheticSource(cfg, seed=0), device=dev, dtype="bfloat16")
    sync()
    load_s = time.perf_counter() - t0
    weights_gb = model.weights.nbytes() / GB
    common = {"preset": preset, "extra": {"load_s": load_s, "weights_GB": weights_gb}}
    print(f"loaded {preset} ({num_parameters(cfg) / 1e9:.2f}B parameters, {weights_gb:.1f} GB resident "
          f"on {dev}) in {load_s:.1f} s; host peak RSS {rss0:.2f} -> {_rss_gb():.2f} GB; GPU allocated "
          f"{_gpu_gb('memory_allocated') or 0:.1f} GB, peak {_gpu_gb('max_memory_allocated') or 0:.1f} GB",
          flush=True)
    results = [Result("model.load", {"preset": preset, "source": "SyntheticSource(seed=0)",
                                     "device": dev, "dtype": "bfloat16"},
                      load_s * 1e3, notes=("weights generated on the GPU (optimized.synthetic)" if on_gpu()
                                           else "weights read from the host source"),
                      extra={"weights_GB": weights_gb, "parameters_B": num_parameters(cfg) / 1e9,
                             "host_peak_rss_GB": _rss_gb(),
                             **({"gpu_peak_GB": _gpu_gb("max_memory_allocated")} if on_gpu() else {})})]
    cmd = ("python benchmarks/bench_model.py" + (" --smoke" if smoke else "")
           + (f" --layers {args.layers}" if args.layers else "") + " --out model.json")
    with torch.inference_mode():
        for B in batches:
            results.append(bench_decode(model, B, prompt, steps, warmup, seed=B, common=common,
                                        profile=args.profile))
            print(results[-1].as_dict(), flush=True)
            save(results, args.out, command=cmd)  # kept if a later batch runs out of time
    if on_gpu():
        print(f"GPU peak allocated {_gpu_gb('max_memory_allocated'):.1f} GB, peak reserved "
              f"{_gpu_gb('max_memory_reserved'):.1f} GB", flush=True)
    save(results, args.out, command=cmd)


if __name__ == "__main__":
    main()
