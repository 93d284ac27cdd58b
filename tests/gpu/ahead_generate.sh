#!/usr/bin/env bash
# One step ahead end to end: di-generate with and without --ahead on a random-weight `tiny`
# checkpoint (three prompts of 10, 3 and 6 tokens cut over several steps, so they join while
# others decode, 14 tokens each with top logprobs), greedy and seeded, drafts off and on. The
# requests must be equal bit for bit (tokens, logprobs, finish); seeded sampling with drafts
# is compared up to its last 2 (1 + nextn) tokens (the one-step-ahead scheduler budgets step
# N+1's rows as if step N accepted every draft: near max_tokens it may check fewer drafts,
# another valid draw). The --ahead runs must report rows written by the step_ahead op.
# Usage: tests/gpu/ahead_generate.sh BUILD_DIR LOG_DIR [BACKEND]   (BACKEND: cuda, the default,
# or cpu)
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR LOG_DIR [BACKEND]" >&2; exit 2; }
build=$1
out=$2
backend=${3:-cuda}
mkdir -p "$out"
dir=$(mktemp -d "${TMPDIR:-/tmp}/di-ahead-XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$build/tools/mkmodel/di-mkmodel" --quiet --seed 1 tiny "$dir/tiny" >"$out/ahead_mkmodel.log" 2>&1
base=(--model "$dir/tiny" --backend "$backend" --ids 3,17,42,99,100,7,8,9,10,11 --ids 5,6,7
      --ids 9,8,7,6,5,4 --max-tokens 14 --chunk 4 --logprobs 2 --json --quiet)
status=0
i=0
for mode in "--temperature 0 --nextn 0" "--temperature 0 --nextn 3" \
            "--temperature 0.9 --seed 11 --nextn 0" "--temperature 0.9 --seed 11 --nextn 3"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  if "$build/tools/generate/di-generate" "${base[@]}" $mode >"$out/ahead_${i}_off.json" \
       2>"$out/ahead_${i}_off.log" &&
     "$build/tools/generate/di-generate" "${base[@]}" $mode --ahead >"$out/ahead_${i}_on.json" \
       2>"$out/ahead_${i}_on.log"; then :; else
    echo "FAIL di-generate --backend $backend $mode: $(tail -1 "$out/ahead_${i}"_*.log)"
    status=1
    continue
  fi
  python3 - "$out/ahead_${i}_off.json" "$out/ahead_${i}_on.json" "$mode" <<'PY' || status=1
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
mode = sys.argv[3]
tail = 8 if ("--nextn 3" in mode and "--temperature 0 " not in mode + " ") else 0
bad = []
for i, (a, b) in enumerate(zip(off["requests"], on["requests"])):
    if tail:
        n = len(a["tokens"]) - tail
        same = (a["finish"] == b["finish"] and len(a["tokens"]) == len(b["tokens"]) and
                a["tokens"][:n] == b["tokens"][:n] and a["logprobs"][:n] == b["logprobs"][:n])
    else:
        same = a == b
    if not same:
        bad.append(i + 1)
fixed = on["stats"]["ahead_entries"]
ok = not bad and len(on["requests"]) == 3 and fixed > 0 and off["stats"]["ahead_entries"] == 0
print(f"{'PASS' if ok else 'FAIL'} --ahead {mode}: {3 - len(bad)} of 3 requests equal"
      f"{' (all but the last %d tokens)' % tail if tail else ''}, {fixed} entries' rows from "
      f"the step_ahead op")
sys.exit(0 if ok else 1)
PY
done
exit $status
