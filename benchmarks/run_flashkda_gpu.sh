#!/usr/bin/env bash
# FlashKDA on one GPU in one call (at most 10 minutes): build it, certify it and fla-core's safe-gate
# path under the bounded KDA gate, and time KDA prefill under that gate (ours, fla's safe gate,
# FlashKDA) side by side. Everything under $OUT:
#
#   build:    benchmarks/build_flashkda.sh (FlashKDA 1ce47ea from .flashkda/, sm_90a)  -> flashkda-build.log
#   certify:  parity certify --impl flashkda --ops kda.fused_chunked+lower_bound --device cuda --dtype bfloat16
#             --examples 30, with the long near-collinear input of benchmarks/flashkda_cases.py replayed
#             (--cases), --repro repro/                          -> certificate-flashkda-cuda.json
#             checked: an input is non-finite where the reference is finite (FlashKDA 1ce47ea's fp16
#             Neumann NaN), and that input's repro.py fails again in a fresh process
#             (repro.tar.gz holds the repros)
#   softplus: the same kernel certified as kda.fused_chunked --variant kda_gate=softplus: must fail,
#             naming the bounded gate                            -> certificate-flashkda-softplus.json
#   bench:    benchmarks/bench_kda.py --bounded                  -> kda-bounded.json, kda-bounded.md
#   fla:      parity certify --impl fla on the three bounded-gate ops (fused_kda_gate, fused_recurrent_kda,
#             chunk_kda's safe-gate path), in what time is left -> certificate-fla-safe-gate-cuda.json
#
#   device run (kind nvidia-h200, carry [".flashkda", ".whl"]):   bash benchmarks/run_flashkda_gpu.sh
#
# Each step runs under `timeout` within FLASHKDA_BUDGET_S (default 570 s); a step that fails or
# times out is logged and the next one runs. The summary prints last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/flashkda.log
BUDGET=${FLASHKDA_BUDGET_S:-570}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
: >"$LOG"
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }
SUMMARY=()

# packages the machine lacks (fla-core, array-api-compat, ...) travel as wheels in .whl
if ls .whl/*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"

# -- build ----------------------------------------------------------------------------------------
FK=$(OUT=$OUT timeout -k 10 "$(left)" bash benchmarks/build_flashkda.sh 2>&1 | tee -a "$LOG" | tail -1)
if [ -n "$FK" ] && [ -d "$FK" ] && PYTHONPATH=$FK:$PYTHONPATH "$PY" -c "import flash_kda" 2>>"$LOG"; then
    export PYTHONPATH=$FK:$PYTHONPATH
    SUMMARY+=("build: FlashKDA imports from $FK")
else
    SUMMARY+=("build: FAILED (flashkda-build.log, flashkda.log); the FlashKDA steps below report it missing")
fi
log "${SUMMARY[-1]}"

certify() {  # certify NAME LIMIT ARGS...: parity certify under timeout; its exit status echoed
    local name=$1 limit=$2; shift 2
    local l; l=$(left); ((limit > l - 5)) && limit=$((l - 5))
    if ((limit < 20)); then log "SKIP $name: budget spent"; echo 124; return; fi
    log "start $name (limit ${limit}s): parity certify $*"
    timeout -k 10 "$limit" "$PY" -m parity.cli certify "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -25 "$OUT/$name.log" >>"$LOG"
    log "end $name rc=$rc"
    echo $rc
}

# -- FlashKDA under the bounded gate ----------------------------------------------------------------
"$PY" benchmarks/flashkda_cases.py /tmp/flashkda-long.safetensors --tokens 16384 --heads 1 >>"$LOG" 2>&1
rc=$(certify certify-flashkda 240 --impl flashkda --ops kda.fused_chunked+lower_bound --device cuda \
    --dtype bfloat16 --examples 30 --cases /tmp/flashkda-long.safetensors --repro "$OUT/repro" \
    --json "$OUT/certificate-flashkda-cuda.json" | tail -1)
SUMMARY+=("certify flashkda (bounded gate): rc=$rc (1: not certified, as expected of 1ce47ea)")
SUMMARY+=("$("$PY" - "$OUT" <<'PY' 2>&1
import json, os, subprocess, sys
out = sys.argv[1]
try:
    doc = json.load(open(os.path.join(out, "certificate-flashkda-cuda.json")))
except Exception as exc:
    print(f"NaN check: no certificate ({type(exc).__name__}: {exc})"); sys.exit()
op = doc["ops"][0]
cases = [c for r in op["runs"].values() for c in r["cases"]]
nan = [c for c in cases if "non-finite" in c["summary"] and "where the reference is finite" in c["summary"]]
judged = [c for c in cases if c["passed"] is not None]
print(f"NaN check: {len(nan)} of {len(cases)} judged input(s) non-finite where the reference is finite; "
      f"worst ratio {op['worst_ratio']}; unsupported {[r['unsupported'] for r in op['runs'].values()]}")
for c in nan[:3]:
    print(f"  NaN input: {c['label']}")
root = os.path.join(out, "repro")
folders = sorted(os.listdir(root)) if os.path.isdir(root) else []
labels = {c["label"] for c in nan}
for f in folders:
    meta = json.load(open(os.path.join(root, f, "meta.json")))
    if meta["label"] not in labels:
        continue
    res = subprocess.run([sys.executable, os.path.join(root, f, "repro.py")], capture_output=True, text=True,
                         timeout=180)
    last = res.stdout.strip().splitlines()[-1:] or [res.stderr.strip()[-300:]]
    print(f"  repro of {meta['label']}: rc={res.returncode} (1: fails again), "
          f"{'NaN again' if 'nan vs' in res.stdout else 'no NaN'}; {last[0]}")
    break
else:
    print(f"  no repro folder of a NaN input among {len(folders)}")
PY
)")
[ -d "$OUT/repro" ] && tar czf "$OUT/repro.tar.gz" -C "$OUT" repro && rm -rf "$OUT/repro"

rc=$(certify certify-flashkda-softplus 60 --impl flashkda --ops kda.fused_chunked --variant kda_gate=softplus \
    --device cuda --dtype bfloat16 --examples 1 --json "$OUT/certificate-flashkda-softplus.json" | tail -1)
SUMMARY+=("certify flashkda as the softplus gate: rc=$rc (must be 1): $(grep -o 'computes only the bounded gate[^;]*' "$OUT/certify-flashkda-softplus.log" | head -1)")

# -- the side-by-side benchmark ---------------------------------------------------------------------
l=$(left); lim=$((l - 60)); ((lim > 240)) && lim=240   # leaves fla's certification a minute at least
if ((lim > 40)); then
    log "start bench (limit ${lim}s)"
    timeout -k 10 $lim "$PY" benchmarks/bench_kda.py --bounded --out "$OUT/kda-bounded.json" \
        --md "$OUT/kda-bounded.md" >>"$LOG" 2>&1
    SUMMARY+=("bench: rc=$? ($(($(grep -c '^| [18] |' "$OUT/kda-bounded.md" 2>/dev/null || echo 0))) rows in kda-bounded.md)")
else
    SUMMARY+=("bench: SKIPPED (budget spent)")
fi

# -- fla-core's safe-gate path ----------------------------------------------------------------------
rc=$(certify certify-fla-safe-gate 200 --impl fla --ops kda.gate+lower_bound kda.fused_recurrent+lower_bound \
    kda.fused_chunked+lower_bound --device cuda --json "$OUT/certificate-fla-safe-gate-cuda.json" | tail -1)
SUMMARY+=("certify fla safe gate: rc=$rc; $(grep -E 'op\(s\) certified' "$OUT/certify-fla-safe-gate.log" | tail -1)")

echo
echo "== run_flashkda_gpu.sh summary (${SECONDS}s; files in $OUT: $(ls "$OUT" | tr '\n' ' '))"
for s in "${SUMMARY[@]}"; do echo "$s"; done
[ -f "$OUT/kda-bounded.md" ] && cat "$OUT/kda-bounded.md"
