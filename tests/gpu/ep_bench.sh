#!/usr/bin/env bash
# Expert parallelism on a machine with 2 to 8 GPUs, one call (docs/ep.md):
#   1. the GPU-to-GPU bandwidth (ep_peer_bw: each pair alone, all pairs at once);
#   2. the bit-equality check: di-generate --backend cuda --batch-invariant --ep-transport nccl
#      with 2, 4, 8 ranks (one GPU each, up to the GPUs there are) against one rank, on the
#      `small` config: every token and logprob equal, a re-plan moving weights included;
#   3. the decode benchmark (di-generate --bench decode) at 1, 2, 4, 8 ranks, EPLB off and on,
#      SEQS sequences a rank: the step time (median, p90), tokens/s, the exchange's share of the
#      step and rate, moe_lb; printed next to the measured bandwidth and the explainer's EP8 /
#      EP64 figures.
# Usage: tests/gpu/ep_bench.sh [--gpus N] [--config NAME] [--layers L] [--seqs S] [--context C]
#                              [--tokens T] [--no-check] [--cpu]
#   --config: the benchmark's model (default v41-flash: the V4.1-Flash width, 384 experts top-6,
#   cut to --layers backbone layers, default 4, written once with di-mkmodel: the whole model
#   is a 307 GB checkpoint; another name is a shipped config, random weights on the fly)
#   --seqs: sequences a rank (default 64, the explainer's 64 requests a GPU); --context: prompt
#   tokens (default 1024); --tokens: decode tokens a sequence (default 64)
#   --cpu: the benchmark only, on the CPU backend of build/ at 1, 2, 4 ranks (the figures of
#   docs/ep.md; defaults: --config small --seqs 4 --context 64 --tokens 16)
# Logs and JSON go to $OUT when it is set (else build-gpu/logs/ep).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PATH=/usr/local/cuda/bin:$PATH
gpus="" config="" layers=4 seqs="" context="" tokens="" check=1 cpu=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus|--config|--layers|--seqs|--context|--tokens)
      [ $# -ge 2 ] || { echo "ep_bench.sh: $1 needs a value" >&2; exit 2; }
      v=$2
      case "$1" in
        --gpus) gpus=$v ;; --config) config=$v ;; --seqs) seqs=$v ;;
        --context) context=$v ;; --tokens) tokens=$v ;; --layers) layers=$v ;;
      esac
      if [ "$1" != --config ] && ! [[ "$v" =~ ^[1-9][0-9]*$ ]]; then
        echo "ep_bench.sh: $1 takes a positive number, not '$v'" >&2; exit 2
      fi
      shift ;;
    --no-check) check=0 ;;
    --cpu) cpu=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "ep_bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$cpu" = 1 ]; then
  bdir=build
  out=${OUT:-$root/build/ep-bench}
  config=${config:-small} seqs=${seqs:-4} context=${context:-64} tokens=${tokens:-16}
  sizes="1 2 4"
  mkdir -p "$out"
  ninja -C "$bdir" tools/generate/di-generate >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 2; }
  { uname -m; nproc; grep -m1 'model name' /proc/cpuinfo || true; } >"$out/machine.txt"
else
  bdir=build-gpu
  out=${OUT:-$root/build-gpu/logs}/ep
  config=${config:-v41-flash} seqs=${seqs:-64} context=${context:-1024} tokens=${tokens:-64}
  mkdir -p "$out"
  have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  gpus=${gpus:-$have}
  if [ "$have" -lt 2 ] || [ "$gpus" -lt 2 ] || [ "$gpus" -gt "$have" ]; then
    echo "ep_bench.sh: needs 2 or more GPUs (this machine has $have, --gpus ${gpus:-none})" >&2
    exit 2
  fi
  sizes=""
  for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && sizes="$sizes $n"; done
  meson_cmd=(meson)
  command -v meson >/dev/null 2>&1 || meson_cmd=(python3 -m mesonbuild.mesonmain)
  if [ ! -f build-gpu/build.ninja ]; then
    "${meson_cmd[@]}" setup build-gpu --buildtype=release -Dservices=disabled -Dtests=disabled \
      -Dtokenizer=disabled -Dcuda=enabled >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 2; }
  fi
  ninja -C build-gpu tools/generate/di-generate tools/mkmodel/di-mkmodel tests/gpu/ep_peer_bw \
    >"$out/build.log" 2>&1 ||
    { tail -40 "$out/build.log"; exit 2; }
  if ! build-gpu/tools/generate/di-generate --help | grep -q -- --ep-transport; then
    echo "ep_bench.sh: this di-generate has no --ep-transport" >&2; exit 2
  fi
  if ! nm -C build-gpu/tools/generate/di-generate 2>/dev/null | grep -q ncclCommInitRankConfig &&
     ! ldd build-gpu/tools/generate/di-generate | grep -q libnccl; then
    echo "ep_bench.sh: di-generate was built without NCCL (the toolkit at cudatk_dir has none)" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv >"$out/machine.txt" 2>&1 || true
  nvidia-smi topo -m >>"$out/machine.txt" 2>&1 || true
  cat "$out/machine.txt"
fi
gen=$bdir/tools/generate/di-generate
status=0
summary=()

# The benchmark's model: --config v41-flash is the released width on --layers backbone layers
# (the per-layer lists cut to match), one checkpoint every rank loads its experts from.
model=(--config "$config")
model_dir=""
if [ "$cpu" = 0 ] && [ "$config" = v41-flash ]; then
  model_dir=$root/build-gpu/ep-model-v41w$layers
  if [ ! -f "$model_dir/model.safetensors.sha256.json" ]; then
    rm -rf "$model_dir"
    mkdir -p "$model_dir.cfg"
    python3 - common/model/configs/v41-flash.json "$layers" "$model_dir.cfg/config.json" <<'PY' ||
import json, sys
c = json.load(open(sys.argv[1]))
t, L = c["text_config"], int(sys.argv[2])
if not 4 <= L <= 40:
    sys.exit("ep_bench.sh: --layers takes 4..40")
nextn = t["num_nextn_predict_layers"]
# dense window layers first, then the compressed ones: the released order, cut to L
t["num_hidden_layers"] = L
t["compress_ratios"] = [0, 0] + [2] * ((L - 2) // 2) + [1] * (L - 2 - (L - 2) // 2) + [0] * nextn
first_c1 = 2 + (L - 2) // 2
t["kv_source_layer_ids"] = [2, first_c1]
t["index_source_layer_ids"] = [2] + list(range(first_c1, L, 4))
t["candidate_source_layer_id"] = first_c1
t["engram_layer_ids"] = t["engram_layer_ids"][:1]
t["engram_num_embeddings"] = t["engram_num_embeddings"][:1]
t["dspark_target_layer_ids"] = [L - 3, L - 2, L - 1]
json.dump(c, open(sys.argv[3], "w"), indent=1)
PY
      { echo "ep_bench.sh: cannot cut the v41-flash config" >&2; exit 2; }
    build-gpu/tools/mkmodel/di-mkmodel --config "$model_dir.cfg/config.json" --out "$model_dir" \
      --force --quiet >"$out/mkmodel.log" 2>&1 || { tail -5 "$out/mkmodel.log"; exit 2; }
  fi
  model=(--model "$model_dir" --trust-weights)
  config="v41-flash width, $layers layers"
fi

# 1. the bandwidth the exchange runs against
if [ "$cpu" = 0 ]; then
  if build-gpu/tests/gpu/ep_peer_bw "$gpus" 256 >"$out/peer_bw.json" 2>"$out/peer_bw.log"; then
    summary+=("PASS ep_peer_bw $gpus GPUs")
  else
    summary+=("FAIL ep_peer_bw (exit $?)"); status=1; cat "$out/peer_bw.log"
    echo '{}' >"$out/peer_bw.json"
  fi
fi

# 2. the bit-equality check: NCCL transport, batch-invariant, 2/4/8 ranks against one
if [ "$cpu" = 0 ] && [ "$check" = 1 ]; then
  long=$(python3 -c 'import random; r = random.Random(3); print(",".join(str(r.randrange(3, 8000)) for _ in range(70)))')
  ck=(--config small --backend cuda --batch-invariant --threads 4 --ids 5,6,7,8,9 --ids "$long"
      --ids 20,21,22 --ids 30,31,32,33 --max-tokens 12 --temperature 0.8 --seed 7 --ignore-eos
      --json --quiet)
  if "$gen" "${ck[@]}" >"$out/check_1.json" 2>"$out/check_1.log"; then
    for n in $sizes; do
      [ "$n" -gt 1 ] || continue
      if "$gen" "${ck[@]}" --ep-ranks "$n" --ep-transport nccl --ep-redundant "$n" \
           --eplb-interval 4 >"$out/check_$n.json" 2>"$out/check_$n.log" &&
         python3 - "$out/check_1.json" "$out/check_$n.json" "$n" <<'PY'
import json, sys
one, many = (json.load(open(p)) for p in sys.argv[1:3])
n = int(sys.argv[3])
ep = many["stats"]["ep"]
bad = [i + 1 for i, (a, b) in enumerate(zip(one["requests"], many["requests"])) if a != b]
print(f"== NCCL exchange, {n} GPUs, small, batch-invariant: {len(one['requests']) - len(bad)} of "
      f"{len(one['requests'])} requests equal bit for bit; {ep['replans']} re-plans, "
      f"{sum(ep['experts_received'])} experts moved, {sum(ep['device_bytes_sent'])} bytes GPU to GPU")
sys.exit(1 if bad or len(many["requests"]) != len(one["requests"]) or
         sum(ep["device_bytes_sent"]) == 0 else 0)
PY
      then
        summary+=("PASS bit-equality, NCCL, $n GPUs")
      else
        summary+=("FAIL bit-equality, NCCL, $n GPUs"); status=1; tail -5 "$out/check_$n.log"
      fi
    done
  else
    summary+=("FAIL one-rank reference run"); status=1; tail -5 "$out/check_1.log"
  fi
fi

# 3. the decode benchmark: SEQS sequences a rank, EPLB off and on
for n in $sizes; do
  for eplb in off on; do
    args=("${model[@]}" --bench decode --bench-seqs $((seqs * n)) --bench-context "$context"
          --max-tokens "$tokens" --ep-ranks "$n" --ep-timeout 600000 --json --quiet)
    [ "$eplb" = on ] && args+=(--ep-redundant "$n" --eplb-interval 8)
    if [ "$cpu" = 1 ]; then
      args+=(--threads 1)
    else
      args+=(--backend cuda)
      [ "$n" -gt 1 ] && args+=(--ep-transport nccl)
    fi
    f="$out/bench_${n}_eplb_$eplb"
    if "$gen" "${args[@]}" >"$f.json" 2>"$f.log"; then
      summary+=("PASS bench $n rank(s), EPLB $eplb")
    else
      summary+=("FAIL bench $n rank(s), EPLB $eplb (exit $?)"); status=1; tail -3 "$f.log"
      echo '{}' >"$f.json"
    fi
  done
done
python3 - "$out" "$cpu" "$config" "$seqs" "$context" "$tokens" $sizes <<'PY' | tee "$out/bench_table.txt"
import json, os, sys
out, cpu, config, seqs, context, tokens = sys.argv[1:7]
sizes = [int(s) for s in sys.argv[7:]]
bw = {} if cpu == "1" else json.load(open(os.path.join(out, "peer_bw.json")))
print(f"== decode benchmark: {config}, {seqs} sequences a rank, {context} prompt tokens, "
      f"{tokens} tokens each; {'CPU backend, CPU transport' if cpu == '1' else 'CUDA, NCCL'} ==")
print(f"{'ranks':>5} {'EPLB':>4} {'steps':>5} {'step ms':>8} {'p90 ms':>8} {'tokens/s':>9} "
      f"{'xchg %':>6} {'xchg GB/s':>9} {'moe_lb':>6} {'lb p90':>6}")
for n in sizes:
    for eplb in ("off", "on"):
        try:
            r = json.load(open(os.path.join(out, f"bench_{n}_eplb_{eplb}.json")))
            b, ep = r["stats"]["bench"], r["stats"]["ep"]
        except (KeyError, ValueError, OSError):
            print(f"{n:>5} {eplb:>4}  (no result: see bench_{n}_eplb_{eplb}.log)")
            continue
        # the exchange's rate: bytes a rank sent GPU to GPU over its time in the exchange
        xs = [b_ / ns for b_, ns in zip(ep["device_bytes_sent"], ep["exchange_ns"]) if ns]
        rate = f"{sum(xs) / len(xs):9.1f}" if xs and n > 1 and cpu != "1" else f"{'-':>9}"
        print(f"{n:>5} {eplb:>4} {b['decode_steps']:>5} {b['step_ms_median']:8.2f} "
              f"{b['step_ms_p90']:8.2f} {b['tokens_per_s']:9.1f} {100 * b['exchange_share']:6.1f} "
              f"{rate} {b['moe_lb_median']:6.3f} {b['moe_lb_p90']:6.3f}")
if bw:
    print(f"GPU to GPU, measured now ({bw['gpus']} GPUs, {bw['mib']} MiB copies): a pair alone "
          f"{bw['pair_gbs_min']}-{bw['pair_gbs_max']} GB/s (median {bw['pair_gbs_median']}), all "
          f"pairs at once {bw['alltoall_gbs_per_gpu']} GB/s out of each GPU")
print("Explainer (DeepSeek's engine, SM100, 131,072-token context, nextn 3, 64 requests a GPU): "
      "EP8 16.4 ms a step (61 steps/s), EP64 13.2 ms (76 steps/s); production decode moe_lb "
      "1.090 with EPLB on; prefill moe_lb 1.045 at EP2, 1.074 at EP4")
PY
echo "== tests/gpu/ep_bench.sh summary =="
printf '%s\n' "${summary[@]}"
exit $status
