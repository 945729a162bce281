"""KDA prefill (chunked, gate + beta-sigmoid + q/k l2norm fused) and the decode step, ours vs fla-core.

    python benchmarks/bench_kda.py --out kda.json
    python benchmarks/bench_kda.py --bounded --out kda-bounded.json [--md kda-bounded.md]
        [--launch '{"state_transposed": true}']

fla-core is a dev-only comparator: imported if installed, otherwise its figures are left empty and
its figures measured on the H200 are quoted from docs/BENCHMARKS.md instead.

``--bounded``: KDA prefill side by side in one process on the same inputs (bf16, K = V = 128), under
both gates: ours and fla-core's ``chunk_kda`` under the softplus gate, then under the bounded gate
``-5 sigmoid(exp(A_log) (g_raw + dt_bias))`` ours (``lower_bound=-5``), fla-core's safe-gate path
(``chunk_kda(..., safe_gate=True, lower_bound=-5)``) and FlashKDA (``flash_kda.fwd``, built by
benchmarks/build_flashkda.sh; its ``out`` and ``final_state`` buffers allocated once, outside the
timed call, as its API takes them), at B=1 with T = 1k, 4k, 8k, 16k, 64k and B=8 with T = 4k, each
at H = 32 and 96 (``--heads``, ``--shapes BxT`` narrow it). ``--chunk-size`` is ours: ``auto`` (the
default) 16 under the bounded gate, the fastest of 16, 32 and 64 at every point (docs/BENCHMARKS.md,
"Bytes, chunk size and FlashKDA"), and 64 under softplus; fla's is 64, FlashKDA's 16. Before timing
a shape, each kernel's output is judged against the float64 reference on a slice (the first 256 tokens of two heads: heads are
independent and the output is causal, so the slice of the full run is the run of the slice) in units
of its gate's bound under the contract the kernel claims (ours ieee, fla tf32, FlashKDA
bf16-storage); a kernel whose slice is not within its bound is not timed. The markdown table gives
each time, the byte floor and those ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402
from benchmarks.harness import Result, bench, graph_timings, save, wall_per_call  # noqa: E402

H, K, V = 32, 128, 128


def _fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return chunk_kda, fused_recurrent_kda
    except Exception as exc:  # noqa: BLE001 - report any import failure, keep benchmarking ours
        print(f"fla-core not available: {exc}")
        return None, None


def prefill_inputs(B, T, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=bf, generator=g)
    k = torch.randn(B, T, H, K, device=dev, dtype=bf, generator=g)
    v = torch.randn(B, T, H, V, device=dev, dtype=bf, generator=g)
    g_raw = torch.randn(B, T, H, K, device=dev, dtype=bf, generator=g)
    beta = torch.randn(B, T, H, device=dev, dtype=bf, generator=g)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(H * K, device=dev, generator=g) * 0.5
    return q, k, v, g_raw, beta, A_log, dt_bias


def bench_prefill(B, T, chunk_kda, launch=None):
    import optimized.kda as okda

    q, k, v, g_raw, beta, A_log, dt_bias = prefill_inputs(B, T)
    ours = lambda: okda.fused_chunked(q, k, v, g_raw, beta, A_log, dt_bias, launch=launch)  # noqa: E731
    ms, spread = bench(ours)
    fla_ms = None
    if chunk_kda is not None:
        def fla():
            return chunk_kda(q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True)
        fla_ms, _ = bench(fla)
    # bytes: read q, k, v, g_raw, beta (bf16) and write o (bf16) and the final state (fp32)
    nbytes = B * T * H * (3 * K + V) * 2 + B * T * H * K * 2 + B * T * H * 2 + B * H * K * V * 4
    return Result("kda.fused_chunked", {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": "bfloat16"},
                  ms, spread, fla_ms=fla_ms, bytes_moved=nbytes)


def bench_decode(B, fused_recurrent_kda):
    import optimized.kda as okda

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, H, K, device=dev, dtype=bf, generator=g)
    k = torch.randn(B, H, K, device=dev, dtype=bf, generator=g)
    v = torch.randn(B, H, V, device=dev, dtype=bf, generator=g)
    g_raw = torch.randn(B, H, K, device=dev, dtype=bf, generator=g)
    beta = torch.randn(B, H, device=dev, dtype=bf, generator=g)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(H * K, device=dev, generator=g) * 0.5
    pool = torch.randn(B, H, K, V, device=dev, generator=g)
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    ours = lambda: okda.fused_recurrent_decode(q, k, v, g_raw, beta, A_log, dt_bias, pool, slots)  # noqa: E731
    ms, spread = bench(ours)
    wall = wall_per_call(ours)
    graph = graph_timings(ours)  # the state pool is updated in place: replays keep decoding
    fla_ms = None
    if fused_recurrent_kda is not None:
        state = pool.clone()

        def fla():
            return fused_recurrent_kda(q[:, None], k[:, None], v[:, None], g_raw[:, None], beta[:, None],
                                       A_log=A_log, dt_bias=dt_bias, initial_state=state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        fla_ms, _ = bench(fla)
    nbytes = B * H * K * V * 4 * 2 + B * H * (3 * K + V + V) * 2
    return Result("kda.fused_recurrent_decode", {"B": B, "H": H, "K": K, "V": V, "dtype": "bfloat16"},
                  ms, spread, fla_ms=fla_ms, bytes_moved=nbytes, extra={"wall_ms_per_call": wall, **graph})


BOUNDED_SHAPES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 65536), (8, 4096)]


def chunk_for(gate: str, choice: str) -> int:
    """Our chunk size under ``gate``: ``choice`` (16, 32 or 64), or for ``auto`` 16 under the bounded
    gate (the one-kernel prepare; the fastest at every point of the side by side, H100:
    docs/BENCHMARKS.md, "Bytes, chunk size and FlashKDA") and 64 under softplus (its default)."""
    if choice != "auto":
        return int(choice)
    return 16 if gate == "bounded" else 64
LOWER_BOUND = -5.0
SLICE_T, SLICE_H = 256, 2   # the slice each kernel's output is judged on


def bounded_inputs(B, T, Hn, dev="cuda"):
    """bf16 q, k, v, g_raw, beta logits [B,T,H,*]; fp32 A_log [H] (0 at init in GLM-5.3: here
    uniform in log space over [1/4, 1]) and dt_bias [H*K]."""
    g = torch.Generator(device=dev).manual_seed(1)
    bf = torch.bfloat16
    q, k = (torch.randn(B, T, Hn, K, device=dev, dtype=bf, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hn, V, device=dev, dtype=bf, generator=g)
    g_raw = torch.randn(B, T, Hn, K, device=dev, dtype=bf, generator=g)
    beta = torch.randn(B, T, Hn, device=dev, dtype=bf, generator=g)
    A_log = torch.empty(Hn, device=dev).uniform_(-1.4, 0.0, generator=g)
    dt_bias = torch.randn(Hn * K, device=dev, generator=g) * 0.5
    return q, k, v, g_raw, beta, A_log, dt_bias


def _flash_kda():
    try:
        import flash_kda

        return flash_kda
    except Exception as exc:  # noqa: BLE001 - report any import failure, keep benchmarking the others
        print(f"FlashKDA not available: {exc}")
        return None


#: the kernels of a side-by-side row, in the table's order: name -> the gate it computes
SIDE_BY_SIDE = {"ours softplus": "softplus", "fla softplus": "softplus", "ours": "bounded",
                "fla safe gate": "bounded", "FlashKDA": "bounded"}


def bounded_kernels(x, chunk_kda, flash_kda, chunk_size="auto", launch=None):
    """name -> (contract, gate, callable returning the output [B,T,H,V]) on the inputs ``x``; the
    names those of :data:`SIDE_BY_SIDE` whose kernels are installed; ours at ``chunk_size``
    (:func:`chunk_for`; fla's chunk is 64, FlashKDA's 16) with ``launch`` (a ChunkLaunch, None:
    the defaults)."""
    soft, bnd = chunk_for("softplus", chunk_size), chunk_for("bounded", chunk_size)
    import optimized.kda as okda

    q, k, v, g_raw, beta, A_log, dt_bias = x
    B, T, Hn = q.shape[:3]
    out = {"ours softplus": ("ieee", "softplus", lambda: okda.fused_chunked(q, k, v, g_raw, beta, A_log,
                                                                             dt_bias, chunk_size=soft,
                                                                             launch=launch)[0])}
    if chunk_kda is not None:
        out["fla softplus"] = ("tf32", "softplus", lambda: chunk_kda(
            q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0])
    out["ours"] = ("ieee", "bounded", lambda: okda.fused_chunked(q, k, v, g_raw, beta, A_log, dt_bias,
                                                                  lower_bound=LOWER_BOUND, chunk_size=bnd,
                                                                  launch=launch)[0])
    if chunk_kda is not None:
        out["fla safe gate"] = ("tf32", "bounded", lambda: chunk_kda(
            q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=LOWER_BOUND)[0])
    if flash_kda is not None:
        o = torch.empty_like(v)
        final = torch.empty(B, Hn, V, K, dtype=torch.float32, device=q.device)
        bias = dt_bias.reshape(Hn, K).contiguous()

        def fk():
            flash_kda.fwd(q, k, v, g_raw, beta, K ** -0.5, o, A_log, bias, LOWER_BOUND, final_state=final)
            return o
        out["FlashKDA"] = ("bf16-storage", "bounded", fk)
    return out


def slice_ratio(x, o, contract: str, gate: str = "bounded") -> float:
    """The worst error of ``o[:, :SLICE_T, :SLICE_H]`` (batch row 0) in units of ``gate``'s bound
    (``"bounded"`` or ``"softplus"``) under ``contract``, against the float64 reference of the same
    slice of the inputs."""
    import numpy as np

    from parity import ops
    from parity.certify.check import prepare
    from parity.registry import Case

    bounded = gate == "bounded"
    rec = ops.get("kda.fused_chunked+lower_bound" if bounded else "kda.fused_chunked")
    n = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    q, k, v, g_raw, beta, A_log, dt_bias = x
    s = (slice(0, 1), slice(0, SLICE_T), slice(0, SLICE_H))
    arrays = {"q": n(q[s]), "k": n(k[s]), "v": n(v[s]), "g_raw": n(g_raw[s]), "beta_logits": n(beta[s]),
              "A_log": n(A_log[:SLICE_H]), "dt_bias": n(dt_bias[:SLICE_H * K]), "initial_state": None,
              "cu_seqlens": None}
    kwargs = {"lower_bound": LOWER_BOUND, "chunk_size": 64} if bounded else {"chunk_size": 64}
    prep = prepare(rec, Case(arrays, kwargs), "bfloat16", "cpu", contract=contract)
    bound = prep.bound({"o": "bfloat16", "final_state": "float32"})["o"]
    got = n(o[s])
    err = np.abs(got - prep.ref["o"])
    ratio = np.where(err == 0, 0.0, err / bound)
    return float("inf") if not np.all(np.isfinite(got)) else float(ratio.max())


def bench_prefill_bounded(B, T, Hn, chunk_kda, flash_kda, chunk_size="auto", launch=None,
                          kernels=None) -> Result:
    """One side-by-side row; ``kernels``: the names of :data:`SIDE_BY_SIDE` to run (None: all)."""
    x = bounded_inputs(B, T, Hn)
    times, ratios = {}, {}
    for name, (contract, gate, fn) in bounded_kernels(x, chunk_kda, flash_kda, chunk_size, launch).items():
        if kernels is not None and name not in kernels:
            continue
        try:
            ratios[name] = slice_ratio(x, fn(), contract, gate)
            times[name] = bench(fn)[0] if ratios[name] <= 1 else None  # outputs agree first
        except Exception as exc:  # noqa: BLE001 - one kernel's failure is a row's note, not the run's end
            print(f"  {name} B={B} T={T} H={Hn}: {type(exc).__name__}: {exc}")
            times[name], ratios[name] = None, None
        torch.cuda.synchronize()
    nbytes = B * T * Hn * (3 * K + V) * 2 + B * T * Hn * K * 2 + B * T * Hn * 2 + B * Hn * K * V * 4
    return Result("kda.fused_chunked+lower_bound", {"B": B, "T": T, "H": Hn, "K": K, "V": V, "dtype": "bfloat16",
                                                     "lower_bound": LOWER_BOUND, "chunk_size": chunk_for("bounded", chunk_size),
                                                     "softplus_chunk_size": chunk_for("softplus", chunk_size)},
                  times.get("ours"), fla_ms=times.get("fla safe gate"), baseline="FlashKDA",
                  baseline_ms=times.get("FlashKDA"), bytes_moved=nbytes,
                  extra={"slice_ratio": ratios, "ms": times,
                         "slice": f"batch row 0, tokens 0..{SLICE_T - 1}, heads 0..{SLICE_H - 1}"})


def bounded_table(results) -> str:
    """The markdown table of the ``--bounded`` rows: each kernel's ms (- where not installed, or not
    timed because its slice missed its bound), the byte floor, ours over the floor under each gate,
    and each slice error in its gate's bound units."""
    f = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    names = list(SIDE_BY_SIDE)
    lines = ["| B | T | H | our chunk (softplus, bounded) | " + " | ".join(f"{n} ms" for n in names) + " | byte floor ms | "
             "ours / floor (softplus, bounded) | slice error in bound units (" + " / ".join(names) + ") |",
             "|" + "---|" * (len(names) + 7)]
    for r in results:
        p, sr, ms = r.params, r.extra["slice_ratio"], r.extra["ms"]
        over = ", ".join(f(ms.get(n) / r.floor_ms) if ms.get(n) else "-" for n in ("ours softplus", "ours"))
        lines.append(f"| {p['B']} | {p['T']} | {p['H']} | {p.get('softplus_chunk_size', '-')}, {p['chunk_size']} | "
                     + " | ".join(f(ms.get(n)) for n in names)
                     + f" | {f(r.floor_ms)} | {over} | " + " / ".join(f(sr.get(n)) for n in names) + " |")
    return "\n".join(lines) + "\n"


def launch_arg(text: str):
    """``--launch``: a ChunkLaunch from inline JSON (``{...}``) or a JSON file; ValueError with a
    one-line message when it is neither or names no ChunkLaunch field."""
    from optimized.kda import ChunkLaunch

    try:
        fields = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
        return ChunkLaunch(**fields)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--launch {text!r}: {type(exc).__name__}: {exc}") from None


def main_bounded(args, launch=None):
    chunk_kda, _ = _fla()
    flash_kda = _flash_kda()
    results = []
    cmd = "python benchmarks/bench_kda.py " + " ".join(sys.argv[1:])
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes] if args.shapes else BOUNDED_SHAPES
    for Hn in args.heads:
        for B, T in shapes:
            r = bench_prefill_bounded(B, T, Hn, chunk_kda, flash_kda, args.chunk_size, launch, args.kernels)
            results.append(r)
            print(r.as_dict(), flush=True)
            save(results, args.out, command=cmd)
            if args.md:
                Path(args.md).write_text(bounded_table(results))
    print(bounded_table(results))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda.json")
    ap.add_argument("--bounded", action="store_true", help="KDA prefill under the bounded gate: ours, fla's "
                    "safe-gate path and FlashKDA side by side (module docstring)")
    ap.add_argument("--heads", type=int, nargs="*", default=[32, 96], help="--bounded: the head counts")
    ap.add_argument("--md", default=None, help="--bounded: also write the markdown table here")
    ap.add_argument("--chunk-size", default="auto", choices=["16", "32", "64", "auto"],
                    help="--bounded: our chunk size (auto: 16 under the bounded gate, 64 under softplus; "
                    "fla's is 64, FlashKDA's 16)")
    ap.add_argument("--shapes", nargs="*", default=None, help="--bounded: BxT shapes (default: "
                    "B=1 at T = 1k, 4k, 8k, 16k, 64k and B=8 at T = 4k)")
    ap.add_argument("--kernels", nargs="*", default=None, choices=list(SIDE_BY_SIDE), metavar="NAME",
                    help=f"--bounded: only these of {', '.join(map(repr, SIDE_BY_SIDE))} (default: all installed)")
    ap.add_argument("--prefill-T", type=int, nargs="*", default=[1024, 2048, 4096, 16384, 65536])
    ap.add_argument("--decode-B", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--launch", default=None, help="kda.ChunkLaunch fields for our prefill, as JSON or "
                    "a JSON file (e.g. from tune.py kda --best-out; default: the tuned defaults); with "
                    "--bounded, ours under both gates")
    args = ap.parse_args(argv)
    launch = None
    if args.launch:
        try:
            launch = launch_arg(args.launch)
        except ValueError as exc:
            ap.error(str(exc))
        print(f"prefill launch settings: {launch}")
    optimized.use("cuda")
    if args.bounded:
        return main_bounded(args, launch)
    chunk_kda, fused_recurrent_kda = _fla()
    results = []
    cmd = "python benchmarks/bench_kda.py --out kda.json" + (f" --launch {args.launch}" if args.launch else "")

    def done(r):  # saved after every case: a run cut short by its time limit keeps what it measured
        results.append(r)
        print(r.as_dict(), flush=True)
        save(results, args.out, command=cmd)

    for B in args.decode_B:
        done(bench_decode(B, fused_recurrent_kda))
    for T in args.prefill_T:
        done(bench_prefill(1, T, chunk_kda, launch))
    done(bench_prefill(8, 4096, chunk_kda, launch))


if __name__ == "__main__":
    main()
