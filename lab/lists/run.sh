#!/usr/bin/env bash
# The list task's runs in results/lists/: one arm and seed per call, one thread each (run two at once on two cores).
#   bash lab/lists/run.sh ppo 1     klppo's PPO, the KL controller (configs/lists.yaml as shipped)
#   bash lab/lists/run.sh rloo 1    the same with klppo's RLOO advantages (no critic), 4 responses per prompt
#   bash lab/lists/run.sh grpo 1    TRL's GRPOTrainer with add_kl_control (lab/lists/grpo.py)
#   bash lab/lists/run.sh base 0    the reference model alone (held-out evaluation only)
# Each run is followed by the held-out evaluation of its adapter (lab/lists/evaluate.py). Runs go to
# ${RUNS:-outputs/lists-runs}/<arm>-<seed>/.
set -euo pipefail
arm=$1 seed=$2
runs=${RUNS:-outputs/lists-runs}
out=$runs/$arm-$seed
python=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$out"
case $arm in
  ppo | rloo)
    extra=()
    [ "$arm" = rloo ] && extra=(--advantage_estimator rloo)
    $python scripts/train.py --config configs/lists.yaml --seed "$seed" --report_to none --output_dir "$out" \
      --save_strategy no --disable_tqdm true "${extra[@]}" > "$out/train.log" 2>&1
    ;;
  grpo) $python -m lab.lists.grpo --seed "$seed" --out "$out" > "$out/train.log" 2>&1 ;;
  base) ;;
  *) echo "arm: ppo, rloo, grpo or base" >&2; exit 2 ;;
esac
adapter=()
[ "$arm" = base ] || adapter=(--adapter "$out")
$python -m lab.lists.evaluate "${adapter[@]}" --out "$out/heldout.json" > "$out/heldout.log" 2>&1
