#!/usr/bin/env bash
# Placement under a skewed load, on the real local cluster (deploy/local/cluster.sh, demo model,
# CPU): two prefill ranks, rank 0 slowed on purpose (--prefill-delay-ms D,0: a D ms sleep in
# every engine step of rank 0). The same di-bench load (same seed, rate, concurrency and
# prompts) runs under the default policy (estimated time to start) and, on a fresh cluster,
# under --policy round-robin, with no warm-up: the load starts on ranks the router has not
# measured yet, and the slow rank, first in the router's list, takes the first request (a tie),
# so its first prefill is out while requests keep arriving (placement
# bounds an unmeasured rank's rate by the time its first prefill has taken; it used to assume
# 10,000 tokens/s until that prefill ended, and the slow rank drew every request placed
# meanwhile). Requests ask for one token (prefill only), so
# the router's per-rank series (vllm:request_success_total{rank=...}) count the prefills each
# rank took. Asserted: with the estimate at most a fifth of the measured prefills go to the
# slow rank and its p99 TTFT is below round-robin's; round-robin gives the slow rank about half
# (a check that the slow rank was slow to avoid). D is DI_SKEW_DELAY_MS (default 1500 ms), far
# above a prefill of 24 tokens on a busy machine.
# usage: tests/deploy/test_skew.sh BUILDDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: test_skew.sh BUILDDIR}" && pwd)
cluster=$root/deploy/local/cluster.sh
for b in prefill/di-prefill decode/di-decode router/di-router kvstore/di-kvstore tools/bench/di-bench; do
  [ -x "$build/$b" ] || { echo "test_skew: SKIP: $build/$b is not built"; exit 77; }
done
for t in curl jq; do
  command -v "$t" >/dev/null || { echo "test_skew: SKIP: $t is not installed"; exit 77; }
done
delay=${DI_SKEW_DELAY_MS:-1500}
[[ "$delay" =~ ^[0-9]+$ ]] && [ "$delay" -ge 100 ] && [ "$delay" -le 10000 ] ||
  { echo "test_skew: DI_SKEW_DELAY_MS wants 100..10000, not '$delay'"; exit 1; }
n=24

. "$root/tests/deploy/lib.sh" skew

secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

successes() { # rank address: its vllm:request_success_total (0 when it has none yet)
  curl -sf -m 10 -H "Authorization: Bearer $(cat "$api_key_file")" "$router_http/metrics" |
    awk -v r="rank=\"$1\"" '/^vllm:request_success_total\{/ && index($0, r) { v = $NF } END { print v + 0 }'
}

# run POLICY: cluster up (rank 0 slowed), the measured load, per-rank prefills; down.
# Leaves $work/POLICY.json (di-bench's JSON) and $work/POLICY.slow (prefills on the slow rank).
run() {
  local policy=$1 args=()
  [ "$policy" = round-robin ] && args=(--router-arg --policy --router-arg round-robin)
  local t_up t_warm t_run t_down
  t_up=$(date +%s.%N)
  "$cluster" up --build "$build" --prefill 2 --decode 1 --prefill-delay-ms "$delay,0" \
    ${args[@]+"${args[@]}"} >"$work/env" 2>"$work/up.err" || {
    echo "FAIL: cluster.sh up ($policy) failed:"; cat "$work/up.err"; exit 1; }
  # shellcheck disable=SC1090,SC2154
  . "$work/env"
  local fast slow host=${router_http#http://}
  slow=127.0.0.1:$(cat "$state/prefill0.port")
  fast=127.0.0.1:$(cat "$state/prefill1.port")
  local load=(--host "$host" --api-key-file "$api_key_file" --input-len 24 --output-len 1
              --timeout 120s)
  local f0 s0 f1 s1
  t_warm=$(date +%s.%N)
  f0=$(successes "$fast"); s0=$(successes "$slow")
  "$build/tools/bench/di-bench" "${load[@]}" --num-prompts "$n" --request-rate 4 \
    --arrival fixed --max-concurrency 8 --seed 1 --json "$work/$policy.json" \
    >"$work/$policy.out" 2>&1 || bad "$policy: di-bench failed: $(tail -n 3 "$work/$policy.out")"
  t_run=$(date +%s.%N)
  f1=$(successes "$fast"); s1=$(successes "$slow")
  echo $((s1 - s0)) >"$work/$policy.slow"
  echo "$policy: prefills fast rank $((f1 - f0)), slow rank $((s1 - s0)); TTFT median" \
    "$(jq -r '.median_ttft_ms' "$work/$policy.json") ms, p99 $(jq -r '.p99_ttft_ms' "$work/$policy.json") ms"
  [ "$(jq -r '.completed' "$work/$policy.json")" = "$n" ] && [ $((f1 - f0 + s1 - s0)) = "$n" ] ||
    bad "$policy: $(jq -r '.completed' "$work/$policy.json") of $n completed, $((f1 - f0 + s1 - s0)) counted on the ranks"
  t_down=$(date +%s.%N)
  "$cluster" down "$state" >/dev/null 2>&1 || bad "$policy: cluster.sh down failed"
  state=
  echo "$policy: seconds: up $(secs "$t_up" "$t_warm"), load $(secs "$t_warm" "$t_run"), down $(secs "$t_down" "$(date +%s.%N)")"
}

# --- bad input: usage errors, nothing started
usage() { # expected text, args...: exit 2 naming the problem
  local want=$1 rc; shift
  set +e; "$@" >/dev/null 2>"$work/err"; rc=$?; set -e
  [ "$rc" = 2 ] && grep -q -- "$want" "$work/err" && ok "$(basename "$1") ${*:2}: exit 2" ||
    bad "$* : exit $rc: $(cat "$work/err")"
}
usage 'wants numbers of ms' "$cluster" up --prefill 2 --prefill-delay-ms 0,x
usage 'delays for 1 prefill' "$cluster" up --prefill 1 --prefill-delay-ms 0,100
usage 'over 10000' "$cluster" up --prefill 2 --prefill-delay-ms 0,20000
usage 'step-delay-ms' "$build/prefill/di-prefill" --config tiny --kvstore 127.0.0.1:1 --step-delay-ms 10001
usage 'positive rates' "$root/deploy/local/bench.sh" --rates 1,0

t0=$(date +%s)
run estimate
run round-robin
est_slow=$(cat "$work/estimate.slow"); rr_slow=$(cat "$work/round-robin.slow")
est_p99=$(jq -r '.p99_ttft_ms' "$work/estimate.json"); rr_p99=$(jq -r '.p99_ttft_ms' "$work/round-robin.json")
[ "$est_slow" -le $((n / 5)) ] && ok "estimate: $est_slow of $n prefills on the slow rank" ||
  bad "estimate sent $est_slow of $n prefills to the slow rank (at most $((n / 5)) wanted)"
[ "$rr_slow" -ge $((n / 3)) ] && ok "round-robin: $rr_slow of $n prefills on the slow rank" ||
  bad "round-robin sent only $rr_slow of $n prefills to the slow rank"
awk -v a="$est_p99" -v b="$rr_p99" 'BEGIN { exit !(a < b) }' &&
  ok "p99 TTFT: estimate $est_p99 ms < round-robin $rr_p99 ms (slow rank: $delay ms per step)" ||
  bad "p99 TTFT: estimate $est_p99 ms, round-robin $rr_p99 ms"
echo "test_skew: $(($(date +%s) - t0)) s"
if [ "$fails" = 0 ]; then echo "test_skew: all checks passed"; else echo "test_skew: $fails check(s) failed"; exit 1; fi
