#!/usr/bin/env bash
# Correctness on one GPU in one call: every test file on CUDA (GPU-only tests included) and
# `parity certify --device cuda`, side by side (correctness only; nothing here is timed), logs and
# the certificate JSON under $OUT; the certificate's verdicts and worst ratios are compared op by op
# with docs/runs/certificate-cuda.json. The record of the run, docs/runs/gpu-check.json (and a copy
# under $OUT), says which code ran (benchmarks/code_digest.py), each file's pass/fail/skip/error
# counts, certify's summary, and whether the run is green (benchmarks/gpu_check.py).
#
#   device run (kind nvidia-h200, carry [".whl"]):   bash benchmarks/check_gpu.sh [pytest selection...]
#   (each selection, default every tests/**/test_*.py file, runs as its own pytest process, at most
#   CHECK_JOBS at a time, largest files first: a CUDA fault in one file cannot fail the others; the
#   files in CHECK_SPREAD first, on CHECK_SPREAD_WORKERS (4) xdist workers each; logs merged into
#   pytest.log; the JUnit XMLs, exit codes and pytest.log packed into parts.tar.gz)
#
# CHECK_RESUME=DIR completes an earlier run of the same code in a second call: DIR holds that run's
# gpu-check.json and parts.tar.gz (and certificate-cuda.json); its reports are taken as they are, the
# selections it left unfinished (default selection) run again, certify too if it did not pass, and
# the record names the earlier run (benchmarks/gpu_check.py).
#
# CHECK_LIMIT_S (default 540: the whole run, install and summary included, stays inside a 600 s
# device call) bounds each job, CHECK_DEADLINE_S (default CHECK_LIMIT_S) the tests all together (a
# file not started by then is an error); CHECK_JOBS (default: the CPU count) how many run at once;
# CHECK_CERTIFY=0 leaves the certificate out (then the run is not green). The summaries print last
# (a device call returns the tail of its output).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
START=$(date +%s.%N)
export PYTHONUNBUFFERED=1
# packages the machine lacks (array-api-compat; fla-core for the peer checks) travel as wheels in .whl
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# installed (not just on PYTHONPATH) so pytest finds the parity plugin's entry point
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "pip install -e . failed (see install.log): PYTHONPATH only"; export PYTHONPATH=$PWD; }
RESUME=${CHECK_RESUME:-}
if [ -n "$RESUME" ]; then  # refused (one line, exit 2) unless that run was of this code
    python3 benchmarks/gpu_check.py --can-resume "$RESUME" || exit 2
    [ $# -gt 0 ] || set -- $(python3 benchmarks/gpu_check.py --unfinished "$RESUME")
    [ $# -gt 0 ] || { echo "check_gpu.sh: the run in $RESUME left nothing unfinished: its record stands"; exit 0; }
fi
LIMIT=${CHECK_LIMIT_S:-540}
JOBS=${CHECK_JOBS:-$(nproc)}
# many processes side by side: each gets a share of the cores, not torch's whole pool
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# the files whose Triton compiles or float64 references at model sizes dominate run on
# CHECK_SPREAD_WORKERS pytest-xdist workers (where xdist is installed), and start first
SPREAD=" ${CHECK_SPREAD-tests/parity/certify/test_certify_fla_chunked.py tests/optimized/test_mla_gpu.py tests/optimized/test_kda_gpu.py tests/optimized/test_kda.py tests/optimized/test_mla.py tests/optimized/test_moe.py tests/optimized/test_norm.py tests/optimized/test_conv.py tests/parity/certify/test_optimized.py tests/parity/certify/test_certify_impl.py tests/parity/diff/test_engines.py tests/parity/certify/test_search.py} "
SEL=${*:-$(for f in $SPREAD; do [ -f "$f" ] && echo "$f"; done; ls -S $(find tests -name 'test_*.py') | grep -vxF -f <(printf '%s\n' $SPREAD))}
echo "check_gpu.sh: $(echo $SEL | wc -w) pytest selections ($JOBS at a time) and parity certify --device cuda, ${LIMIT}s each"
rm -f "$OUT"/rc-* "$OUT"/junit-*.xml "$OUT"/pytest-*.log
CERTIFY=${CHECK_CERTIFY:-1}
if [ -n "$RESUME" ]; then  # the earlier run's reports (and its certificate, where certify passed)
    tar -C "$OUT" -xzf "$RESUME/parts.tar.gz" $(tar -tzf "$RESUME/parts.tar.gz" | grep -E '^(junit-.*\.xml|rc-.*)$')
    for sel in $SEL; do rm -f "$OUT/rc-$(echo "${sel%.py}" | tr / -)" "$OUT/junit-$(echo "${sel%.py}" | tr / -).xml"; done
    if [ "$(cat "$OUT/rc-certify" 2>/dev/null)" = 0 ] && cp "$RESUME/certificate-cuda.json" "$OUT/"; then CERTIFY=0; fi
fi
if [ "$CERTIFY" != 0 ]; then  # first: the longest job
    ( timeout -k 10 "$LIMIT" python3 -m parity.cli certify --device cuda --json "$OUT/certificate-cuda.json" \
        >"$OUT/certify-cuda.log" 2>&1; rc=$?; echo "certify rc=$rc" >>"$OUT/certify-cuda.log"; echo $rc >"$OUT/rc-certify" ) &
fi
# every log line is stamped with the seconds since its file started
XDIST=0; python3 -c "import xdist" 2>/dev/null && XDIST=${CHECK_SPREAD_WORKERS:-4}
one() {  # one pytest process per selection (compiles use the CPUs), within the run's deadline
    sel=$1; name=$(echo "${sel%.py}" | tr / -)
    left=$((END - $(date +%s))); [ "$left" -lt "$LIMIT" ] || left=$LIMIT
    if [ "$left" -le 0 ]; then echo "pytest $sel not started: the run's deadline passed" >"$OUT/pytest-$name.log"; echo 124 >"$OUT/rc-$name"; return; fi
    spread=(); [ "$XDIST" -gt 1 ] && [[ "$SPREAD" == *" $sel "* ]] && spread=(-n "$XDIST")
    # the first selection is the run's critical path (its compiles): the others yield the CPUs to it
    nice=(); [ "$sel" = "$FIRST" ] || nice=(nice -n 10)
    timeout -k 10 "$left" "${nice[@]}" python3 -m pytest -v -p no:cacheprovider -rfEs --durations=10 "${spread[@]}" \
        --junitxml="$OUT/junit-$name.xml" "$sel" 2>&1 \
        | python3 -u -c 'import sys, time; t = time.time(); [print(f"{time.time() - t:6.1f} {l}", end="", flush=True) for l in iter(sys.stdin.readline, "")]' \
        >"$OUT/pytest-$name.log"
    rc=${PIPESTATUS[0]}; echo "pytest $sel rc=$rc" >>"$OUT/pytest-$name.log"; echo $rc >"$OUT/rc-$name"
}
END=$(( $(date +%s) + ${CHECK_DEADLINE_S:-$LIMIT} ))
FIRST=$(printf '%s\n' $SEL | head -n 1)
export -f one; export OUT LIMIT END SPREAD XDIST FIRST
printf '%s\n' $SEL | xargs -P "$JOBS" -I{} bash -c 'one {}'
wait
SUMMARY=$(for f in "$OUT"/pytest-*.log; do
    grep -qE "^ *[0-9.]+ (FAILED|ERROR) |rc=[1-9]" "$f" || continue
    echo "== $(basename "$f")"
    grep -E "^ *[0-9.]+ (FAILED|ERROR) | (passed|failed)|rc=" "$f" | tail -n 30
done)
for f in "$OUT"/pytest-*.log; do echo "######## $(basename "$f")"; cat "$f"; done >"$OUT/pytest.log"
rm -f "$OUT"/pytest-*.log
if [ "$CERTIFY" != 0 ]; then
    tail -n 40 "$OUT/certify-cuda.log"
    # op by op against the committed certificate: a change that keeps every bit keeps every verdict
    # and worst ratio (certify's inputs are derandomized)
    [ -f "$OUT/certificate-cuda.json" ] && python3 - "$OUT/certificate-cuda.json" docs/runs/certificate-cuda.json <<'PY' || true
import json, sys
new, old = ({o["op"]: (o["verdict"], o["worst_ratio"]) for o in json.load(open(p))["ops"]} for p in sys.argv[1:])
differ = sorted(op for op in new.keys() | old.keys() if new.get(op) != old.get(op))
print(f"certificate against {sys.argv[2]}: {len(new)} ops, verdicts and worst ratios "
      + ("the same" if not differ else "differ: " + "; ".join(f"{op} {old.get(op)} -> {new.get(op)}" for op in differ)))
PY
fi
echo "$SUMMARY"
WALL=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$START" "$(date +%s.%N)")
python3 benchmarks/gpu_check.py "$OUT" "$WALL" --write docs/runs/gpu-check.json --write "$OUT/gpu-check.json" \
    ${RESUME:+--resumed-from "$RESUME"}
# a device call brings back only a few files: the per-file parts travel as one archive
tar -C "$OUT" -czf "$OUT/parts.tar.gz" $(cd "$OUT" && ls junit-*.xml rc-* 2>/dev/null) pytest.log \
    && rm -f "$OUT"/junit-*.xml "$OUT"/rc-* "$OUT/pytest.log"
