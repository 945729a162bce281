#!/usr/bin/env bash
# The peer tests (transformers' own KimiLinear as an engine, the watch of its KDA functions, the
# checkpoints its save_pretrained writes) against one transformers release, in a throwaway
# environment layered over the current one: only transformers and what that release needs beyond
# the current environment are installed there, so a run takes seconds, not a fresh install.
#
#   bash tools/peers.sh oldest     # the test extra's lower bound (CI runs this after the suite)
#   bash tools/peers.sh latest     # the newest release on the registry, past the tested range
#   bash tools/peers.sh 5.21.0     # any one release
#
# The suite itself runs against what the test extra installs: the newest release inside the
# tested range (pyproject.toml, `transformers>=A,<B`). To move the range up: `bash tools/peers.sh
# latest`; where it passes, raise B past that release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
want=${1:-oldest}
range=$(sed -nE 's/^test = .*"transformers([^"]*)".*/\1/p' pyproject.toml)
case "$want" in
    oldest) version=$(echo "$range" | sed -nE 's/.*>=([0-9][0-9.]*).*/\1/p') ;;
    latest) version=$("$PY" -m pip index versions transformers 2>/dev/null | sed -nE 's/^transformers \(([^)]*)\).*/\1/p') ;;
    *) version=$want ;;
esac
[ -n "$version" ] || { echo "error: no transformers release for '$want' (tested range: transformers$range)" >&2; exit 2; }
env=${PEERS_ENV:-$(mktemp -d)/transformers-$version}
"$PY" -m venv "$env"
base=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# the current environment's packages after the layer's own (a .pth line that imports runs at start-up)
echo "import site; site.addsitedir('$base')" >"$site/zz-base.pth"
"$env/bin/python" -m pip install -q --no-compile --disable-pip-version-check "transformers==$version"
echo "peers.sh: transformers $version (tested range: transformers$range) in $env"
# the tests of these files that run transformers (its name in theirs, or in their file's)
exec "$env/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile -k transformers \
    tests/parity/diff/test_engines.py tests/parity/record/test_watch.py tests/kimi/test_transformers_layout.py
