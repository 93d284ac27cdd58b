#!/usr/bin/env bash
# The local cluster (deploy/local/cluster.sh up --prefill 1 --decode 2) against the router's
# contract:
#   1. seeds: /v1/completions with token ids, a seed, temperature 0.8, top_p and logprobs gives
#      the tokens, logprobs and top logprobs of `di-generate --seed ... --json` on the same
#      checkpoint and flags, compared at full float precision (both print 9 significant
#      digits, which name one float); whole, streamed and through gRPC Generate; also
#      temperature 0. Drafts are on in
#      both (each one's default: the model's draft block size).
#   2. cancels: $DI_CLUSTER_CANCELS (default 200) streamed requests cancelled at random points
#      (client disconnects after k events or d ms, gRPC Abort, gRPC client cancel); afterwards
#      the store holds 0 leases and 0 handoffs, every rank's free blocks and slots (GetLoad) are
#      back at their start, and the router's running and waiting gauges are 0.
#   3. a decode rank killed (SIGKILL) mid-stream while another is up and the prompt's blocks
#      are in the store: the stream says it continued, completes with max_tokens tokens and no
#      error; through HTTP (temperature 0) and gRPC Generate (0.8). Whether the tokens equal
#      an uninterrupted run is printed as a note.
#   4. the killed rank restarted on its port; a prompt shorter than one block (nothing in the
#      store) and its decode rank killed: the stream ends with an error event saying so.
#   5. the last decode rank killed mid-stream: an error event (no other decode rank).
# usage: tests/deploy/test_cluster_pd.sh BUILDDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: test_cluster_pd.sh BUILDDIR}" && pwd)
cluster=$root/deploy/local/cluster.sh
for b in prefill/di-prefill decode/di-decode router/di-router kvstore/di-kvstore \
         kvstore/di-kvctl tools/generate/di-generate tests/deploy/cluster-client; do
  [ -x "$build/$b" ] || { echo "test_cluster_pd: SKIP: $build/$b is not built"; exit 77; }
done
for t in curl jq; do
  command -v "$t" >/dev/null || { echo "test_cluster_pd: SKIP: $t is not installed"; exit 77; }
done
cancels=${DI_CLUSTER_CANCELS:-200}
[[ "$cancels" =~ ^[0-9]+$ ]] && [ "$cancels" -ge 1 ] ||
  { echo "test_cluster_pd: DI_CLUSTER_CANCELS must be a count >= 1, not '$cancels'"; exit 2; }

curl_pid=
restarted=() # decode ranks this test started again (cluster.sh down does not know them)
cleanup_extra() {
  [ -z "$curl_pid" ] || kill "$curl_pid" 2>/dev/null || true
  local p
  for p in ${restarted[@]+"${restarted[@]}"}; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
. "$root/tests/deploy/lib.sh" cluster-pd
note() { echo "note: $*"; }

"$cluster" up --build "$build" --prefill 1 --decode 2 >"$work/env" 2>"$work/up.err" || {
  echo "FAIL: cluster.sh up failed:"; cat "$work/up.err"; exit 1; }
# shellcheck disable=SC1090,SC2154
. "$work/env"
key=$(cat "$api_key_file")
export DI_ENGINE_TOKEN DI_KVSTORE_ADMIN_TOKEN
DI_ENGINE_TOKEN=$(cat "$engine_token_file")
DI_KVSTORE_ADMIN_TOKEN=$(cat "$admin_token_file")
client=$build/tests/deploy/cluster-client
mapfile -t pids <"$state/pids" # kvstore, prefill0, decode0, decode1, router
decode_port=("$(cat "$state/decode0.port")" "$(cat "$state/decode1.port")")
decode_pid=("${pids[2]}" "${pids[3]}")
for r in 0 1; do cp "/proc/${decode_pid[$r]}/cmdline" "$work/decode$r.cmdline"; done
prefill_port=$(cat "$state/prefill0.port")

ids() { # count seed: that many token ids in [1000, 50000), comma-separated, from an LCG
  awk -v n="$1" -v s="$2" 'BEGIN { x = s; for (i = 0; i < n; i++) {
    x = (x * 1103515245 + 12345) % 2147483648; printf "%s%d", (i ? "," : ""), 1000 + x % 49000 } }'
}
# body ids max_tokens temperature seed stream [logprobs]: a /v1/completions request
body() {
  jq -cn --arg m "$model" --argjson p "[$1]" --argjson n "$2" --argjson t "$3" --argjson s "$4" \
    --argjson st "$5" --argjson lp "${6:-2}" \
    '{model:$m, prompt:$p, max_tokens:$n, temperature:$t, top_p:0.9, seed:$s, logprobs:$lp,
      ignore_eos:true, return_tokens_as_token_ids:true, stream:$st}'
}
post() { # body out: the HTTP status
  curl -s -o "$2" -w '%{http_code}' -m 300 -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' -d "$1" "$router_http/v1/completions"
}
# The canonical {ids, lps, tops} of a whole response, of a stream, of di-generate's JSON.
canon_whole() { jq -c '.choices[0].logprobs | {ids: [.tokens[] | sub("token_id:"; "") | tonumber],
  lps: .token_logprobs, tops: [.top_logprobs[] | with_entries(.key |= sub("token_id:"; ""))]}' "$1"; }
canon_stream() { sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]$' | jq -sc '
  [.[] | select(.choices[0].logprobs != null) | .choices[0].logprobs] |
  {ids: [.[].tokens[] | sub("token_id:"; "") | tonumber], lps: [.[].token_logprobs[]],
   tops: [.[].top_logprobs[] | with_entries(.key |= sub("token_id:"; ""))]}'; }
canon_gen() { jq -c '.requests[0] | {ids: .tokens, lps: .logprobs, tops: (.top_logprobs // [])}' "$1"; }
generate() { # ids max_tokens temperature seed out [logprobs]: di-generate on the cluster's checkpoint
  "$build/tools/generate/di-generate" --model "$state/model" --ids "$1" --max-tokens "$2" \
    --temperature "$3" --top-p 0.9 --seed "$4" --logprobs "${6:-2}" --ignore-eos --chunk 512 \
    --threads 1 --json --quiet >"$5" 2>"$5.err"
}
grpc_gen() { # ids max_tokens temperature seed logprobs: one gRPC Generate, JSON lines
  "$client" generate --grpc "$router_grpc" --grpc-token-file "$router_grpc_token_file" --ids "$1" \
    --max-tokens "$2" --temperature "$3" --top-p 0.9 --seed "$4" --logprobs "$5"
}
canon_grpc() { jq -sc '[.[] | select(.token != null)] |
  {ids: [.[].token], lps: [.[].logprob], tops: [.[].top]}' "$1"; }
same_ids() { # a b (canonical JSON): the number of leading ids they share
  jq -n --argjson a "$1" --argjson b "$2" \
    '[range(0; [($a.ids | length), ($b.ids | length)] | min)] | map(select($a.ids[.] != $b.ids[.])) |
     if length == 0 then ([($a.ids | length), ($b.ids | length)] | min) else .[0] end'
}

# ---------------------------------------------------------------- 1. seeds: HTTP vs di-generate
for c in "300 7 0.8" "129 11 0.8" "77 3 0.8" "300 7 0"; do
  read -r len seed temp <<<"$c"
  p=$(ids "$len" "$seed")
  generate "$p" 24 "$temp" "$seed" "$work/gen.json" || { bad "di-generate: $(tail -n 2 "$work/gen.json.err")"; continue; }
  want=$(canon_gen "$work/gen.json")
  code=$(post "$(body "$p" 24 "$temp" "$seed" false)" "$work/whole.json")
  got=$([ "$code" = 200 ] && canon_whole "$work/whole.json" || echo "HTTP $code $(head -c 300 "$work/whole.json")")
  [ "$got" = "$want" ] && ok "whole, $len prompt tokens, temperature $temp, seed $seed: 24 tokens, logprobs and top-2 equal di-generate's" ||
    bad "whole, $len tokens, temperature $temp: router $(printf '%s' "$got" | cut -c1-300) vs di-generate $(printf '%s' "$want" | cut -c1-300)"
  curl -sN -m 300 -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
    -d "$(body "$p" 24 "$temp" "$seed" true)" "$router_http/v1/completions" >"$work/stream.txt" || true
  got=$(canon_stream "$work/stream.txt" 2>/dev/null || echo "unparsable: $(head -c 300 "$work/stream.txt")")
  [ "$got" = "$want" ] && ok "streamed, $len prompt tokens, temperature $temp: equal di-generate's" ||
    bad "streamed, $len tokens, temperature $temp: router $(printf '%s' "$got" | cut -c1-300) vs di-generate $(printf '%s' "$want" | cut -c1-300)"
  grpc_gen "$p" 24 "$temp" "$seed" 2 >"$work/grpc.jsonl" 2>&1 || true
  got=$(canon_grpc "$work/grpc.jsonl" 2>/dev/null || echo "unparsable: $(head -c 300 "$work/grpc.jsonl")")
  [ "$got" = "$want" ] && ok "gRPC Generate, $len prompt tokens, temperature $temp: equal di-generate's" ||
    bad "gRPC, $len tokens, temperature $temp: router $(printf '%s' "$got" | cut -c1-300) vs di-generate $(printf '%s' "$want" | cut -c1-300)"
done

# ---------------------------------------------------------------- 2. cancels free everything
loads() { # every rank's free blocks and slots, one line
  local r out=""
  out+="prefill0 $("$client" load prefill "127.0.0.1:$prefill_port" | jq -c '[.free_blocks, .free_slots]') "
  for r in 0 1; do
    out+="decode$r $("$client" load decode "127.0.0.1:${decode_port[$r]}" | jq -c '[.free_blocks, .free_slots]') "
  done
  echo "$out"
}
gauges() { # the router's running and waiting gauges (the total series)
  curl -s -m 10 -H "Authorization: Bearer $key" "$router_http/metrics" |
    awk '/^vllm:num_requests_(running|waiting)\{model_name="[^"]*"\} / { printf "%s ", $2 }'
}
store() { # leases and handoff objects in the store
  "$build/kvstore/di-kvctl" --target "$kvstore" --json stats 2>/dev/null |
    jq -r '"\(.leases_active) \(.classes.handoff.objects)"'
}
before=$(loads)
t0=$(date +%s.%N)
if "$client" storm --http "${router_http#http://}" --key-file "$api_key_file" --grpc "$router_grpc" \
     --grpc-token-file "$router_grpc_token_file" --requests "$cancels" --concurrency 8 \
     --max-tokens 16 --seed 5 >"$work/storm.json" 2>"$work/storm.err"; then
  ok "$cancels cancelled streams: $(cat "$work/storm.json")"
else
  bad "storm: $(cat "$work/storm.json") $(head -n 5 "$work/storm.err")"
fi
# The services finish their cancels asynchronously: give them some seconds, and say when each
# part was free (seconds after the last request ended).
t1=$(date +%s.%N)
since() { awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
g_at= s_at= l_at=
for _ in $(seq 1 150); do
  [ -n "$g_at" ] || { [ "$(gauges)" = "0 0 " ] && g_at=$(since); }
  [ -n "$s_at" ] || { [ "$(store)" = "0 0" ] && s_at=$(since); }
  [ -n "$l_at" ] || { [ "$(loads)" = "$before" ] && l_at=$(since); }
  [ -n "$g_at" ] && [ -n "$s_at" ] && [ -n "$l_at" ] && break
  sleep 0.2
done
note "cancels: $cancels requests in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s; free after: router gauges ${g_at:-never} s, store ${s_at:-never} s, ranks ${l_at:-never} s"
[ "$(gauges)" = "0 0 " ] && ok "router: running 0, waiting 0" || bad "router gauges running/waiting: $(gauges)"
[ "$(store)" = "0 0" ] && ok "store: 0 leases, 0 handoffs" || bad "store: leases, handoffs = $(store)"
after=$(loads)
[ "$after" = "$before" ] && ok "ranks' free blocks and slots back at the start: $after" ||
  bad "ranks' free blocks and slots: before $before, after $after"

# ---------------------------------------------------------------- 3..5. decode ranks killed
events() { grep -c '^data: {"id"\|^{"token"' "$1" 2>/dev/null || true; }
serving() { # the index of the decode rank running a request, or nothing
  local r
  for r in 0 1; do
    [ "$("$client" load decode "127.0.0.1:${decode_port[$r]}" 2>/dev/null | jq -r .running)" = 1 ] && { echo "$r"; return; }
  done
}
# kill_mid body out [grpc ids max temperature seed]: streams body through HTTP (or the gRPC
# request) into out, SIGKILLs the decode rank serving it after 8 tokens, waits for the
# stream's end; prints the killed rank's index.
kill_mid() {
  if [ $# -gt 2 ]; then
    grpc_gen "$4" "$5" "$6" "$7" 1 >"$2" 2>&1 &
  else
    curl -sN -m 300 -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
      -d "$1" "$router_http/v1/completions" >"$2" &
  fi
  curl_pid=$!
  local _ r=
  for _ in $(seq 1 600); do [ "$(events "$2")" -ge 8 ] && break; sleep 0.05; done
  r=$(serving)
  if [ -n "$r" ]; then kill -KILL "${decode_pid[$r]}"; fi
  wait "$curl_pid" || true
  curl_pid=
  echo "$r"
}
continued_of() { sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]$' | jq -c 'select(.continued) | .continued'; }

restart() { # r: decode rank r again, on its port; waits until the router can use it
  local r=$1 a=() args=() i _
  mapfile -d '' a <"$work/decode$r.cmdline"
  for ((i = 1; i < ${#a[@]}; i++)); do
    case "${a[$i]}" in
      --listen) args+=(--listen "127.0.0.1:${decode_port[$r]}"); i=$((i + 1)) ;;
      --port-file) args+=(--port-file "$work/decode$r.port"); i=$((i + 1)) ;;
      *) args+=("${a[$i]}") ;;
    esac
  done
  rm -f "$work/decode$r.port"
  "${a[0]}" "${args[@]}" </dev/null >>"$state/decode$r.restart.log" 2>&1 &
  decode_pid[$r]=$!
  restarted+=("$!")
  for _ in $(seq 1 600); do [ -s "$work/decode$r.port" ] && break; sleep 0.1; done
  [ -s "$work/decode$r.port" ] || { bad "decode$r did not restart: $(tail -n 3 "$state/decode$r.restart.log")"; return 1; }
  sleep 3 # two good heartbeats (1 s apart) bring it back into rotation
}
fin_of() { sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]$' |
  jq -r 'select(.choices[0].finish_reason != null) | .choices[0].finish_reason' | tail -n 1; }

# ---------------------------------------------------------------- 3. continuation, measured
# temperature 0 through HTTP, 0.8 through gRPC Generate
max=96
for c in "http 0 21" "grpc 0.8 22"; do
  read -r api temp seed <<<"$c"
  p=$(ids 300 "$seed")
  generate "$p" "$max" "$temp" "$seed" "$work/gen.json" 1 || bad "di-generate: $(tail -n 2 "$work/gen.json.err")"
  if [ "$api" = http ]; then
    k=$(kill_mid "$(body "$p" "$max" "$temp" "$seed" true 1)" "$work/cont.txt")
    cont=$(continued_of "$work/cont.txt")
    got=$(canon_stream "$work/cont.txt" 2>/dev/null || echo '{"ids":[]}')
    fin=$(fin_of "$work/cont.txt")
    grep -q '^data: \[DONE\]' "$work/cont.txt" && ended=1 || ended=0
  else
    k=$(kill_mid - "$work/cont.txt" grpc "$p" "$max" "$temp" "$seed")
    cont=$(jq -c 'select(.continued) | .continued' "$work/cont.txt" 2>/dev/null || true)
    got=$(canon_grpc "$work/cont.txt" 2>/dev/null || echo '{"ids":[]}')
    fin=$(jq -r 'select(.finish) | .finish | ascii_downcase' "$work/cont.txt" 2>/dev/null || true)
    ended=1
  fi
  if [ -z "$k" ]; then
    bad "$api, temperature $temp: no decode rank was running the request (events: $(events "$work/cont.txt"))"
    continue
  fi
  n=$(jq -n --argjson g "$got" '$g.ids | length')
  if [ -n "$cont" ] && [ "$n" = "$max" ] && [ "$fin" = length ] && ! grep -q '"error"' "$work/cont.txt" &&
     [ "$ended" = 1 ]; then
    ok "$api, temperature $temp: decode$k killed mid-stream; the stream continued ($cont), $n tokens, finish $fin"
  else
    bad "$api, temperature $temp: decode$k killed mid-stream: continued '$cont', $n tokens, finish '$fin': $(grep -E 'error|continued' "$work/cont.txt" | head -c 400)"
  fi
  want=$(canon_gen "$work/gen.json")
  after_n=$(jq -n --argjson c "${cont:-null}" '$c.after_tokens // 0')
  if [ "$got" = "$want" ]; then
    note "temperature $temp: continued after $after_n tokens; all $max ids and logprobs equal an uninterrupted di-generate run"
  else
    note "temperature $temp: continued after $after_n tokens; the first $(same_ids "$got" "$want") of $max ids equal an uninterrupted di-generate run"
  fi
  restart "$k" || true
done

# ---------------------------------------------------------------- 4. nothing in the store: an error
k=$(kill_mid "$(body "$(ids 100 31)" "$max" 0.8 31 true 0)" "$work/short.txt")
if [ -z "$k" ]; then
  bad "short prompt: no decode rank was running the request"
elif grep -q '"error".*store holds none' "$work/short.txt" && [ -z "$(continued_of "$work/short.txt")" ] &&
     grep -q '^data: \[DONE\]' "$work/short.txt"; then
  ok "100-token prompt (no full block in the store), decode$k killed: $(grep -o '"message":"[^"]*"' "$work/short.txt" | cut -c1-200)"
else
  bad "short prompt, decode$k killed: $(grep -E 'error|continued' "$work/short.txt" | head -c 400)"
fi

# ---------------------------------------------------------------- 5. no other decode rank: an error
sleep 6 # the rank killed above misses 5 heartbeats and is out of rotation
k5=$(kill_mid "$(body "$(ids 300 41)" "$max" 0.8 41 true 0)" "$work/last.txt")
if [ -z "$k5" ]; then
  bad "last rank: no decode rank was running the request"
elif [ "$k5" != "$k" ] && grep -q '"error".*no other decode rank' "$work/last.txt" &&
     [ -z "$(continued_of "$work/last.txt")" ] && grep -q '^data: \[DONE\]' "$work/last.txt"; then
  ok "the last decode rank (decode$k5) killed: $(grep -o '"message":"[^"]*"' "$work/last.txt" | cut -c1-200)"
else
  bad "last rank decode$k5 killed: $(grep -E 'error|continued' "$work/last.txt" | head -c 400)"
fi

"$cluster" down "$state" >"$work/down.out" 2>&1 || bad "down: $(cat "$work/down.out")"
state=
if [ "$fails" = 0 ]; then echo "test_cluster_pd: all checks passed"; else echo "test_cluster_pd: $fails check(s) failed"; exit 1; fi
