#!/usr/bin/env bash
# Pack the FlashKDA sources that benchmarks/build_flashkda.sh builds, for a GPU machine without
# network: FlashKDA at 1ce47ea and, under its cutlass/, CUTLASS's headers (include/,
# tools/util/include, examples/common) at the commit FlashKDA's submodule pins, with setup.py's
# `git submodule` call commented out. Writes .flashkda/flashkda-1ce47ea.tar.gz (an ignored folder:
# name it in the device call's carry). Needs git clones (bare or not) of both repositories.
#
#   bash benchmarks/pack_flashkda.sh FLASHKDA_GIT_DIR CUTLASS_GIT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${FLASHKDA_REV:-1ce47ea}
OUT=.flashkda/flashkda-$REV.tar.gz
[ $# -eq 2 ] || { echo "usage: bash benchmarks/pack_flashkda.sh FLASHKDA_GIT_DIR CUTLASS_GIT_DIR"; exit 2; }
FK=$1 CUT=$2
git -C "$FK" cat-file -e "$REV^{commit}" 2>/dev/null || { echo "error: $FK has no commit $REV"; exit 2; }
PIN=$(git -C "$FK" ls-tree "$REV" cutlass | awk '$2 == "commit" {print $3}')
[ -n "$PIN" ] || { echo "error: FlashKDA $REV pins no cutlass submodule"; exit 2; }
git -C "$CUT" cat-file -e "$PIN^{commit}" 2>/dev/null || { echo "error: $CUT has no commit $PIN (the pinned CUTLASS)"; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/flashkda/cutlass"
git -C "$FK" archive "$REV" | tar -x -C "$TMP/flashkda"
git -C "$CUT" archive "$PIN" include tools/util/include examples/common | tar -x -C "$TMP/flashkda/cutlass"
# the machine reaches no network: the headers are already there
sed -i 's/^\(subprocess.run(\["git", "submodule".*\)$/# \1  (sources carried)/' "$TMP/flashkda/setup.py"
if grep -q '^[^#]*subprocess.run(\["git", "submodule"' "$TMP/flashkda/setup.py"; then
    echo "error: could not take setup.py's git submodule call out"; exit 1
fi
mkdir -p .flashkda
tar czf "$OUT.part" -C "$TMP" flashkda && mv "$OUT.part" "$OUT"
echo "wrote $OUT (FlashKDA $REV, CUTLASS $PIN headers; $(du -h "$OUT" | cut -f1))"
