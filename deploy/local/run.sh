#!/usr/bin/env bash
# The main job: builds the project and runs the local deployment on loopback with a small
# model on the CPU backend. It grows with the project: today it builds everything and runs the
# offline pieces that exist.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=debugoptimized
fi
ninja -C build
meson introspect build --targets | python3 -c 'import json,sys; print("built:", " ".join(sorted(t["name"] for t in json.load(sys.stdin) if t["type"]=="executable" and t["name"].startswith("di-"))) or "(no binaries yet)")'
