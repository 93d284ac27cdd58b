#!/usr/bin/env bash
# Benchmark: di-kvstore vs Redis vs memcpy on this machine, in one run.
# Starts di-kvstore (RocksDB in a temp dir, --durability none like Redis without persistence)
# and redis-server on loopback, runs kvbench against both, stops both on any exit.
# usage: bench.sh DI_KVSTORE KVBENCH [kvbench options]
set -euo pipefail
store_bin=${1:?path to di-kvstore}; bench_bin=${2:?path to kvbench}; shift 2
command -v redis-server >/dev/null || { echo "bench.sh: redis-server not found (apt-get install redis-server)" >&2; exit 1; }
work=$(mktemp -d /tmp/di-kvbench-XXXXXX)
store_pid= redis_pid=
cleanup() {
  [ -n "$store_pid" ] && kill "$store_pid" 2>/dev/null && wait "$store_pid" 2>/dev/null || true
  [ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

"$store_bin" --listen 127.0.0.1:0 --port-file "$work/port" --dir "$work/db" \
  --durability none --dram-bytes 1300MiB --dram-window-share 0.01 --dram-handoff-share 0.01 \
  --memtable-bytes 64MiB --log-level warn 2>"$work/store.log" &
store_pid=$!
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
  --maxmemory 0 --protected-mode no --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 100); do
  [ -s "$work/port" ] && redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
[ -s "$work/port" ] || { echo "bench.sh: di-kvstore did not start:" >&2; cat "$work/store.log" >&2; exit 1; }
echo "bench.sh: di-kvstore on port $(cat "$work/port"), redis-server $(redis-server --version | awk '{print $3}') on port $redis_port" >&2
"$bench_bin" --store "127.0.0.1:$(cat "$work/port")" --redis "127.0.0.1:$redis_port" "$@"
