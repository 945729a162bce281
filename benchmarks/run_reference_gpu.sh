#!/usr/bin/env bash
# The float64 reference's GPU suite in one device call (docs/BENCHMARKS.md, "The float64 reference"):
# the CUDA executor-agreement tests, the 48B decode step (reference beside the optimized model, its
# weights shared) with a 32k-token prefill, `parity diff` and `parity golden record` of the 48B
# model over 128 steps end to end, and the CPU decode step from a checkpoint on a RAM disk; each
# part in its own process under a timeout, skipped when the budget (REF_BUDGET_S, default 450 s)
# cannot hold it. Results: $OUT/reference-gpu-suite.json, one log per part, diff-48b.json,
# golden-48b.json.
#
#   pip download array-api-compat==1.16.0 --no-deps -d .whl   # once, where pip can reach PyPI
#   device run (kind nvidia-h200, carry [".whl"], timeout_s 540):   bash benchmarks/run_reference_gpu.sh
#   (arguments go to gpu-suite: --parts decode_48b_shared diff_48b_128 ... runs those, in that order)
#
# The wheel is installed only when the device machine lacks array-api-compat.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import array_api_compat" 2>/dev/null; then
    if ls .whl/array_api_compat-*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps \
            --no-compile --target /tmp/site-reference .whl/array_api_compat-*.whl; then
        export PYTHONPATH=/tmp/site-reference${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "error: array-api-compat is not installed here and no wheel was carried in .whl/" >&2
        exit 2
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
exec "$PY" benchmarks/reference_model.py gpu-suite --out "$OUT" --budget "${REF_BUDGET_S:-450}" "$@"
