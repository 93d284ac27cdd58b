#!/usr/bin/env bash
# The cluster on one machine as separate hosts: network namespaces joined by veth links to a
# bridge (itself in a namespace of its own, so nothing is added to this machine's network):
#
#   router 198.18.0.1   prefill0 198.18.0.2   prefill1 198.18.0.3   decode 198.18.0.4
#   kvstore 198.18.0.5  client 198.18.0.9        (198.18.0.0/15: the benchmarking test range)
#
# It starts the services in their namespaces with the flags of deploy/k8s (the pod IP is the
# namespace's address), then checks:
#   1. every host reaches the store and the router over the links, and nothing else;
#   2. each service listens only on its namespace's address (not 0.0.0.0, not loopback);
#   3. the router answers the OpenAI API across the links, refuses a missing or wrong key;
#      the store refuses a wrong token;
#   4. KV moves between namespaces over the store's gRPC data path (the UCX data path serves one
#      host or RDMA only, never TCP: docs/kvstore.md): kvdemo on the prefill0 host writes and reads prompts' KV in the store, which holds them, and the bytes
#      crossed prefill0's link;
#   5. with di-prefill and di-decode built: requests end to end through prefill and decode; then
#      prefill1's link is cut: the router routes around it and every request that had not
#      reached prefill1 succeeds. Without them the router serves its test backend and this step
#      reports "not built".
# Needs root (ip netns), ip, ss, curl. Exit 0 when every check passes, 1 on a failure, 77 when
# namespaces cannot be made here (not root, or a sandbox without them).
# usage: deploy/local/netns-test.sh [--build DIR] [--keep]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$(cd "${2:?--build needs a directory}" && pwd); shift ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "netns-test: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

skip() { echo "netns-test: SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
for t in ip ss curl; do command -v "$t" >/dev/null || skip "$t is not installed"; done
for b in kvstore/di-kvstore kvstore/di-kvctl kvstore/kvdemo router/di-router tools/mkmodel/di-mkmodel; do
  [ -x "$build/$b" ] || { echo "netns-test: $build/$b is not built" >&2; exit 1; }
done
tok=$root/data/tokenizer/deepseek-v3/tokenizer.json
[ -f "$tok" ] || { echo "netns-test: $tok is missing: run deploy/local/install-deps.sh" >&2; exit 1; }

tag=di$$
sw=$tag-sw
declare -A addr=([router]=1 [prefill0]=2 [prefill1]=3 [decode]=4 [kvstore]=5 [client]=9)
hosts=(router prefill0 prefill1 decode kvstore client)
net=198.18.0
work=$(mktemp -d /tmp/netns-test.XXXXXX)
pids=()
made=()

cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  for p in "${made[@]}"; do ip netns del "$p" 2>/dev/null || true; done
  if [ "$keep" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }
ns() { echo "$tag-$1"; }
on() { local h=$1; shift; ip netns exec "$(ns "$h")" "$@"; }
# (services start with `ip netns exec ... &` itself, so that $! is the service and cleanup stops it)

# the namespaces, the bridge and the links; a sandbox that cannot make them is a skip
net() { ip "$@" 2>>"$work/netns.err" || skip "cannot build the test network: ip $*: $(tail -n 1 "$work/netns.err")"; }
net netns add "$sw"
made+=("$sw")
net -n "$sw" link add br0 type bridge
net -n "$sw" link set br0 up
for h in "${hosts[@]}"; do
  net netns add "$(ns "$h")"
  made+=("$(ns "$h")")
  net -n "$sw" link add "to-$h" type veth peer name eth0 netns "$(ns "$h")"
  net -n "$sw" link set "to-$h" master br0 up
  net -n "$(ns "$h")" addr add "$net.${addr[$h]}/24" dev eth0
  net -n "$(ns "$h")" link set eth0 up
  net -n "$(ns "$h")" link set lo up
done
echo "netns-test: ${#hosts[@]} hosts on bridge br0 in $sw: $(for h in "${hosts[@]}"; do printf '%s=%s.%s ' "$h" "$net" "${addr[$h]}"; done)"

# secrets, as the deepinfer-tokens Secret holds them
rand() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
mkdir -p "$work/secrets" && chmod 700 "$work/secrets"
rand >"$work/secrets/engine.token"
rand >"$work/secrets/kvstore-admin.token"
rand >"$work/secrets/router-client.token"
key=$(rand)
printf 'client %s generate\n' "$key" >"$work/secrets/api-keys"

# the model every host loads (as the cpu-small overlay: di-mkmodel demo in each pod)
"$build/tools/mkmodel/di-mkmodel" --quiet demo "$work/model"

# No shared memory between namespaces: a client that tried UCX here finds only TCP, which the
# data path never uses, so the KV bytes cross the links inside gRPC.
export UCX_TLS=tcp UCX_NET_DEVICES=eth0

wait_port() { # host, port file, pid
  local _
  for _ in $(seq 1 600); do
    [ -s "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || { echo "netns-test: $1 exited:" >&2; cat "$work/$1.log" >&2; return 1; }
    sleep 0.1
  done
  echo "netns-test: $1 did not announce its port in 60 s" >&2
  cat "$work/$1.log" >&2
  return 1
}

# the store: the flags of deploy/k8s/base/kvstore.yaml
ip netns exec "$(ns kvstore)" "$build/kvstore/di-kvstore" --listen "$net.5:9470" --port-file "$work/kvstore.port" \
  --dir "$work/kv" --model "$work/model" --durability wal --dram-bytes 256MiB --dram-handoff-share 0.25 --disk-bytes 8GiB \
  --ttl-block 3d --ttl-window 3d --ttl-handoff 60s \
  --token-file "$work/secrets/engine.token" \
  --admin-token-file "$work/secrets/kvstore-admin.token" --log-level info >"$work/kvstore.log" 2>&1 &
pids+=($!)
wait_port kvstore "$work/kvstore.port" $!
echo "netns-test: di-kvstore serving on $net.5:9470 in $(ns kvstore)"

# prefill and decode ranks: the flags of deploy/k8s/base/{prefill,decode}.yaml
services=1
for s in prefill decode; do [ -x "$build/$s/di-$s" ] || services=0; done
# until the router's prefill/decode client lands it serves only its test backend
router_ranks=1
# read whole (grep -q on the pipe would end di-router with SIGPIPE, a failure under pipefail)
router_help=$("$build/router/di-router" --help 2>&1 || true)
grep -q 'client is not built yet' <<<"$router_help" && router_ranks=0
rank_flags=()
if [ "$services" = 1 ]; then
  start_engine() { # host, role, port, rank, world
    ip netns exec "$(ns "$1")" "$build/$2/di-$2" --listen "$net.${addr[$1]}:$3" --port-file "$work/$1.port" \
      --drain 60s --rank "$4" --world "$5" --model "$work/model" --backend cpu --threads 1 \
      --kvstore "$net.5:9470" --kvstore-token-file "$work/secrets/engine.token" \
      --token-file "$work/secrets/engine.token" >"$work/$1.log" 2>&1 &
    pids+=($!)
    eval "pid_$1=$!"
  }
  start_engine prefill0 prefill 9480 0 2
  start_engine prefill1 prefill 9480 1 2
  start_engine decode decode 9490 0 1
  for h in prefill0 prefill1 decode; do wait_port "$h" "$work/$h.port" "$(eval echo "\$pid_$h")"; done
  echo "netns-test: di-prefill on $net.2 and $net.3, di-decode on $net.4"
fi
if [ "$services" = 1 ] && [ "$router_ranks" = 1 ]; then
  rank_flags=(--prefill "$net.2:9480" --prefill "$net.3:9480" --decode "$net.4:9490")
  # the token the ranks (and the store) want from the router
  if grep -q -- '--engine-token-file' <<<"$router_help"; then
    rank_flags+=(--engine-token-file "$work/secrets/engine.token")
  fi
  backend=()
elif [ "$services" = 1 ]; then
  backend=(--test-backend --test-delay 2ms)
  echo "netns-test: the router cannot use prefill and decode yet (its --help: the client is not built); it serves its test backend"
else
  backend=(--test-backend --test-delay 2ms)
  echo "netns-test: not built: di-prefill/di-decode; the router serves its test backend"
fi

# the router: the flags of deploy/k8s/base/router.yaml
ip netns exec "$(ns router)" "$build/router/di-router" --listen-http "$net.1:8000" \
  --listen "$net.1:9400" --token-file "$work/secrets/router-client.token" --prefill-timeout 30s \
  --port-file "$work/router.port" --drain 60s --api-key-file "$work/secrets/api-keys" \
  --tokenizer "$tok" --model deepseek-v4.1 --kvstore "$net.5:9470" "${rank_flags[@]}" "${backend[@]}" \
  >"$work/router.log" 2>&1 &
pids+=($!)
wait_port router "$work/router.port" $!
echo "netns-test: di-router serving HTTP on $net.1:8000 in $(ns router)"

# 1. reachability over the links
connect() { # from-host, ip, port
  on "$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null
}
for h in router prefill0 prefill1 decode client; do
  if connect "$h" "$net.5" 9470; then ok "$h reaches the store at $net.5:9470"; else bad "$h cannot reach the store"; fi
done
for h in client prefill0; do
  if connect "$h" "$net.1" 8000; then ok "$h reaches the router at $net.1:8000"; else bad "$h cannot reach the router"; fi
done
if connect client 127.0.0.1 9470; then bad "the client reaches a store on its own loopback"; else ok "nothing answers on the client's loopback"; fi

# 2. each service listens only on its namespace's address
for h in kvstore router prefill0 prefill1 decode; do
  on "$h" ss -Htln >"$work/$h.listen" 2>/dev/null || true
  [ -s "$work/$h.listen" ] || continue
  n=$(wc -l <"$work/$h.listen")
  # an IPv4 address in an IPv6 socket ([::ffff:A]:P) is still that address only
  others=$(awk -v a="$net.${addr[$h]}:" -v m="[::ffff:$net.${addr[$h]}]:" \
    'index($4, a) != 1 && index($4, m) != 1 {print $4}' "$work/$h.listen" | tr '\n' ' ')
  if [ -z "$others" ]; then
    ok "$h: its $n listening socket(s) are all on $net.${addr[$h]}: $(awk '{print $4}' "$work/$h.listen" | tr '\n' ' ')"
  else
    bad "$h listens beyond $net.${addr[$h]}: $others"
  fi
done
if connect kvstore 127.0.0.1 9470; then bad "the store answers on loopback"; else ok "the store does not answer on its host's loopback"; fi
if connect router 127.0.0.1 8000; then bad "the router answers on loopback"; else ok "the router does not answer on its host's loopback"; fi

# 3. the OpenAI API across the links, and the keys
http() { # expected status, then curl arguments; prints the body
  local want=$1; shift
  local code
  code=$(on client curl -sS -m 60 -o "$work/body" -w '%{http_code}' "$@" 2>"$work/curl.err" || true)
  if [ "$code" = "$want" ]; then return 0; fi
  echo "netns-test: HTTP $code (want $want) for $*: $(head -c 300 "$work/body" 2>/dev/null) $(cat "$work/curl.err")" >&2
  return 1
}
url=http://$net.1:8000
body='{"model":"deepseek-v4.1","prompt":"The capital of France is","max_tokens":8,"temperature":0}'
if http 200 "$url/health"; then ok "GET /health from the client: 200"; else bad "GET /health"; fi
if http 200 -H "Authorization: Bearer $key" -H 'Content-Type: application/json' -d "$body" "$url/v1/completions" &&
   grep -q '"completion_tokens":8' "$work/body"; then
  ok "POST /v1/completions from the client: 200, 8 tokens: $(grep -o '"text":"[^"]*"' "$work/body" | head -c 80)"
else
  bad "POST /v1/completions across the links"
fi
if http 401 -H 'Content-Type: application/json' -d "$body" "$url/v1/completions"; then ok "no key: 401"; else bad "no key was not refused"; fi
if http 401 -H "Authorization: Bearer x$key" -H 'Content-Type: application/json' -d "$body" "$url/v1/completions"; then
  ok "a wrong key: 401"
else
  bad "a wrong key was not refused"
fi
kvctl() { # host, token file, args
  local h=$1 t=$2; shift 2
  on "$h" "$build/kvstore/di-kvctl" --target "$net.5:9470" --admin-token-file "$t" "$@"
}
rand >"$work/wrong.token"
if kvctl client "$work/wrong.token" stats >"$work/kvctl.out" 2>&1; then
  bad "the store served stats to a wrong admin token"
else
  ok "the store refuses a wrong admin token: $(head -n 1 "$work/kvctl.out")"
fi
if kvctl client "$work/secrets/engine.token" stats >"$work/kvctl.out" 2>&1; then
  bad "the store served stats (an admin call) to the engine token"
else
  ok "the store refuses the engine token on an admin call: $(head -n 1 "$work/kvctl.out")"
fi

# 4. KV between namespaces, across the links
bytes() { on "$1" cat "/sys/class/net/eth0/statistics/$2_bytes"; }
store_bytes() { # put or get bytes the store has counted so far
  kvctl client "$work/secrets/kvstore-admin.token" --json stats 2>/dev/null |
    python3 -c 'import json, sys; print(int(json.load(sys.stdin)[sys.argv[1] + "_bytes"]))' "$1" ||
    echo 0
}
put0=$(store_bytes put)
tx0=$(bytes prefill0 tx)
rx0=$(bytes prefill0 rx)
if on prefill0 "$build/kvstore/kvdemo" --store "$net.5:9470" --token "$(cat "$work/secrets/engine.token")" \
     --tokens 1000 --prompts 3 --shared 512 --ids-dir "$work" >"$work/kvdemo.log" 2>&1; then
  ok "kvdemo on prefill0 wrote and read 3 prompts' KV in the store across the link"
else
  bad "kvdemo on prefill0 failed: $(tail -n 3 "$work/kvdemo.log")"
fi
tx=$(( $(bytes prefill0 tx) - tx0 ))
rx=$(( $(bytes prefill0 rx) - rx0 ))
kvctl client "$work/secrets/kvstore-admin.token" --json stats >"$work/stats.json" 2>"$work/kvctl.err" || true
read -r blocks put got < <(python3 -c '
import json, sys
s = json.load(open(sys.argv[1]))
b = s["classes"]["block"]["objects"]
print(b, int(s["put_bytes"]), int(s["get_bytes"]))
' "$work/stats.json" 2>/dev/null || echo "? 0 0")
if [ "$blocks" = 13 ]; then ok "the store holds 13 blocks (3 prompts of 1,000 tokens sharing 512)"; else bad "the store holds $blocks blocks, want 13 ($(head -c 300 "$work/kvctl.err"))"; fi
put=$((put - put0))
if [ "$put" -gt 0 ] && [ "$tx" -ge "$put" ]; then
  ok "prefill0 sent $tx bytes over its link, the store took $put bytes of KV (inside gRPC across the link, no shared memory); received $rx (KV read back $got)"
else
  bad "prefill0 sent $tx bytes over its link, the store reports $put bytes of KV put"
fi
if kvctl decode "$work/secrets/kvstore-admin.token" inspect "$work/prompt0.ids" >"$work/inspect.out" 2>&1 &&
   grep -q 'cached prefix: 7 blocks' "$work/inspect.out"; then
  ok "from the decode host, prompt 0 is cached: $(grep 'cached prefix' "$work/inspect.out")"
else
  bad "inspect of prompt 0 from the decode host: $(tail -n 2 "$work/inspect.out")"
fi

# 5. end to end through prefill and decode, then prefill1's link cut
if [ "$services" = 1 ] && [ "$router_ranks" = 1 ]; then
  send() { # n, out prefix: n requests one after another; one status a line
    for _ in $(seq 1 "$1"); do
      on client curl -s -m 120 -o /dev/null -w '%{http_code}\n' -H "Authorization: Bearer $key" \
        -H 'Content-Type: application/json' -d "$body" "$url/v1/completions" || echo 000
    done >"$work/$2.codes"
  }
  send 8 before
  if [ "$(grep -c '^200$' "$work/before.codes")" = 8 ]; then ok "8 requests end to end through prefill and decode"; else bad "before the cut: $(sort "$work/before.codes" | uniq -c | tr '\n' ' ')"; fi
  send 40 during &
  sender=$!
  sleep 1
  ip -n "$sw" link set to-prefill1 down
  echo "netns-test: cut prefill1's link"
  wait "$sender" || true
  send 16 after
  lost=$(grep -vc '^200$' "$work/during.codes" || true)
  # a request that reached prefill1 before the cut may fail (at most the one in flight there);
  # every other one must succeed
  if [ "$lost" -le 1 ]; then ok "during the cut: $(grep -c '^200$' "$work/during.codes") of 40 succeeded ($lost failed, in flight on prefill1)"; else bad "during the cut $lost of 40 failed"; fi
  if [ "$(grep -c '^200$' "$work/after.codes")" = 16 ]; then ok "after the cut every request succeeds (routed around prefill1)"; else bad "after the cut: $(sort "$work/after.codes" | uniq -c | tr '\n' ' ')"; fi
elif [ "$services" = 1 ]; then
  echo "not built: the router's prefill/decode client: the end-to-end and link-cut steps did not run"
else
  echo "not built: di-prefill, di-decode: the end-to-end and link-cut steps did not run"
fi

if [ "$fails" != 0 ]; then
  echo "netns-test: $fails check(s) failed; logs:"
  for f in "$work"/*.log; do echo "== $f"; tail -n 20 "$f"; done
  exit 1
fi
echo "netns-test: every check passed"
[ "$services" = 1 ] && [ "$router_ranks" = 1 ] || exit 77
