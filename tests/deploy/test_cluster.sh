#!/usr/bin/env bash
# deploy/local/cluster.sh end to end: up (store, one prefill and one decode rank, router), the
# printed lines are sourceable and name live ports; the router refuses a missing and a wrong
# key; one whole and one streamed chat completion through the router with curl, each with
# tokens; di-kvctl stats shows no lease and no handoff object left; down stops every process
# and frees every port, and removes the state dir. Then a router that cannot start (a bad flag
# through --router-arg): up exits 1 naming di-router, and leaves no process, no port and no
# state dir behind. Usage errors exit 2. Then the decode ranks as one expert-parallel group
# (--decode 2 --decode-ep): completions through the router, the same text at temperature 0;
# decode rank 1 killed: rank 0 names it, and the next completion fails at once (503).
# usage: tests/deploy/test_cluster.sh BUILDDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: test_cluster.sh BUILDDIR}" && pwd)
cluster=$root/deploy/local/cluster.sh
for b in prefill/di-prefill decode/di-decode router/di-router kvstore/di-kvstore; do
  [ -x "$build/$b" ] || { echo "test_cluster: SKIP: $build/$b is not built"; exit 77; }
done
for t in curl jq ss; do
  command -v "$t" >/dev/null || { echo "test_cluster: SKIP: $t is not installed"; exit 77; }
done

. "$root/tests/deploy/lib.sh" cluster
alive() { # pids...: those that still run (a zombie does not count)
  local p
  for p in "$@"; do
    [ -n "$(tr -d '\0' 2>/dev/null <"/proc/$p/cmdline")" ] && echo "$p"
  done
  return 0
}
listening() { # ports...: those some socket still listens on
  local p
  for p in "$@"; do ss -Hltn "sport = :$p" | grep -q . && echo "$p"; done
  return 0
}

# --- usage errors
set +e
"$cluster" up --prefill 0 >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" = 2 ] && grep -q 'number of ranks' "$work/err" && ok "--prefill 0 is a usage error" ||
  bad "--prefill 0: exit $rc: $(cat "$work/err")"
set +e
"$cluster" down >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" = 2 ] && ok "down without a state dir is a usage error" || bad "down without STATE: exit $rc"
set +e
"$cluster" down "$work" >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" = 1 ] && grep -q 'not a cluster state dir' "$work/err" && ok "down refuses a dir that is not a state dir" ||
  bad "down on a plain dir: exit $rc: $(cat "$work/err")"

# --- up
t0=$(date +%s.%N)
"$cluster" up --build "$build" >"$work/env" 2>"$work/up.err" || {
  echo "FAIL: cluster.sh up failed:"; cat "$work/up.err"; exit 1; }
t1=$(date +%s.%N)
# shellcheck disable=SC1090,SC2154
. "$work/env"
ok "up in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s: $(tr '\n' ' ' <"$work/env" | cut -c1-200)"
for v in router_http router_grpc kvstore model api_key_file state; do
  [ -n "${!v:-}" ] || bad "up printed no $v="
done
[ -d "$state" ] || { echo "FAIL: state dir $state is missing"; exit 1; }
mapfile -t pids <"$state/pids"
[ "${#pids[@]}" = 4 ] && ok "4 processes: ${pids[*]}" || bad "${#pids[@]} pids, not 4: ${pids[*]}"
ports=("${router_http##*:}" "${router_grpc##*:}" "${kvstore##*:}")
for f in "$state"/prefill0.port "$state"/decode0.port; do ports+=("$(cat "$f")"); done
[ "$(listening "${ports[@]}" | wc -l)" = 5 ] && ok "5 ports listening: ${ports[*]}" ||
  bad "listening among ${ports[*]}: $(listening "${ports[@]}" | tr '\n' ' ')"
for p in "${ports[@]}"; do
  ss -Hltn "sport = :$p" | awk '{print $4}' | grep -Eqv '^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]):' && bad "port $p listens off loopback"
done

key=$(cat "$api_key_file")
url=$router_http/v1/chat/completions
body() { jq -cn --arg m "$model" --argjson s "$1" \
  '{model:$m, messages:[{role:"user",content:"Name three colours."}], max_tokens:12,
    temperature:0, stream:$s} + (if $s then {stream_options:{include_usage:true}} else {} end)'; }

# --- auth is on
code=$(curl -s -o /dev/null -w '%{http_code}' -m 30 -H 'Content-Type: application/json' -d "$(body false)" "$url")
[ "$code" = 401 ] && ok "no key: 401" || bad "no key: $code"
code=$(curl -s -o /dev/null -w '%{http_code}' -m 30 -H 'Authorization: Bearer wrong-key-0123456789abcdef' \
  -H 'Content-Type: application/json' -d "$(body false)" "$url")
[ "$code" = 401 ] && ok "wrong key: 401" || bad "wrong key: $code"

# --- a whole completion
code=$(curl -s -o "$work/whole.json" -w '%{http_code}' -m 300 -H "Authorization: Bearer $key" \
  -H 'Content-Type: application/json' -d "$(body false)" "$url")
n=$(jq -r '.usage.completion_tokens // 0' "$work/whole.json" 2>/dev/null || echo 0)
fin=$(jq -r '.choices[0].finish_reason // ""' "$work/whole.json" 2>/dev/null || true)
if [ "$code" = 200 ] && [ "$n" -ge 1 ] && { [ "$fin" = length ] || [ "$fin" = stop ]; }; then
  ok "whole completion: $n tokens, finish $fin, text $(jq -c '.choices[0].message.content' "$work/whole.json" | cut -c1-60)"
else bad "whole completion: HTTP $code: $(head -c 400 "$work/whole.json")"; fi

# --- a streamed completion
curl -sN -m 300 -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d "$(body true)" "$url" >"$work/stream.txt" || bad "streamed completion: curl failed"
sed -n 's/^data: //p' "$work/stream.txt" | grep -v '^\[DONE\]$' >"$work/chunks.jsonl" || true
content=$(jq -j '.choices[0].delta.content // empty' "$work/chunks.jsonl" 2>/dev/null || true)
sn=$(jq -r 'select(.usage != null) | .usage.completion_tokens' "$work/chunks.jsonl" 2>/dev/null | tail -n 1)
if grep -q '^data: \[DONE\]' "$work/stream.txt" && [ "${sn:-0}" -ge 1 ] && [ -n "$content" ] &&
   ! grep -q '"error"' "$work/chunks.jsonl"; then
  ok "streamed completion: ${sn} tokens in $(wc -l <"$work/chunks.jsonl") events, text $(printf '%s' "$content" | jq -Rsc . | cut -c1-60)"
else bad "streamed completion: $(head -c 600 "$work/stream.txt")"; fi
# temperature 0 and the same prompt: the streamed text is the whole one
whole_text=$(jq -j '.choices[0].message.content' "$work/whole.json" 2>/dev/null || true)
[ "$content" = "$whole_text" ] && ok "streamed text equals the whole one (temperature 0)" ||
  bad "streamed text differs: $(printf '%s' "$content" | jq -Rsc .) vs $(printf '%s' "$whole_text" | jq -Rsc .)"

# --- nothing left in flight in the store
DI_KVSTORE_ADMIN_TOKEN=$(cat "$admin_token_file") \
  "$build/kvstore/di-kvctl" --target "$kvstore" --json stats >"$work/stats.json" 2>"$work/stats.err" || bad "di-kvctl stats: $(cat "$work/stats.err")"
leases=$(jq -r '.leases_active' "$work/stats.json" 2>/dev/null || echo "?")
handoffs=$(jq -r '.classes.handoff.objects' "$work/stats.json" 2>/dev/null || echo "?")
blocks=$(jq -r '.classes.block.objects' "$work/stats.json" 2>/dev/null || echo "?")
[ "$leases" = 0 ] && [ "$handoffs" = 0 ] && ok "store: no lease, no handoff left ($blocks blocks held)" ||
  bad "store: leases_active $leases, handoff objects $handoffs"

# --- down
"$cluster" down "$state" >"$work/down.out" 2>&1 || bad "down: $(cat "$work/down.out")"
left=$(alive "${pids[@]}")
[ -z "$left" ] && ok "down: no process left" || bad "down: still running: $left"
lp=$(listening "${ports[@]}")
[ -z "$lp" ] && ok "down: no port left" || bad "down: still listening: $lp"
[ ! -e "$state" ] && ok "down: state dir removed" || bad "down: $state is still there"
state=

# --- a service that fails to start: a clear error and everything undone
set +e
"$cluster" up --build "$build" --state "$work/bad" --router-arg --no-such-flag >"$work/bad.out" 2>"$work/bad.err"
rc=$?
set -e
if [ "$rc" = 1 ] && grep -q 'router failed to start' "$work/bad.err" && grep -q 'no-such-flag' "$work/bad.err"; then
  ok "a router that cannot start: exit 1, $(grep -m1 'failed to start' "$work/bad.err")"
else bad "failed start: exit $rc: $(cat "$work/bad.err")"; fi
[ ! -s "$work/bad.out" ] || bad "failed start printed lines to source: $(cat "$work/bad.out")"
[ ! -e "$work/bad" ] && ok "failed start: state dir removed" || bad "failed start: $work/bad is still there"
stray=$(pgrep -f -- "$work/bad" || true)
[ -z "$stray" ] && ok "failed start: no process left" || bad "failed start: processes left: $stray"

# --- the decode ranks as one expert-parallel group (--decode-ep)
set +e
"$cluster" up --decode 1 --decode-ep >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" = 2 ] && grep -q 'needs --decode 2' "$work/err" && ok "--decode-ep with one decode rank is a usage error" ||
  bad "--decode-ep --decode 1: exit $rc: $(cat "$work/err")"
"$cluster" up --build "$build" --decode 2 --decode-ep >"$work/env" 2>"$work/up.err" || {
  echo "FAIL: cluster.sh up --decode 2 --decode-ep failed:"; cat "$work/up.err"; exit 1; }
# shellcheck disable=SC1090
. "$work/env"
url=$router_http/v1/chat/completions
key=$(cat "$api_key_file")
pid1=
while read -r p; do
  cmd=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null || true)
  case "$cmd" in *"$state/decode"[01].port*) [[ "$cmd" == *--ep-addr* ]] || bad "a decode rank without --ep-addr" ;; esac
  case "$cmd" in *"$state/decode1.port"*) pid1=$p ;; esac
done <"$state/pids"
first=
for i in 1 2 3 4; do
  code=$(curl -s -o "$work/c$i.json" -w '%{http_code}' -m 300 -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' -d "$(body false)" "$url")
  n=$(jq -r '.usage.completion_tokens // 0' "$work/c$i.json" 2>/dev/null || echo 0)
  text=$(jq -j '.choices[0].message.content // ""' "$work/c$i.json" 2>/dev/null || true)
  [ "$code" = 200 ] && [ "$n" -ge 1 ] || bad "group: completion $i: HTTP $code: $(head -c 300 "$work/c$i.json")"
  if [ -z "$first" ]; then first=$text
  elif [ "$text" != "$first" ]; then bad "group: completion $i differs at temperature 0"; fi
done
ok "group: 4 completions, each $(printf '%s' "$first" | jq -Rsc . | cut -c1-60)"
[ -n "$pid1" ] && kill -KILL "$pid1" || bad "group: no pid of decode rank 1"
for _ in $(seq 1 100); do
  grep -q "rank 1 closed the connection" "$state/decode0.log" && break
  sleep 0.1
done
grep -q "rank group (rank 0 of 2): rank 1 closed the connection" "$state/decode0.log" &&
  ok "group: decode rank 1 killed, rank 0 names it" || bad "group: decode0.log: $(tail -n 3 "$state/decode0.log")"
t0=$(date +%s.%N)
code=$(curl -s -o "$work/after.json" -w '%{http_code}' -m 60 -H "Authorization: Bearer $key" \
  -H 'Content-Type: application/json' -d "$(body false)" "$url")
secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
if [ "$code" != 200 ] && awk -v s="$secs" 'BEGIN{exit !(s < 30)}'; then
  ok "group: the next completion fails at once: HTTP $code in $secs s: $(head -c 200 "$work/after.json")"
else bad "group: the next completion: HTTP $code in $secs s"; fi
"$cluster" down "$state" >"$work/down.out" 2>&1 || bad "group: down: $(cat "$work/down.out")"
state=

if [ "$fails" = 0 ]; then echo "test_cluster: all checks passed"; else echo "test_cluster: $fails check(s) failed"; exit 1; fi
