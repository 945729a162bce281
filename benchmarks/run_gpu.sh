#!/usr/bin/env bash
# Every benchmark on one GPU in one call: fla-core from the carried wheels, then bench_kda, bench_ops
# and bench_model, each under a `timeout` (a hang costs that script, not the call), JSON + tables.md +
# bench.log under $OUT.
#
#   device run (kind nvidia-h200, carry [".whl"]):   bash benchmarks/run_gpu.sh
#   docs:  python benchmarks/render.py out/kda.json out/ops.json out/model.json
#
# Wall-time budget BENCH_BUDGET_S (default 400 s, well inside the 600 s a device command may take):
# bench_kda gets at most KDA_LIMIT_S (100), bench_ops OPS_LIMIT_S (110), bench_model whatever is left
# (at least 180 s). Expected on an H200: about 1 + 1 + 2 minutes (mostly Triton compiles and the
# 98 GB of synthetic weights generated on the GPU).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/bench.log
PY=${PYTHON:-python3}
BUDGET=${BENCH_BUDGET_S:-400}
export PYTHONUNBUFFERED=1
: >"$LOG"

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }

log "run_gpu.sh in $PWD, results in $OUT, budget ${BUDGET}s"
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv 2>&1
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' 2>&1
} | tee -a "$LOG"

if ls .whl/*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH=/tmp/site:$PWD
    log "fla-core installed from .whl: $(ls .whl)"
else
    export PYTHONPATH=$PWD
    log "fla-core NOT installed (no .whl carried or pip failed): fla columns stay empty"
fi

run() {  # run NAME LIMIT_S SCRIPT ARGS...: python under timeout, output to the log; never aborts
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 10))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        log "SKIP $name: only ${left}s of the ${BUDGET}s budget left"
        return
    fi
    log "start $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$PY" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local why=""
    ((rc == 124 || rc == 137)) && why=" TIMED OUT"
    log "end $name rc=$rc$why ($((SECONDS - t0))s)"
}

run kda "${KDA_LIMIT_S:-100}" benchmarks/bench_kda.py --out "$OUT/kda.json"
run ops "${OPS_LIMIT_S:-110}" benchmarks/bench_ops.py --out "$OUT/ops.json"
run model "$BUDGET" benchmarks/bench_model.py --out "$OUT/model.json"

jsons=$(ls "$OUT"/kda.json "$OUT"/ops.json "$OUT"/model.json 2>/dev/null)
if [ -n "$jsons" ]; then
    "$PY" benchmarks/render.py $jsons >"$OUT/tables.md" 2>>"$LOG" && log "wrote $OUT/tables.md"
fi
log "done: $(ls "$OUT" | tr '\n' ' ')"
