#!/usr/bin/env bash
# One step ahead end to end: di-generate with and without --ahead on a random-weight `tiny`
# checkpoint (three prompts of 10, 3 and 6 tokens cut over several steps, so they join while
# others decode, 14 tokens each with top logprobs), greedy and seeded, drafts off and on. The
# requests must be equal bit for bit (tokens, logprobs, finish); seeded sampling with drafts
# is compared up to its last 2 (1 + nextn) tokens (the one-step-ahead scheduler budgets step
# N+1's rows as if step N accepted every draft: near max_tokens it may check fewer drafts,
# another valid draw). The --ahead runs must report rows written by the step_ahead op.
# Without drafts --overlap (step N+1 issued before step N is read) must give the synchronous
# run's requests bit for bit and count overlapped steps.
# Then the decode rate at 1, 8 and 64 sequences (nextn 0, greedy, 48 tokens each, prompts of
# 8 tokens) on `tiny` and `small`: synchronous, --ahead and --overlap, with the host's issuing
# time and the time in the collect (the wait) per decode step, side by side.
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
  [[ "$mode" == *"--nextn 0"* ]] || continue
  # shellcheck disable=SC2086
  if ! "$build/tools/generate/di-generate" "${base[@]}" $mode --overlap \
         >"$out/ahead_${i}_overlap.json" 2>"$out/ahead_${i}_overlap.log"; then
    echo "FAIL di-generate --backend $backend $mode --overlap: $(tail -1 "$out/ahead_${i}_overlap.log")"
    status=1
    continue
  fi
  python3 - "$out/ahead_${i}_off.json" "$out/ahead_${i}_overlap.json" "$mode" <<'PY' || status=1
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
same = sum(a == b for a, b in zip(off["requests"], on["requests"]))
n = on["stats"]["overlap_steps"]
ok = same == 3 and len(on["requests"]) == 3 and n > 0
print(f"{'PASS' if ok else 'FAIL'} --overlap {sys.argv[3]}: {same} of 3 requests equal bit for "
      f"bit, {n} steps issued before the previous one was read")
sys.exit(0 if ok else 1)
PY
done

# The decode rate with and without the overlap.
"$build/tools/mkmodel/di-mkmodel" --quiet --seed 1 small "$dir/small" >>"$out/ahead_mkmodel.log" 2>&1
for model in tiny small; do
  for seqs in 1 8 64; do
    ids=()
    for ((k = 0; k < seqs; k++)); do
      ids+=(--ids "$((3 + k)),$((11 + k)),17,42,99,100,7,$((8 + k))")
    done
    for run in sync ahead overlap; do
      flag=()
      [ "$run" = ahead ] && flag=(--ahead)
      [ "$run" = overlap ] && flag=(--overlap)
      if ! "$build/tools/generate/di-generate" --model "$dir/$model" --backend "$backend" \
             "${ids[@]}" --max-tokens 48 --chunk 2048 --temperature 0 --nextn 0 --ignore-eos \
             --json --quiet "${flag[@]}" >"$out/rate_${model}_${seqs}_$run.json" \
             2>"$out/rate_${model}_${seqs}_$run.log"; then
        echo "FAIL di-generate $model $seqs sequences $run: $(tail -1 "$out/rate_${model}_${seqs}_$run.log")"
        status=1
      fi
    done
  done
done
python3 - "$out" <<'PY' || status=1
import json, os, sys
out = sys.argv[1]
print("== decode, nextn 0, greedy, 48 tokens per sequence: synchronous / --ahead / --overlap ==")
print("model seqs | tokens/s sync  ahead  overlap | host issue ms/step ahead overlap | "
      "wait ms/step ahead overlap | overlapped steps | requests equal")
bad = 0
for model in ("tiny", "small"):
    for seqs in (1, 8, 64):
        runs = {}
        for run in ("sync", "ahead", "overlap"):
            path = os.path.join(out, f"rate_{model}_{seqs}_{run}.json")
            try:
                runs[run] = json.load(open(path))
            except (OSError, ValueError):
                runs[run] = None
        if not all(runs.values()):
            print(f"{model} {seqs}: a run failed"); bad += 1; continue
        rate, issue, wait = {}, {}, {}
        for run, r in runs.items():
            s = r["stats"]
            wall = s.get("decode_wall_s") or s["decode_s"]
            rate[run] = s["decode_tokens"] / wall if wall > 0 else 0.0
            if run != "sync":
                issue[run] = 1e3 * s["decode_issue_s"] / max(s["decode_steps"], 1)
                wait[run] = 1e3 * s["decode_collect_s"] / max(s["decode_steps"], 1)
        same = runs["sync"]["requests"] == runs["overlap"]["requests"] == runs["ahead"]["requests"]
        n = runs["overlap"]["stats"]["overlap_steps"]
        bad += (not same) or n == 0
        print(f"{model:5s} {seqs:4d} | {rate['sync']:8.0f} {rate['ahead']:8.0f} {rate['overlap']:8.0f} | "
              f"{issue['ahead']:8.3f} {issue['overlap']:8.3f} | {wait['ahead']:8.3f} {wait['overlap']:8.3f} | "
              f"{n:4d} of {runs['overlap']['stats']['decode_steps']} | {same}")
sys.exit(1 if bad else 0)
PY
exit $status
