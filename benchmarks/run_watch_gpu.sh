#!/usr/bin/env bash
# transformers' KimiLinearForCausalLM generating on the GPU with fla-core installed, watched at fla's two
# KDA kernels as transformers calls them, each call judged against the float64 reference.
#
#   device run (kind nvidia-h200, carry [".whl"]):   bash benchmarks/run_watch_gpu.sh
#
# Writes $OUT/calls.safetensors, $OUT/certificate-watch-fla-cuda.json (copy it to docs/runs/) and
# $OUT/watch.log; then the overhead of watching a 4k prefill on the GPU (benchmarks/bench_watch.py).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/watch.log" 2>&1; then
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "fla-core not installed from .whl: transformers would run its own torch KDA" | tee -a "$OUT/watch.log"
    export PYTHONPATH=$PWD
fi
{
  "$PY" -m parity watch --op kda.chunked=fla.ops.kda:chunk_kda --op kda.recurrent=fla.ops.kda:fused_recurrent_kda \
      --out "$OUT/calls.safetensors" -- "$PY" benchmarks/watch_generate.py --device cuda --prompt-tokens 200 --new-tokens 8
  echo "watch rc=$?"
  "$PY" -m parity judge "$OUT/calls.safetensors" --json "$OUT/certificate-watch-fla-cuda.json"
  echo "certify rc=$?"
  timeout -k 10 300 "$PY" benchmarks/bench_watch.py --device cuda --repeats 9 --json "$OUT/bench-watch-cuda.json"
  echo "bench rc=$?"
} 2>&1 | tee -a "$OUT/watch.log"
