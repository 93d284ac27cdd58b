#!/usr/bin/env bash
# Benchmark: di-kvstore vs Redis vs memcpy on this machine, in one run, like for like.
# Starts di-kvstore (RocksDB in a temp dir, --durability wal: every put is in the WAL, in the
# OS page cache, before it is acknowledged) and redis-server on loopback with the comparable
# setting (appendonly yes, appendfsync everysec: every write is in the AOF, in the OS page
# cache, before the reply; fsync once a second), runs kvbench against both, stops both on any
# exit. usage: bench.sh DI_KVSTORE KVBENCH [kvbench options]
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

store_args=(--durability "${DI_KVBENCH_DURABILITY:-wal}" --dram-bytes 1100MiB
            --dram-window-share 0.01 --dram-handoff-share 0.01 --memtable-bytes 64MiB
            --threads "${DI_KVBENCH_STORE_THREADS:-16}")
redis_args=(--save '' --appendonly yes --appendfsync everysec)
"$store_bin" --listen 127.0.0.1:0 --port-file "$work/port" --dir "$work/db" \
  "${store_args[@]}" --log-level warn 2>"$work/store.log" &
store_pid=$!
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$work" "${redis_args[@]}" \
  --maxmemory 0 --protected-mode no --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 100); do
  [ -s "$work/port" ] && redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
[ -s "$work/port" ] || { echo "bench.sh: di-kvstore did not start:" >&2; cat "$work/store.log" >&2; exit 1; }
redis_version=$(redis-server --version | awk '{print $3}' | sed 's/v=//')
echo "bench.sh: di-kvstore on port $(cat "$work/port"), redis-server $redis_version on port $redis_port" >&2
"$bench_bin" --store "127.0.0.1:$(cat "$work/port")" --redis "127.0.0.1:$redis_port" \
  --core-dir "$work/core" --core-durability "${DI_KVBENCH_DURABILITY:-wal}" \
  --store-conf "di-kvstore ${store_args[*]} (RocksDB WAL without fsync: acknowledged puts survive kill -9)" \
  --redis-conf "redis-server $redis_version $(printf "%q " "${redis_args[@]}")(AOF written before the reply, fsync every second)" \
  "$@"
