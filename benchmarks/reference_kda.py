"""Speed of the float64 reference KDA: ``kda.chunked`` vs the token loop ``kda.recurrent``.

Target: chunked at least 10x faster than recurrent at T=4096, H=32, K=V=128, B=1.
The recurrent loop costs the same per token whatever T is, so by default it is timed on a shorter
prefix (``--recurrent-tokens``) and scaled linearly to T; the JSON says so. Wall and CPU (process)
seconds are both reported, best of ``--repeats``, with the load average: on a shared machine the
CPU time is the steadier number. The chunked form is BLAS-bound and the token loop memory-bound, so
their ratio grows with the BLAS threads available. BLAS runs single-threaded unless
``OPENBLAS_NUM_THREADS`` is set: threaded OpenBLAS on small stacked products spins badly when the
cores are shared (seen here: 20x slower under load). Prints one JSON object.

    python benchmarks/reference_kda.py [--T 4096] [--recurrent-tokens 512] [--chunk-size 64]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS; see above

import numpy as np  # noqa: E402

from reference import kda  # noqa: E402
from reference.norm import l2norm  # noqa: E402


def _inputs(T, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((1, T, H, K)))
    k = l2norm(rng.standard_normal((1, T, H, K)))
    v = rng.standard_normal((1, T, H, V))
    g = -0.1 * rng.random((1, T, H, K))  # mild: every chunk takes the factored (BLAS) path
    beta = rng.random((1, T, H))
    return q, k, v, g, beta


def _best_of(fn, repeats):
    """(wall seconds, CPU seconds), each the best of ``repeats`` runs."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--recurrent-tokens", type=int, default=512,
                   help="tokens the recurrent loop is timed on (scaled linearly to T); "
                        "pass T to time it in full")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)

    q, k, v, g, beta = _inputs(a.T, a.H, a.K, a.V)
    load_before = os.getloadavg()
    chunked_wall, chunked_cpu = _best_of(
        lambda: kda.chunked(q, k, v, g, beta, chunk_size=a.chunk_size), a.repeats)

    Tr = min(a.recurrent_tokens, a.T)
    sub = [x[:, :Tr] for x in (q, k, v, g, beta)]
    rec_wall, rec_cpu = (t * a.T / Tr for t in _best_of(lambda: kda.recurrent(*sub), a.repeats))

    # sanity: both forms agree on the prefix that was timed
    o_r, s_r = kda.recurrent(*sub)
    o_c, s_c = kda.chunked(*sub, chunk_size=a.chunk_size)
    err = max(np.max(np.abs(o_c - o_r)) / np.max(np.abs(o_r)),
              np.max(np.abs(s_c - s_r)) / np.max(np.abs(s_r)))

    print(json.dumps({
        "benchmark": "reference_kda",
        "shape": {"B": 1, "T": a.T, "H": a.H, "HV": a.H, "K": a.K, "V": a.V},
        "chunk_size": a.chunk_size,
        "chunked_wall_s": round(chunked_wall, 3),
        "chunked_cpu_s": round(chunked_cpu, 3),
        "recurrent_wall_s": round(rec_wall, 3),
        "recurrent_cpu_s": round(rec_cpu, 3),
        "recurrent_timed_tokens": Tr,
        "recurrent_scaled_linearly": Tr != a.T,
        "speedup_wall": round(rec_wall / chunked_wall, 2),
        "speedup_cpu": round(rec_cpu / chunked_cpu, 2),
        "chunked_vs_recurrent_max_rel_err": float(err),
        "repeats_best_of": a.repeats,
        "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
        "openblas_num_threads": os.environ["OPENBLAS_NUM_THREADS"],
        "numpy": np.__version__,
        "machine": platform.machine(),
    }, indent=2))


if __name__ == "__main__":
    main()
