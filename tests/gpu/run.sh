#!/usr/bin/env bash
# One call on a GPU machine: builds the engine, model and kernels with CUDA (no service
# libraries), checks every CUDA kernel against its C twin on random and adversarial data, and
# runs the benchmarks, each printing its figure next to the hardware limit measured in the same
# run. Logs go to $OUT when it is set.
# Usage: tests/gpu/run.sh [--no-bench] [--only "check_moe check_forward ep_generate"]
#   --only: build and run just these check programs (no di-generate end to end); ep_generate:
#           the expert-parallel step (di-generate --ep-ranks 2 on this GPU against one rank,
#           and one rank through NCCL); several GPUs: tests/gpu/ep_bench.sh; ahead_generate:
#           one step ahead and the overlap end to end (tests/gpu/ahead_generate.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/build-gpu/logs}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bench=1
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --only) [ $# -ge 2 ] || { echo "run.sh: --only needs a list of check programs" >&2; exit 2; }
            only=$2; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
targets=()
ep_gen=0
ahead_gen=0
[ -n "$only" ] || ep_gen=1
[ -n "$only" ] || ahead_gen=1
for name in $only; do
  case "$name" in
    check_[a-z]*) targets+=("tests/gpu/$name") ;;
    ep_generate) targets+=("tools/generate/di-generate"); ep_gen=1 ;;
    ahead_generate) targets+=("tools/generate/di-generate" "tools/mkmodel/di-mkmodel"); ahead_gen=1 ;;
    *) echo "run.sh: --only takes check program names (check_moe ...), ep_generate or ahead_generate, not '$name'" >&2; exit 2 ;;
  esac
done

# jansson is the one non-CUDA library the model needs; a machine without it gets the Debian
# packages carried in .gpu-deps/ (apt-get download libjansson4 libjansson-dev), unpacked here.
if ! pkg-config --exists jansson 2>/dev/null; then
  if compgen -G ".gpu-deps/*.deb" >/dev/null; then
    mkdir -p .gpu-deps/root
    for f in .gpu-deps/*.deb; do dpkg-deb -x "$f" .gpu-deps/root; done
    libdir=$root/.gpu-deps/root/usr/lib/x86_64-linux-gnu
    export PKG_CONFIG_PATH=$libdir/pkgconfig
    export PKG_CONFIG_SYSROOT_DIR=$root/.gpu-deps/root
    export LD_LIBRARY_PATH=$libdir:${LD_LIBRARY_PATH:-}
  else
    echo "run.sh: jansson not found and no .gpu-deps/*.deb to unpack" >&2
    exit 2
  fi
fi
meson_cmd=(meson)
command -v meson >/dev/null 2>&1 || meson_cmd=(python3 -m mesonbuild.mesonmain)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  nvcc --version | tail -2
  "${meson_cmd[@]}" --version
} 2>&1 | tee "$out/machine.txt"

if [ ! -f build-gpu/build.ninja ]; then
  "${meson_cmd[@]}" setup build-gpu --buildtype=release -Dservices=disabled -Dtests=disabled \
    -Dtokenizer=disabled -Dcuda=enabled >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 2; }
fi
ninja -C build-gpu "${targets[@]}" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 2; }

status=0
summary=()
for exe in build-gpu/tests/gpu/check_*; do
  [ -f "$exe" ] && [ -x "$exe" ] || continue
  name=$(basename "$exe")
  [ -z "$only" ] || [[ " $only " == *" $name "* ]] || continue
  args=()
  [ "$bench" = 1 ] && args=(--bench)
  if "$exe" "${args[@]}" >"$out/$name.log" 2>&1; then
    summary+=("PASS $name")
  else
    summary+=("FAIL $name (exit $?)")
    status=1
  fi
  cat "$out/$name.log"
done
# Expert parallelism on one GPU: di-generate --ep-ranks 2 (both rank processes on this device,
# the CPU transport) against one rank, both in batch-invariant mode, on the `small` config with
# prompts of 5, 70 and 3 tokens and 12 sampled tokens: the same tokens and logprobs, bit for
# bit, while each rank holds 9 of the 16 experts' slots (2 redundant) and a re-plan moves
# weights between them.
if [ "$ep_gen" = 1 ]; then
  long=$(python3 -c 'import random; r = random.Random(3); print(",".join(str(r.randrange(3, 8000)) for _ in range(70)))')
  ep_args=(--config small --backend cuda --batch-invariant --threads 4 --ids 5,6,7,8,9
           --ids "$long" --ids 20,21,22 --max-tokens 12 --temperature 0.8 --seed 7 --ignore-eos
           --json --quiet)
  ep_ok=1
  build-gpu/tools/generate/di-generate "${ep_args[@]}" >"$out/ep_one.json" 2>"$out/ep_one.log" || ep_ok=0
  build-gpu/tools/generate/di-generate "${ep_args[@]}" --ep-ranks 2 --ep-redundant 2 \
    --eplb-interval 4 >"$out/ep_two.json" 2>"$out/ep_two.log" || ep_ok=0
  if [ "$ep_ok" = 1 ] && python3 - "$out/ep_one.json" "$out/ep_two.json" <<'PY'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
ep = two["stats"]["ep"]
print("== di-generate --backend cuda --batch-invariant, small: --ep-ranks 2 against one rank ==")
for k in ("slots_per_rank", "redundant_slots", "replans", "pairs_sent", "pairs_served",
          "experts_received", "expert_slot_bytes", "checkpoint_expert_bytes"):
    print(f"  {k}: {ep[k]}")
bad = 0
for i, (a, b) in enumerate(zip(one["requests"], two["requests"])):
    if a == b:
        continue
    bad += 1
    t = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    l = next((j for j, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])) if x != y), None)
    print(f"  request {i + 1} differs: first token {t}, first logprob {l}")
print(f"  {len(one['requests']) - bad} of {len(one['requests'])} requests equal bit for bit")
sys.exit(1 if bad or len(one["requests"]) != 3 or ep["replans"] < 1 else 0)
PY
  then
    summary+=("PASS di-generate --backend cuda --ep-ranks 2")
  else
    summary+=("FAIL di-generate --backend cuda --ep-ranks 2")
    status=1
    tail -5 "$out/ep_one.log" "$out/ep_two.log"
  fi
  # One rank with --ep-transport nccl: the rows and outputs through NCCL (to itself on this
  # GPU), the same requests as one rank. Several GPUs: tests/gpu/ep_bench.sh.
  if build-gpu/tools/generate/di-generate "${ep_args[@]}" --ep-ranks 1 --ep-transport nccl \
       --ep-redundant 2 --eplb-interval 4 >"$out/ep_nccl.json" 2>"$out/ep_nccl.log" &&
     python3 - "$out/ep_one.json" "$out/ep_nccl.json" <<'PY'
import json, sys
one, nccl = (json.load(open(p)) for p in sys.argv[1:])
nb = sum(nccl["stats"]["ep"]["device_bytes_sent"])
same = nccl["requests"] == one["requests"]
print(f"== di-generate --ep-ranks 1 --ep-transport nccl: requests "
      f"{'equal' if same else 'DIFFER'} to one rank's, {nb} bytes through NCCL ==")
sys.exit(0 if same and nb > 0 else 1)
PY
  then
    summary+=("PASS di-generate --backend cuda --ep-transport nccl (one rank)")
  else
    summary+=("FAIL di-generate --backend cuda --ep-transport nccl (one rank)")
    status=1
    tail -5 "$out/ep_nccl.log"
  fi
fi
# One step ahead: di-generate --backend cuda with and without --ahead and --overlap, the same
# requests; the decode rate with and without the overlap.
if [ "$ahead_gen" = 1 ]; then
  echo "== di-generate --backend cuda, --ahead and --overlap against the synchronous run =="
  if tests/gpu/ahead_generate.sh build-gpu "$out" cuda; then
    summary+=("PASS di-generate --backend cuda --ahead --overlap")
  else
    summary+=("FAIL di-generate --backend cuda --ahead --overlap")
    status=1
  fi
fi
if [ -n "$only" ]; then
  echo "== tests/gpu summary (only: $only) =="
  printf '%s\n' "${summary[@]}"
  exit $status
fi
# End to end: di-generate on a random-weight `small` checkpoint, a 2,048-token prompt and 256
# greedy tokens, on the CPU backend (16 threads) and on the CUDA backend. Both must produce every
# token; the figures are the engine's own (load, prefill and decode tokens/s).
gen_dir=$(mktemp -d "${TMPDIR:-/tmp}/di-gpu-gen-XXXXXX")
if build-gpu/tools/mkmodel/di-mkmodel --config small --out "$gen_dir/small" --seed 7 \
     >"$out/generate_mkmodel.log" 2>&1; then
  python3 -c 'import random; r = random.Random(1); print(" ".join(str(r.randrange(3, 8000)) for _ in range(2048)))' \
    >"$gen_dir/prompt"
  for b in cpu cuda; do
    if build-gpu/tools/generate/di-generate --model "$gen_dir/small" --backend "$b" --threads 16 \
         --ids-file "$gen_dir/prompt" --max-tokens 256 --temperature 0 --ignore-eos --json \
         >"$out/generate_$b.json" 2>"$out/generate_$b.log"; then
      summary+=("PASS di-generate --backend $b")
    else
      summary+=("FAIL di-generate --backend $b (exit $?)")
      status=1
      tail -5 "$out/generate_$b.log"
    fi
  done
  python3 - "$out/generate_cpu.json" "$out/generate_cuda.json" <<'PY' || status=1
import json, sys
runs = {}
for name, path in zip(("cpu", "cuda"), sys.argv[1:]):
    try:
        runs[name] = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"di-generate {name}: no result ({e})"); sys.exit(1)
print("== di-generate, small, 2,048-token prompt, 256 greedy tokens ==")
for name, r in runs.items():
    s, toks = r["stats"], r["requests"][0]["tokens"]
    print(f"  {name:5s} load {s['load_s']:.2f} s, prefill {s['prefill_tokens'] / s['prefill_s']:.0f} tokens/s, "
          f"decode {s['decode_tokens'] / s['decode_s']:.1f} tokens/s, {len(toks)} tokens")
    if len(toks) != 256:
        print(f"  {name}: {len(toks)} tokens, expected 256"); sys.exit(1)
a, b = runs["cpu"]["requests"][0]["tokens"], runs["cuda"]["requests"][0]["tokens"]
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
print(f"  the first {same} greedy tokens agree (random weights: a near-tie can part them, see docs/cuda.md)")
PY
else
  summary+=("FAIL di-mkmodel small")
  status=1
  tail -5 "$out/generate_mkmodel.log"
fi
rm -rf "$gen_dir"
echo "== tests/gpu summary =="
printf '%s\n' "${summary[@]}"
exit $status
