#!/usr/bin/env bash
# The offline engine with the KV store on one machine (the cluster is deploy/local/run.sh),
# everything on loopback, small model on the CPU backend:
#   1. builds the project (build/);
#   2. writes a random-weight `demo` checkpoint (di-mkmodel, with its checksum manifest) and
#      starts the KV store (di-kvstore) for it with engine and admin tokens, RocksDB in a temp dir;
#   3. generates text with the offline NORMAL engine (di-generate: scheduler, V4.1 forward on the
#      CPU, speculative decoding with the draft model, sampler) on the `demo` config (random
#      weights, the DeepSeek tokenizer's vocabulary), twice on the same long prompt with the KV
#      store: the first run stores the prompt's KV, the second loads its cached prefix and
#      prefills only the rest, with the same text;
#   4. shows what the store holds (di-kvctl stats, inspect of the prompt);
#   5. runs the scheduler simulator (di-sim) on two ranks, and sizes the KV of V4.1-Flash
#      (di-plan kv);
#   6. stops the store and removes its data.
# Options: --keep keeps the temp dir; --prompt TEXT changes the prompt.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

keep=0
prompt="The capital of France is"
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep=1 ;;
    --prompt) prompt=$2; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "offline.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

step() { printf '\n== %s\n' "$*"; }

step "build"
deploy/local/build.sh kvstore/di-kvstore kvstore/di-kvctl tools/generate/di-generate \
  tools/mkmodel/di-mkmodel tools/sim/di-sim tools/plan/di-plan

work=$(mktemp -d /tmp/deepinfer-local.XXXXXX)
store_pid=
cleanup() {
  if [ -n "$store_pid" ] && kill -0 "$store_pid" 2>/dev/null; then
    kill -TERM "$store_pid" 2>/dev/null || true
    wait "$store_pid" 2>/dev/null || true
  fi
  if [ "$keep" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

step "a random-weight demo checkpoint with its checksum manifest: di-mkmodel demo"
build/tools/mkmodel/di-mkmodel --quiet demo "$work/demo"

step "KV store on loopback, for that checkpoint (model id from its config and manifest)"
head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/engine.token"
head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/admin.token"
build/kvstore/di-kvstore --dir "$work/kv" --listen 127.0.0.1:0 --port-file "$work/port" \
  --model "$work/demo" --token-file "$work/engine.token" --admin-token-file "$work/admin.token" \
  --dram-bytes 64MiB --disk-bytes 1GiB --log-level warn >"$work/kvstore.log" 2>&1 &
store_pid=$!
for _ in $(seq 1 200); do
  [ -s "$work/port" ] && break
  kill -0 "$store_pid" 2>/dev/null || { cat "$work/kvstore.log" >&2; exit 1; }
  sleep 0.05
done
[ -s "$work/port" ] || { echo "offline.sh: di-kvstore did not start" >&2; cat "$work/kvstore.log" >&2; exit 1; }
addr=127.0.0.1:$(cat "$work/port")
echo "di-kvstore serving on $addr (pid $store_pid, data in $work/kv)"

step "generate twice with the KV store: di-generate --model demo (random weights, so the text is noise)"
# a long system prompt (whole 128-token blocks to cache) and the question
system=$(for i in $(seq 1 30); do printf 'Rule %d: answer briefly, and name the source of every number you give. ' "$i"; done)
printf '%s Question: %s' "$system" "$prompt" >"$work/prompt.txt"
for run in 1 2; do
  echo "-- run $run"
  build/tools/generate/di-generate --model "$work/demo" --prompt "$(cat "$work/prompt.txt")" \
    --max-tokens 24 --temperature 0.8 --seed 7 --kvstore "$addr" \
    --kvstore-token-file "$work/engine.token" >"$work/run$run.out" 2>"$work/run$run.err"
  grep -E 'model id|prompt 1:|KV store:|prefill|warning' "$work/run$run.err" | sed 's/^di-generate: /  /'
  grep '^text' "$work/run$run.out" | sed 's/^/  /'
done
if cmp -s "$work/run1.out" "$work/run2.out"; then echo "same tokens and text in both runs"
else echo "offline.sh: the run with the cached prefix gave other tokens" >&2; exit 1; fi

step "what the store holds: di-kvctl stats, inspect of the prompt"
export DI_KVSTORE_TARGET=$addr
export DI_KVSTORE_ADMIN_TOKEN=$(cat "$work/admin.token")
build/kvstore/di-kvctl stats
build/kvstore/di-kvctl inspect --text "$work/prompt.txt" --bos

step "scheduler simulation: di-sim, 2 ranks, 400 requests"
build/tools/sim/di-sim --requests 400 --rate 20 --ranks 2 --async --seed 1

step "KV sizes of DeepSeek-V4.1-Flash: di-plan kv"
echo '{"config": "v41-flash", "tokens": [16389, 50000]}' | build/tools/plan/di-plan kv

step "stop"
kill -TERM "$store_pid"
wait "$store_pid" && echo "di-kvstore stopped cleanly"
store_pid=
