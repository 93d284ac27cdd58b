#!/usr/bin/env bash
# The disaggregated cluster on this machine, every service on loopback:
#
#   deploy/local/cluster.sh up [--config NAME] [--prefill N] [--decode M] [--backend cpu|cuda]
#                              [--build DIR] [--state DIR] [--router-arg ARG]... [--keep]
#                              [--prefill-delay-ms LIST] [--decode-ep]
#   deploy/local/cluster.sh down STATE [--keep]
#
# up writes a random-weight checkpoint of --config (default demo: the DeepSeek tokenizer's
# vocabulary, 86 MB) once with di-mkmodel into the state dir, generates the tokens (engine token
# for the store and the ranks, the store's admin token, the router's admin and gRPC client
# tokens, an API key for the router's HTTP API), starts di-kvstore, N di-prefill ranks
# (default 1), M di-decode ranks (default 1) and di-router, each on 127.0.0.1 with a port it
# picks itself, waits until the router answers /health and /v1/models with the key, then prints
# shell-sourceable lines and returns with everything running:
#
#   router_http=http://127.0.0.1:PORT  router_grpc=127.0.0.1:PORT  kvstore=127.0.0.1:PORT
#   model=NAME  api_key_file=PATH (the bearer token alone; client auth is on)
#   admin_token_file=PATH (di-kvctl)  engine_token_file=PATH  state=DIR
#
# Logs are STATE/*.log. When a service fails to start, up prints which one and the end of its
# log, stops what it started and removes the state dir (unless --keep), and exits 1.
# --router-arg passes one more argument to di-router (repeat for more), e.g.
# --router-arg --policy --router-arg round-robin.
# --prefill-delay-ms LIST (TESTING ONLY) slows prefill ranks on purpose: the i-th number of the
# comma-separated LIST (0..10000, at most one per rank; missing ones are 0) is rank i's
# --step-delay-ms, a sleep in every engine step (e.g. --prefill 2 --prefill-delay-ms 0,1500).
# --decode-ep starts the M decode ranks (M >= 2, CPU backend) as one expert-parallel group
# (docs/ep.md): rank 0's group socket on a free loopback port, a group token in the state dir;
# the router still lists each rank as a backend.
# down stops every process up started (SIGTERM, SIGKILL after 30 s; only pids recorded in
# STATE/pids that still run a program of this cluster) and removes STATE unless --keep.
# Exit status: 0 done, 1 a failure, 2 bad usage.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
me=cluster.sh

usage_fail() { echo "$me: $*" >&2; exit 2; }
fail() { echo "$me: $*" >&2; exit 1; }
help() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; }

count_arg() { # name value: a whole number 1..16
  [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge 1 ] && [ "$2" -le 16 ] ||
    usage_fail "$1 wants a number of ranks 1..16, not '$2'"
}

# ---------------------------------------------------------------------------------------- down
# Stops the pids of STATE/pids, each only while /proc says it still runs a program of this
# cluster with this state dir on its command line (a recycled pid is left alone).
stop_all() { # state dir
  local state=$1 pid left=() _
  [ -f "$state/pids" ] || return 0
  while read -r pid; do
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    if ours "$pid" "$state"; then kill -TERM "$pid" 2>/dev/null && left+=("$pid"); fi
  done <"$state/pids"
  for _ in $(seq 1 300); do
    local still=()
    for pid in "${left[@]}"; do ours "$pid" "$state" && still+=("$pid"); done
    left=("${still[@]}")
    [ "${#left[@]}" = 0 ] && break
    sleep 0.1
  done
  for pid in "${left[@]}"; do
    echo "$me: pid $pid did not stop in 30 s after SIGTERM: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -f "$state/pids"
}

ours() { # pid state: the pid runs one of our programs with the state dir in its arguments
  local cmd
  cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline") || return 1
  [ -n "$cmd" ] || return 1 # a zombie: already exited
  case "$cmd" in *di-kvstore*|*di-prefill*|*di-decode*|*di-router*) ;; *) return 1 ;; esac
  case "$cmd" in *"$2"*) return 0 ;; *) return 1 ;; esac
}

cmd_down() {
  local state='' keep=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --keep) keep=1 ;;
      -h|--help) help; exit 0 ;;
      -*) usage_fail "down: unknown option $1 (see --help)" ;;
      *) [ -z "$state" ] || usage_fail "down: one state dir, not '$state' and '$1'"; state=$1 ;;
    esac
    shift
  done
  [ -n "$state" ] || usage_fail "down: give the state dir that up printed (state=DIR)"
  [ -d "$state" ] || fail "down: $state is not a directory"
  [ -f "$state/cluster.env" ] || fail "down: $state is not a cluster state dir (no cluster.env)"
  state=$(cd "$state" && pwd)
  stop_all "$state"
  if [ "$keep" = 1 ]; then echo "$me: stopped; kept $state"
  else rm -rf "$state"; echo "$me: stopped; removed $state"; fi
}

# ------------------------------------------------------------------------------------------ up
cmd_up() {
  local config=demo n_prefill=1 n_decode=1 backend=cpu build=$root/build state='' keep=0
  local router_args=() prefill_delays=() decode_ep=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --config) config=${2:?--config needs a NAME}; shift ;;
      --prefill) count_arg --prefill "${2:-}"; n_prefill=$2; shift ;;
      --decode) count_arg --decode "${2:-}"; n_decode=$2; shift ;;
      --backend)
        case "${2:-}" in cpu|cuda) backend=$2 ;; *) usage_fail "--backend wants cpu or cuda, not '${2:-}'" ;; esac
        shift ;;
      --build) [ -d "${2:-}" ] || usage_fail "--build: '${2:-}' is not a directory"; build=$(cd "$2" && pwd); shift ;;
      --state) state=${2:?--state needs a DIR}; shift ;;
      --router-arg) router_args+=("${2:?--router-arg needs an ARG}"); shift ;;
      --prefill-delay-ms)
        [[ "${2:-}" =~ ^[0-9]{1,5}(,[0-9]{1,5})*$ ]] ||
          usage_fail "--prefill-delay-ms wants numbers of ms like 0,1500, not '${2:-}'"
        IFS=, read -r -a prefill_delays <<<"$2"; shift ;;
      --keep) keep=1 ;;
      --decode-ep) decode_ep=1 ;;
      -h|--help) help; exit 0 ;;
      *) usage_fail "up: unknown option $1 (see --help)" ;;
    esac
    shift
  done
  [[ "$config" =~ ^[A-Za-z0-9._-]+$ ]] || usage_fail "--config: '$config' is not a config name"
  [ "${#prefill_delays[@]}" -le "$n_prefill" ] ||
    usage_fail "--prefill-delay-ms: ${#prefill_delays[@]} delays for $n_prefill prefill rank(s)"
  if [ "$decode_ep" = 1 ]; then
    [ "$n_decode" -ge 2 ] || usage_fail "--decode-ep: a group needs --decode 2 or more"
    [ "$backend" = cpu ] || usage_fail "--decode-ep: the group's exchange runs on the CPU backend only"
  fi
  local d
  for d in ${prefill_delays[@]+"${prefill_delays[@]}"}; do
    [ "$((10#$d))" -le 10000 ] || usage_fail "--prefill-delay-ms: $d is over 10000 ms"
  done
  for b in kvstore/di-kvstore kvstore/di-kvctl prefill/di-prefill decode/di-decode \
           router/di-router tools/mkmodel/di-mkmodel; do
    [ -x "$build/$b" ] || fail "$build/$b is not built (meson setup build && ninja -C build; missing libraries: deploy/local/install-deps.sh)"
  done
  local tok=$root/data/tokenizer/deepseek-v3/tokenizer.json
  [ -f "$tok" ] || fail "$tok is missing: run deploy/local/install-deps.sh"
  command -v curl >/dev/null || fail "curl is not installed (deploy/local/install-deps.sh)"

  if [ -n "$state" ]; then
    [ ! -e "$state" ] || [ -z "$(ls -A "$state")" ] || fail "--state $state exists and is not empty"
    mkdir -p "$state"
  else
    state=$(mktemp -d "${TMPDIR:-/tmp}/deepinfer-cluster.XXXXXX")
  fi
  state=$(cd "$state" && pwd)
  chmod 700 "$state"
  : >"$state/pids"

  # Any failure from here on: say which service, show its log's end, undo everything.
  local failed=1
  abort_up() {
    if [ "$failed" = 1 ]; then
      stop_all "$state"
      if [ "$keep" = 1 ]; then echo "$me: stopped what had started; kept $state" >&2
      else rm -rf "$state"; fi
    fi
  }
  trap abort_up EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM

  rand() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
  (umask 077
   rand >"$state/engine.token"        # the store and the ranks want it; the router presents it
   rand >"$state/kvstore-admin.token" # di-kvctl stats, inspect
   rand >"$state/router-admin.token"  # RegisterRank
   rand >"$state/router-grpc.token"   # Generate/Abort on the router's gRPC API
   rand >"$state/api.key"             # the HTTP API's bearer token
   rand >"$state/ep.token"            # the decode ranks' group (--decode-ep)
   printf 'local %s generate\n' "$(cat "$state/api.key")" >"$state/api-keys")

  echo "$me: writing the $config checkpoint (di-mkmodel) into $state/model" >&2
  "$build/tools/mkmodel/di-mkmodel" --quiet "$config" "$state/model" >"$state/mkmodel.log" 2>&1 ||
    fail "di-mkmodel $config failed: $(tail -n 3 "$state/mkmodel.log")"

  start() { # name, program, args...: in the background, logs in the state dir
    local name=$1 prog=$2; shift 2
    "$build/$prog" "$@" </dev/null >"$state/$name.log" 2>&1 &
    echo $! >>"$state/pids"
    eval "pid_${name//-/_}=$!"
  }
  wait_port() { # name, seconds: the port file appears, the process still runs
    local name=$1 pid _
    pid=$(eval echo "\$pid_${name//-/_}")
    for _ in $(seq 1 $(($2 * 10))); do
      [ -s "$state/$name.port" ] && return 0
      kill -0 "$pid" 2>/dev/null || {
        echo "$me: $name failed to start; the end of its log:" >&2
        tail -n 5 "$state/$name.log" | sed 's/^/  /' >&2
        exit 1; }
      sleep 0.1
    done
    echo "$me: $name did not announce its port in $2 s; the end of its log:" >&2
    tail -n 5 "$state/$name.log" | sed 's/^/  /' >&2
    exit 1
  }

  start kvstore kvstore/di-kvstore --listen 127.0.0.1:0 --port-file "$state/kvstore.port" \
    --dir "$state/kv" --model "$state/model" --durability none --dram-bytes 256MiB \
    --disk-bytes 1GiB --dram-handoff-share 0.25 --handoff-max-bytes 4MiB \
    --token-file "$state/engine.token" \
    --admin-token-file "$state/kvstore-admin.token" --log-level warn
  wait_port kvstore 60
  local kv
  kv=127.0.0.1:$(cat "$state/kvstore.port")

  local i rank_flags=() threads=1
  engine() { # role, index, world, extra args...
    start "$1$2" "$1/di-$1" --listen 127.0.0.1:0 --port-file "$state/$1$2.port" --drain 10s \
      --rank "$2" --world "$3" --model "$state/model" --backend "$backend" --threads "$threads" \
      --kvstore "$kv" --kvstore-token-file "$state/engine.token" \
      --token-file "$state/engine.token" --log-level warn "${@:4}"
  }
  for ((i = 0; i < n_prefill; i++)); do
    d=$((10#${prefill_delays[i]:-0}))
    if [ "$d" -gt 0 ]; then engine prefill "$i" "$n_prefill" --step-delay-ms "$d"
    else engine prefill "$i" "$n_prefill"; fi
  done
  local ep_flags=()
  if [ "$decode_ep" = 1 ]; then # a loopback port nothing answers on, for rank 0's group socket
    local p
    for _ in $(seq 1 50); do
      p=$((20000 + RANDOM % 40000))
      (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || break
    done
    ep_flags=(--ep-addr "127.0.0.1:$p" --ep-token-file "$state/ep.token")
  fi
  for ((i = 0; i < n_decode; i++)); do
    engine decode "$i" "$n_decode" ${ep_flags[@]+"${ep_flags[@]}"}
  done
  for ((i = 0; i < n_prefill; i++)); do
    wait_port "prefill$i" 120; rank_flags+=(--prefill "127.0.0.1:$(cat "$state/prefill$i.port")")
  done
  for ((i = 0; i < n_decode; i++)); do
    wait_port "decode$i" 120; rank_flags+=(--decode "127.0.0.1:$(cat "$state/decode$i.port")")
  done

  # The router announces its HTTP port in the port file and logs its gRPC port (info).
  start router router/di-router --listen 127.0.0.1:0 --listen-http 127.0.0.1:0 \
    --port-file "$state/router.port" --model "$config" --tokenizer "$tok" \
    --api-key-file "$state/api-keys" --token-file "$state/router-grpc.token" \
    --admin-token-file "$state/router-admin.token" --engine-token-file "$state/engine.token" \
    --kvstore "$kv" --log-level info "${rank_flags[@]}" ${router_args[@]+"${router_args[@]}"}
  wait_port router 60
  local http gport
  http=http://127.0.0.1:$(cat "$state/router.port")
  gport=$(sed -n 's/.*the gRPC API on [^ ]* (port \([0-9][0-9]*\)).*/\1/p' "$state/router.log" | head -n 1)
  [ -n "$gport" ] || { echo "$me: di-router did not log its gRPC port (log $state/router.log)" >&2; exit 1; }

  # Healthy: /health answers, and the model is served to the key (auth on: no key is a 401).
  local _ ok=0
  for _ in $(seq 1 100); do
    if curl -sf -m 5 "$http/health" >/dev/null &&
       curl -sf -m 5 -H "Authorization: Bearer $(cat "$state/api.key")" "$http/v1/models" |
         grep -q "\"$config\""; then ok=1; break; fi
    sleep 0.1
  done
  [ "$ok" = 1 ] || { echo "$me: di-router at $http is not healthy (log $state/router.log)" >&2; exit 1; }
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' -m 5 "$http/v1/models")
  [ "$code" = 401 ] || { echo "$me: di-router answered $code without a key, not 401" >&2; exit 1; }

  cat >"$state/cluster.env" <<EOF
router_http=$http
router_grpc=127.0.0.1:$gport
kvstore=$kv
model=$config
api_key_file=$state/api.key
router_grpc_token_file=$state/router-grpc.token
admin_token_file=$state/kvstore-admin.token
engine_token_file=$state/engine.token
prefill_ranks=$n_prefill
decode_ranks=$n_decode
decode_ep=$decode_ep
backend=$backend
state=$state
EOF
  failed=0
  trap - EXIT INT TERM
  echo "$me: up: di-kvstore, $n_prefill di-prefill, $n_decode di-decode ($backend), di-router; stop with: deploy/local/cluster.sh down $state" >&2
  cat "$state/cluster.env"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  -h|--help) help ;;
  "") usage_fail "say up or down (see --help)" ;;
  *) usage_fail "unknown command $1 (see --help)" ;;
esac
