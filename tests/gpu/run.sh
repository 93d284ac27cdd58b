#!/usr/bin/env bash
# One call on a GPU machine: builds the engine, model and kernels with CUDA (no service
# libraries), checks every CUDA kernel against its C twin on random and adversarial data, and
# runs the benchmarks, each printing its figure next to the hardware limit measured in the same
# run. Logs go to $OUT when it is set. Usage: tests/gpu/run.sh [--no-bench]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/build-gpu/logs}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0

# jansson is the one non-CUDA library the model needs; a machine without it gets the Debian
# packages carried in .gpu-deps/ (apt-get download libjansson4 libjansson-dev), unpacked here.
if ! pkg-config --exists jansson 2>/dev/null; then
  if compgen -G ".gpu-deps/*.deb" >/dev/null; then
    mkdir -p .gpu-deps/root
    for f in .gpu-deps/*.deb; do dpkg-deb -x "$f" .gpu-deps/root; done
    libdir=$root/.gpu-deps/root/usr/lib/x86_64-linux-gnu
    export PKG_CONFIG_PATH=$libdir/pkgconfig
    export PKG_CONFIG_SYSROOT_DIR=$root/.gpu-deps/root
    export LD_LIBRARY_PATH=$libdir:${LD_LIBRARY_PATH:-}
  else
    echo "run.sh: jansson not found and no .gpu-deps/*.deb to unpack" >&2
    exit 2
  fi
fi
meson_cmd=(meson)
command -v meson >/dev/null 2>&1 || meson_cmd=(python3 -m mesonbuild.mesonmain)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  nvcc --version | tail -2
  "${meson_cmd[@]}" --version
} 2>&1 | tee "$out/machine.txt"

if [ ! -f build-gpu/build.ninja ]; then
  "${meson_cmd[@]}" setup build-gpu --buildtype=release -Dservices=disabled -Dtests=disabled \
    -Dtokenizer=disabled -Dcuda=enabled >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 2; }
fi
ninja -C build-gpu >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 2; }

status=0
summary=()
for exe in build-gpu/tests/gpu/check_*; do
  [ -f "$exe" ] && [ -x "$exe" ] || continue
  name=$(basename "$exe")
  args=()
  [ "$bench" = 1 ] && args=(--bench)
  if "$exe" "${args[@]}" >"$out/$name.log" 2>&1; then
    summary+=("PASS $name")
  else
    summary+=("FAIL $name (exit $?)")
    status=1
  fi
  cat "$out/$name.log"
done
echo "== tests/gpu summary =="
printf '%s\n' "${summary[@]}"
exit $status
