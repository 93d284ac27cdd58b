#!/usr/bin/env bash
# di-bench against the local cluster at several request rates, with a shared-prefix workload
# next to one without sharing:
#
#   deploy/local/bench.sh [--build DIR] [--out DIR] [--rates R1,R2,R3] [--num-prompts N]
#                         [--prefill N] [--decode M] [--input-len N] [--shared-prefix-len N]
#                         [--output-len N] [--max-concurrency N] [--seed N]
#
# Brings the cluster up (deploy/local/cluster.sh: demo checkpoint, KV store, the ranks on the
# CPU, the router), runs `di-bench --sweep` twice over the same rates: "shared" prompts start
# with the same --shared-prefix-len tokens (default 256, two 128-token blocks) followed by
# --input-len random ones (default 128); "unique" prompts are all random, of the same total
# length. Then, as the reference measured in the same run, the engine alone: di-generate on the
# same checkpoint with the ranks' thread count, all prompts of one rate in one batch, no network
# (its prefill and decode tokens/s bound what one rank can serve). Stops the cluster (also on
# Ctrl-C) and writes into --out (default build/bench):
#
#   bench.md        the machine, every configuration and the table (markdown)
#   bench.png       median and p99 TTFT and median TPOT against rate, both workloads (gnuplot)
#   shared.*, unique.*  each sweep: di-bench's table (.txt), JSON lines (.jsonl), plot (.png,
#                   with its data .png.dat and script .png.gp) and progress log (.log)
#
# The hit rate is di-bench's: usage.prompt_tokens_details.cached_tokens over prompt tokens.
# Needs gnuplot (Debian: gnuplot-nox; deploy/local/install-deps.sh installs it) and jq.
# Exit status: 0 done, 1 a failure, 2 bad usage.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
me=bench.sh

usage_fail() { echo "$me: $*" >&2; exit 2; }
fail() { echo "$me: $*" >&2; exit 1; }
help() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; }
num() { [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] && [ "$2" -le "$4" ] ||
  usage_fail "$1 wants a whole number $3..$4, not '$2'"; }

build=$root/build out='' rates=0.25,0.5,1 n=8 n_prefill=1 n_decode=1 in_len=128 prefix=256
out_len=16 conc=8 seed=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) [ -d "${2:-}" ] || usage_fail "--build: '${2:-}' is not a directory"; build=$(cd "$2" && pwd); shift ;;
    --out) out=${2:?--out needs a DIR}; shift ;;
    --rates) [[ "${2:-}" =~ ^([0-9]+|[0-9]*\.[0-9]+)(,([0-9]+|[0-9]*\.[0-9]+))*$ ]] &&
               [[ ! ",$2," =~ ,[0.]+, ]] || usage_fail "--rates wants positive rates like 0.5,1,2, not '${2:-}'"
             rates=$2; shift ;;
    --num-prompts) num "$1" "${2:-}" 1 10000; n=$2; shift ;;
    --prefill) num "$1" "${2:-}" 1 16; n_prefill=$2; shift ;;
    --decode) num "$1" "${2:-}" 1 16; n_decode=$2; shift ;;
    --input-len) num "$1" "${2:-}" 1 65536; in_len=$2; shift ;;
    --shared-prefix-len) num "$1" "${2:-}" 0 65536; prefix=$2; shift ;;
    --output-len) num "$1" "${2:-}" 1 4096; out_len=$2; shift ;;
    --max-concurrency) num "$1" "${2:-}" 1 1024; conc=$2; shift ;;
    --seed) num "$1" "${2:-}" 0 4294967295; seed=$2; shift ;;
    -h|--help) help; exit 0 ;;
    *) usage_fail "unknown option $1 (see --help)" ;;
  esac
  shift
done
out=${out:-$build/bench}
for b in tools/bench/di-bench tools/generate/di-generate kvstore/di-kvctl; do
  [ -x "$build/$b" ] || fail "$build/$b is not built (meson setup build && ninja -C build)"
done
command -v gnuplot >/dev/null || fail "gnuplot is not installed (Debian: gnuplot-nox; deploy/local/install-deps.sh)"
command -v jq >/dev/null || fail "jq is not installed (deploy/local/install-deps.sh)"
mkdir -p "$out"
out=$(cd "$out" && pwd)

state=''
cleanup() { [ -z "$state" ] || "$root/deploy/local/cluster.sh" down "$state" >/dev/null 2>&1 || true; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
"$root/deploy/local/cluster.sh" up --build "$build" --prefill "$n_prefill" --decode "$n_decode" \
  >"$out/cluster.env" || fail "the cluster did not come up"
# shellcheck disable=SC1091
. "$out/cluster.env"
host=${router_http#http://}

# lookups: "blocks hits" the store has been asked for and found so far (all callers: the
# router asks for each prompt's blocks before placing it)
lookups() {
  DI_KVSTORE_ADMIN_TOKEN=$(cat "$admin_token_file") "$build/kvstore/di-kvctl" --target "$kvstore" \
    --json stats | jq -r '"\(.lookup_blocks) \(.lookup_hits)"'
}

# sweep NAME SHARED_PREFIX INPUT_LEN OUTPUT_LEN: one di-bench sweep into $out/NAME.*, and the
# store's block lookups during it into $out/NAME.lookups ("blocks hits")
sweep() {
  echo "$me: $1 prompts ($2 shared + $3 random tokens) at $rates req/s" >&2
  local b0 h0 b1 h1
  read -r b0 h0 < <(lookups) || fail "di-kvctl stats failed"
  "$build/tools/bench/di-bench" --host "$host" --api-key-file "$api_key_file" \
    --num-prompts "$n" --sweep "$rates" --arrival poisson --max-concurrency "$conc" \
    --input-len "$3" --shared-prefix-len "$2" --output-len "$4" --seed "$seed" \
    --json "$out/$1.jsonl" --plot "$out/$1.png" >"$out/$1.txt" 2> >(tee "$out/$1.log" >&2) ||
    fail "di-bench ($1) failed; see $out/$1.log"
  read -r b1 h1 < <(lookups) || fail "di-kvctl stats failed"
  echo "$((b1 - b0)) $((h1 - h0))" >"$out/$1.lookups"
}
sweep shared "$prefix" "$in_len" "$out_len"
sweep unique 0 $((prefix + in_len)) "$out_len"

# The reference: the engine alone on the same checkpoint, n prompts of the same length at once.
echo "$me: reference: di-generate, $n prompts of $((prefix + in_len)) tokens, one batch" >&2
awk -v n="$n" -v len=$((prefix + in_len)) -v s="$seed" 'BEGIN { srand(s);
  for (i = 0; i < n; i++) { l = ""; for (k = 0; k < len; k++) l = l (k ? "," : "") int(1000 + rand() * 20000); print l } }' \
  >"$out/reference.ids"
"$build/tools/generate/di-generate" --model "$state/model" --threads 1 --ids-file "$out/reference.ids" \
  --max-tokens "$out_len" --ignore-eos --json >"$out/reference.json" 2>"$out/reference.log" ||
  fail "di-generate failed: $(tail -n 3 "$out/reference.log")"
ref_prefill=$(jq -r '.stats | .prefill_tokens / .prefill_s | floor' "$out/reference.json")
ref_decode=$(jq -r '.stats | .decode_tokens / .decode_s * 10 | floor / 10' "$out/reference.json")

"$root/deploy/local/cluster.sh" down "$state" >/dev/null 2>&1 || true
state=''
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

# The plot of both sweeps.
cat >"$out/bench.gp" <<EOF
set terminal pngcairo size 900,560 font ',10'
set output '$out/bench.png'
set title 'di-bench against the local cluster ($model, CPU): $n prompts of $((prefix + in_len)) tokens, $out_len out, per rate'
set xlabel 'request rate (req/s, Poisson)'
set ylabel 'latency (ms)'
set logscale y
set key outside right
set grid
plot '$out/shared.png.dat' u 1:2 w lp lc 1 pt 7 t 'shared prefix: median TTFT', \
     '' u 1:3 w lp lc 1 pt 5 dt 2 t 'shared prefix: p99 TTFT', \
     '' u 1:4 w lp lc 3 pt 7 t 'shared prefix: median TPOT', \
     '$out/unique.png.dat' u 1:2 w lp lc 2 pt 6 t 'no sharing: median TTFT', \
     '' u 1:3 w lp lc 2 pt 4 dt 2 t 'no sharing: p99 TTFT', \
     '' u 1:4 w lp lc 4 pt 6 t 'no sharing: median TPOT'
EOF
gnuplot "$out/bench.gp" || fail "gnuplot $out/bench.gp failed"

# The table.
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
mem=$(awk '/^MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)
lookup_line() { # name, label: "label: H of B blocks found (P %)"
  local b h
  read -r b h <"$out/$1.lookups"
  awk -v l="$2" -v b="$b" -v h="$h" 'BEGIN { printf "%s %d of %d blocks found (%.1f %%)", l, h, b, b ? 100 * h / b : 0 }'
}
rows() { # workload name, file
  jq -r --arg w "$1" '[$w, .request_rate, "\(.completed)/\(.completed + .failed)",
      (.request_throughput * 100 | round / 100), (.output_throughput * 10 | round / 10),
      (.median_ttft_ms | round), (.p99_ttft_ms | round), (.median_tpot_ms | round),
      (.p99_tpot_ms | round), (.median_itl_ms | round), (.median_e2el_ms | round),
      "\(.prefix_cache_hit_rate * 1000 | round / 10) %"] | "| " + join(" | ") + " |"' "$2"
}
{
  echo "- Machine: $cpu, $(nproc) cores, $mem; load average $load_start at the start, $load_end at the end (shared with other work)."
  echo "- Cluster: \`deploy/local/cluster.sh up --prefill $n_prefill --decode $n_decode\` ($model checkpoint, random weights; CPU backend, 1 thread per rank; chunk 512, 16 drafts per decode step; KV store \`--durability none\`)."
  echo "- Load: \`di-bench --num-prompts $n --sweep $rates --arrival poisson --max-concurrency $conc --output-len $out_len --seed $seed\`, with \`--shared-prefix-len $prefix --input-len $in_len\` (shared) and \`--input-len $((prefix + in_len))\` (no sharing)."
  echo "- Reference in the same run, the engine alone (\`di-generate --threads 1\`, the same checkpoint, the $n prompts in one batch): prefill $ref_prefill tokens/s, decode $ref_decode tokens/s."
  echo
  echo "| workload | rate (req/s) | done | req/s | out tok/s | TTFT median (ms) | TTFT p99 | TPOT median (ms) | TPOT p99 | ITL median (ms) | E2E median (ms) | prefix hit rate |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
  rows "shared prefix" "$out/shared.jsonl"
  rows "no sharing" "$out/unique.jsonl"
  echo
  echo "Prefix hit rate: \`usage.prompt_tokens_details.cached_tokens\` over prompt tokens, as the router reports them. The KV store's block lookups during each sweep (the router asks for each prompt's 128-token blocks before placing it): $(lookup_line shared "shared prefix"), $(lookup_line unique "no sharing")."
} >"$out/bench.md"
cat "$out/bench.md"
echo "$me: wrote $out/bench.md and $out/bench.png" >&2
