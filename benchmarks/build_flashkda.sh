#!/usr/bin/env bash
# Build Moonshot's FlashKDA for the H100/H200 (sm_90a) from the carried sources: FlashKDA at commit
# 1ce47ea with CUTLASS's headers (include/, tools/util/include, examples/common) at the commit its
# submodule pins, its setup.py's `git submodule` call removed (.flashkda/flashkda-1ce47ea.tar.gz, an
# ignored folder: carry it; benchmarks/pack_flashkda.sh makes it from git clones of both). Builds
# into FLASHKDA_DIR (default /tmp/flashkda) in about 90-120 s and prints, last, the folder to put on
# PYTHONPATH (`import flash_kda` then works). Exit 2 without the tarball, 1 when the build or the
# import fails (the build log's tail printed).
#
#   device run (kind nvidia-h200, carry [".flashkda"]):   bash benchmarks/build_flashkda.sh
set -u
cd "$(dirname "$0")/.."
TARBALL=${FLASHKDA_TARBALL:-.flashkda/flashkda-1ce47ea.tar.gz}
DEST=${FLASHKDA_DIR:-/tmp/flashkda}
LOG=${FLASHKDA_LOG:-${OUT:-/tmp}/flashkda-build.log}
PY=${PYTHON:-python3}
[ -f "$TARBALL" ] || { echo "error: $TARBALL not found (carry the .flashkda folder; benchmarks/pack_flashkda.sh makes it)"; exit 2; }
rm -rf "$DEST" && mkdir -p "$DEST" && tar xzf "$TARBALL" -C "$DEST" || { echo "error: cannot unpack $TARBALL"; exit 2; }
SRC=$DEST
[ -f "$SRC/setup.py" ] || SRC=$(dirname "$(ls "$DEST"/*/setup.py 2>/dev/null | head -1)")
[ -f "$SRC/setup.py" ] || { echo "error: no setup.py in $TARBALL"; exit 2; }
if grep -q '^[^#]*subprocess.run(\["git", "submodule"' "$SRC/setup.py"; then
    echo "error: $SRC/setup.py still calls git submodule (the machine reaches no network): carry the sources without it"
    exit 2
fi
echo "building FlashKDA in $SRC (FLASH_KDA_CUDA_ARCHS=90a, MAX_JOBS=16); log: $LOG"
t0=$SECONDS
( cd "$SRC" && FLASH_KDA_CUDA_ARCHS=90a MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-8} \
    "$PY" setup.py build_ext --inplace ) >"$LOG" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    tail -30 "$LOG"
    echo "error: FlashKDA build failed (rc=$rc after $((SECONDS - t0)) s; $LOG)"
    exit 1
fi
echo "built in $((SECONDS - t0)) s"
PYTHONPATH=$SRC "$PY" -c 'import flash_kda, flash_kda_C, os; print("flash_kda imports from", os.path.dirname(os.path.dirname(os.path.abspath(flash_kda.__file__))))' \
    || { echo "error: the build does not import"; exit 1; }
echo "$SRC"
