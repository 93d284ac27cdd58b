#!/usr/bin/env bash
# The main job on one machine: the disaggregated cluster on loopback, small model, CPU backend.
#   1. builds the project (build/);
#   2. brings the cluster up (deploy/local/cluster.sh up: a random-weight `demo` checkpoint,
#      di-kvstore, one di-prefill and one di-decode rank, di-router with client keys);
#   3. sends a chat request to the router's OpenAI API with curl and prints the answer as it
#      streams (random weights, so the text is noise);
#   4. sends a second chat request with the same long system prompt and another question: shows
#      what the store holds of the shared prefix (di-kvctl inspect) and the cached tokens the
#      router reports, and what is and is not reused;
#   5. shows the store's counters (di-kvctl stats);
#   6. stops everything (deploy/local/cluster.sh down), also on an error and on Ctrl-C.
# The offline engine with the store-backed resume of di-generate: deploy/local/offline.sh.
# Options: --keep keeps the state dir (logs, tokens, checkpoint); --prefill N, --decode M,
# --backend cpu|cuda go to cluster.sh up.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

keep=0
up_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep=1 ;;
    --prefill|--decode|--backend) up_args+=("$1" "${2:?$1 needs a value}"); shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for t in curl jq; do
  command -v "$t" >/dev/null || { echo "run.sh: $t is not installed: run deploy/local/install-deps.sh" >&2; exit 1; }
done

step() { printf '\n== %s\n' "$*"; }

step "build"
deploy/local/build.sh kvstore/di-kvstore kvstore/di-kvctl prefill/di-prefill decode/di-decode \
  router/di-router tools/mkmodel/di-mkmodel tools/tokenize/di-tokenize

step "the cluster on loopback: deploy/local/cluster.sh up"
state=
env_file=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -z "$env_file" ] || rm -f "$env_file"
  if [ -n "$state" ]; then
    step "stop: deploy/local/cluster.sh down"
    if [ "$keep" = 1 ]; then deploy/local/cluster.sh down "$state" --keep
    else deploy/local/cluster.sh down "$state"; fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
env_file=$(mktemp /tmp/deepinfer-run.XXXXXX)
deploy/local/cluster.sh up ${up_args[@]+"${up_args[@]}"} >"$env_file"
# shellcheck disable=SC1090,SC2154
. "$env_file"
sed 's/^/  /' "$state/cluster.env"
key=$(cat "$api_key_file")

# A long system prompt (whole 128-token blocks for the store) shared by both requests.
system=$(for i in $(seq 1 30); do printf 'Rule %d: answer briefly, and name the source of every number you give. ' "$i"; done)
messages() { jq -cn --arg s "$system" --arg q "$1" '[{role:"system",content:$s},{role:"user",content:$q}]'; }

chat() { # question: streams the answer, prints it as it comes, leaves the usage in $state/usage.json
  local body
  body=$(jq -cn --arg m "$model" --argjson msgs "$(messages "$1")" \
    '{model:$m, messages:$msgs, max_tokens:24, temperature:0.8, seed:7, stream:true,
      stream_options:{include_usage:true}}')
  printf '  Q: %s\n  A: ' "$1"
  curl -sSN --fail-with-body -m 120 "$router_http/v1/chat/completions" \
    -H "Authorization: Bearer $key" -H 'Content-Type: application/json' -d "$body" |
  while IFS= read -r line; do
    line=${line%$'\r'}
    case "$line" in
      'data: [DONE]') break ;;
      'data: '*)
        chunk=${line#data: }
        if [ "$(jq -r '.usage != null' <<<"$chunk")" = true ]; then
          jq -c '.usage' <<<"$chunk" >"$state/usage.json"
        elif [ "$(jq -r 'has("error")' <<<"$chunk")" = true ]; then
          printf '\n' ; echo "run.sh: the stream ended with an error: $chunk" >&2; exit 1
        else
          jq -j '.choices[0].delta.content // empty' <<<"$chunk"
        fi ;;
      *) [ -z "$line" ] || { printf '\n'; echo "run.sh: the router answered: $line" >&2; exit 1; } ;;
    esac
  done
  printf '\n'
  [ -s "$state/usage.json" ] || { echo "run.sh: the stream carried no usage" >&2; exit 1; }
  jq -r '"  usage: \(.prompt_tokens) prompt tokens, \(.completion_tokens) completion tokens, prompt_tokens_details.cached_tokens \(.prompt_tokens_details.cached_tokens)"' "$state/usage.json"
}

step "a chat request, streamed: curl $router_http/v1/chat/completions (random weights: the text is noise)"
rm -f "$state/usage.json"
chat "What is the capital of France?"
cached1=$(jq -r '.prompt_tokens_details.cached_tokens' "$state/usage.json")

step "a second request with the same system prompt and another question"
rm -f "$state/usage.json"
chat "And the capital of Italy?"
prompt2=$(jq -r '.prompt_tokens' "$state/usage.json")
cached2=$(jq -r '.prompt_tokens_details.cached_tokens' "$state/usage.json")

echo "  what the store holds of the second prompt (di-tokenize --chat, di-kvctl inspect):"
export DI_KVSTORE_TARGET=$kvstore
DI_KVSTORE_ADMIN_TOKEN=$(cat "$admin_token_file")
export DI_KVSTORE_ADMIN_TOKEN
messages "And the capital of Italy?" |
  build/tools/tokenize/di-tokenize --chat --tokenizer data/tokenizer/deepseek-v3/tokenizer.json >"$state/prompt2.ids"
build/kvstore/di-kvctl inspect "$state/prompt2.ids" | sed 's/^/    /'
held=$(build/kvstore/di-kvctl --json inspect "$state/prompt2.ids" | jq -r '.cached_prefix_blocks')
[ "$held" -ge 1 ] || { echo "run.sh: the store holds none of the shared system prompt" >&2; exit 1; }
echo
echo "  Prefix cache: the store holds $held blocks ($((held * 128)) tokens) of the second prompt's $prompt2:"
echo "  the shared system prompt, stored by di-prefill for the first request. The router looked"
echo "  them up (the lookup counters of di-kvctl stats below) and placed the prefill by the"
echo "  tokens left to compute; di-prefill loaded them (blocks and the window state) and computed"
echo "  the rest, so the router reports usage.prompt_tokens_details.cached_tokens = $cached2 for the"
echo "  second request ($cached1 for the first): the tokens prefill took from the store. A hit is"
echo "  capped so that prefill always computes the prompt's last 140 tokens or more."

step "the store's counters: di-kvctl stats"
build/kvstore/di-kvctl stats
