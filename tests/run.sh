#!/usr/bin/env bash
# Builds the project in build/ and runs every test (unit, integration, property tests).
# Criterion's "Synthesis" lines are printed for each test binary (meson test --verbose).
# Extra arguments go to `meson test` (e.g. a suite name: tests/run.sh --suite engine).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=debugoptimized
fi
ninja -C build
meson test -C build --verbose --num-processes 2 "$@"
