#!/usr/bin/env bash
# The build step of the images (deploy/docker/Dockerfile*), runnable on any machine that ran
# deploy/local/install-deps.sh: builds the services in release mode and lays out what the
# runtime stage copies:
#   OUT/usr/local/bin/         di-kvstore, di-kvctl, di-router, di-prefill, di-decode,
#                              di-mkmodel, di-generate (those this build has), di-healthcheck
#   OUT/usr/local/share/deepinfer/tokenizer.json
#   OUT/runtime-packages.txt   the packages that own the shared libraries they load
# usage: deploy/docker/build.sh [--builddir DIR] [--meson-args "ARGS"] OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
builddir=$root/build-image
meson_args=
out=
while [ $# -gt 0 ]; do
  case "$1" in
    --builddir) builddir=${2:?--builddir needs a directory}; shift ;;
    --meson-args) meson_args=${2?--meson-args needs a value}; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "build.sh: one OUT directory only" >&2; exit 2; }; out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "build.sh: give the OUT directory (see --help)" >&2; exit 2; }

cd "$root"
if [ ! -f "$builddir/build.ninja" ]; then
  # shellcheck disable=SC2086 # meson_args is a list of options
  meson setup "$builddir" --buildtype=release -Dtests=disabled $meson_args
fi
ninja -C "$builddir"

mkdir -p "$out/usr/local/bin" "$out/usr/local/share/deepinfer"
bins=()
for b in kvstore/di-kvstore kvstore/di-kvctl router/di-router prefill/di-prefill decode/di-decode \
         tools/mkmodel/di-mkmodel tools/generate/di-generate; do
  if [ -x "$builddir/$b" ]; then
    install -m 0755 "$builddir/$b" "$out/usr/local/bin/"
    bins+=("$out/usr/local/bin/$(basename "$b")")
  else
    echo "build.sh: $b is not in this build (missing dependencies or not written yet)"
  fi
done
for need in di-kvstore di-router; do
  [ -x "$out/usr/local/bin/$need" ] || { echo "build.sh: $need was not built" >&2; exit 1; }
done
install -m 0755 deploy/docker/healthcheck.sh "$out/usr/local/bin/di-healthcheck"
install -m 0644 data/tokenizer/deepseek-v3/tokenizer.json "$out/usr/local/share/deepinfer/tokenizer.json"

# the packages owning every shared library the binaries load (the runtime stage installs them)
# (and of UCX's transport modules, which it opens at run time: RDMA needs libibverbs)
mapfile -t ucx_modules < <(ls /usr/lib/*/ucx/*.so.0 2>/dev/null || true)
ldd "${bins[@]}" "${ucx_modules[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u >"$out/libs.txt"
: >"$out/runtime-packages.txt.tmp"
while read -r lib; do
  real=$(readlink -f "$lib")
  pkg=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null || true)
  if [ -z "$pkg" ]; then
    echo "build.sh: no package owns $lib (the runtime base must provide it)"
    continue
  fi
  echo "${pkg%%:*}" >>"$out/runtime-packages.txt.tmp"
done <"$out/libs.txt"
sort -u "$out/runtime-packages.txt.tmp" >"$out/runtime-packages.txt"
rm -f "$out/runtime-packages.txt.tmp" "$out/libs.txt"
echo "build.sh: ${#bins[@]} binaries in $out/usr/local/bin; runtime packages: $(tr '\n' ' ' <"$out/runtime-packages.txt")"
