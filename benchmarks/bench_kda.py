"""KDA prefill (chunked, gate + beta-sigmoid + q/k l2norm fused) and the decode step, ours vs fla-core.

    python benchmarks/bench_kda.py --out kda.json

fla-core is a dev-only comparator: imported if installed, otherwise its figures are left empty and
its figures measured on the H200 are quoted from docs/BENCHMARKS.md instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda.json")
    ap.add_argument("--prefill-T", type=int, nargs="*", default=[1024, 2048, 4096, 16384, 65536])
    ap.add_argument("--decode-B", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--launch", default=None, help="JSON of kda.ChunkLaunch fields for the prefill "
                    "(e.g. from tune.py kda --best-out; default: the tuned defaults)")
    args = ap.parse_args(argv)
    launch = None
    if args.launch:
        from optimized.kda import ChunkLaunch

        launch = ChunkLaunch(**json.loads(Path(args.launch).read_text()))
        print(f"prefill launch settings: {launch}")
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
