#!/usr/bin/env bash
# Builds the project in build/ (meson setup on the first run, then ninja) and checks that the
# programs named as arguments (paths under build/) were built: the first step of run.sh and
# offline.sh. usage: deploy/local/build.sh [kvstore/di-kvstore ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=debugoptimized >/dev/null
fi
ninja -C build >/dev/null
for b in "$@"; do
  [ -x "build/$b" ] || { echo "build.sh: build/$b was not built (missing dependencies? run deploy/local/install-deps.sh)" >&2; exit 1; }
done
tok=data/tokenizer/deepseek-v3/tokenizer.json
[ -f "$tok" ] || { echo "build.sh: $tok is missing: run deploy/local/install-deps.sh" >&2; exit 1; }
echo "built in build/"
