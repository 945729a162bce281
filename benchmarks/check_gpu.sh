#!/usr/bin/env bash
# Correctness on one GPU in one call: the test suite on CUDA (GPU-only tests included) and
# `parity certify --device cuda`, side by side (correctness only; nothing here is timed), logs and
# the certificate JSON under $OUT; the certificate's verdicts and worst ratios are compared op by op
# with docs/runs/certificate-cuda.json.
#
#   device run (kind nvidia-h200, carry [".whl"]):   bash benchmarks/check_gpu.sh [pytest selection...]
#   (each selection, default every tests/optimized file, tests/parity and tests/reference, runs as
#   its own pytest process: a CUDA fault in one file cannot fail the others; logs merged into
#   pytest.log)
#
# CHECK_LIMIT_S (default 330) bounds each job; CHECK_CERTIFY=0 leaves the certificate out. The
# pytest summaries print last (a device call returns the tail of its output).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# packages the machine lacks (array-api-compat; fla-core for the peer checks) travel as wheels in .whl
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# installed (not just on PYTHONPATH) so pytest finds the parity plugin's entry point
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "pip install -e . failed (see install.log): PYTHONPATH only"; export PYTHONPATH=$PWD; }
LIMIT=${CHECK_LIMIT_S:-330}
SEL=${*:-$(ls tests/optimized/test_*.py) tests/parity tests/reference}
echo "check_gpu.sh: pytest $SEL and parity certify --device cuda, ${LIMIT}s each"
for sel in $SEL; do  # one pytest process per selection, side by side (compiles use the CPUs)
    name=$(basename "${sel%.py}")
    ( timeout -k 10 "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfs --durations=10 "$sel" \
        >"$OUT/pytest-$name.log" 2>&1; echo "pytest $sel rc=$?" >>"$OUT/pytest-$name.log" ) &
done
CERTIFY=${CHECK_CERTIFY:-1}
if [ "$CERTIFY" != 0 ]; then
    ( timeout -k 10 "$LIMIT" python3 -m parity.cli certify --device cuda --json "$OUT/certificate-cuda.json" \
        >"$OUT/certify-cuda.log" 2>&1; echo "certify rc=$?" >>"$OUT/certify-cuda.log" ) &
fi
wait
SUMMARY=$(for f in "$OUT"/pytest-*.log; do
    echo "== $(basename "$f")"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$f" | tail -n 30
done)
for f in "$OUT"/pytest-*.log; do echo "######## $(basename "$f")"; cat "$f"; done >"$OUT/pytest.log"
rm -f "$OUT"/pytest-*.log
[ "$CERTIFY" != 0 ] || { echo "$SUMMARY"; exit 0; }
tail -n 40 "$OUT/certify-cuda.log"
# op by op against the committed certificate: a change that keeps every bit keeps every verdict and
# worst ratio (certify's inputs are derandomized)
python3 - "$OUT/certificate-cuda.json" docs/runs/certificate-cuda.json <<'PY' || true
import json, sys
new, old = ({o["op"]: (o["verdict"], o["worst_ratio"]) for o in json.load(open(p))["ops"]} for p in sys.argv[1:])
differ = sorted(op for op in new.keys() | old.keys() if new.get(op) != old.get(op))
print(f"certificate against {sys.argv[2]}: {len(new)} ops, verdicts and worst ratios "
      + ("the same" if not differ else "differ: " + "; ".join(f"{op} {old.get(op)} -> {new.get(op)}" for op in differ)))
PY
echo "$SUMMARY"
