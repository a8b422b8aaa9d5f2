#!/bin/bash
# Run from the repository root: bash lab/grpo_kl_control/run_gpu150.sh
# 150 updates of TRL's GRPOTrainer, 64 completions per step, on one GPU: the tracking controller from beta 0.5 and
# from 0.04, and a fixed beta 0.5, seeds 2-4; the nine runs side by side.
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
PY=${PY:-python}
for s in 2 3 4; do
  for run in "tracking 0.5" "fixed 0.5" "tracking 0.04"; do
    set -- $run; d=results/grpo_kl_control/runs/gpu150-$1-b$2-$s; mkdir -p $d
    $PY -m lab.grpo_kl_control.run --mode $1 --seed $s --steps 150 --lr 3e-5 --beta $2 --kl_target 0.03 \
      --batch 64 --out $d > $d.log 2>&1 && cp $d/summary.json results/grpo_kl_control/summaries/gpu150-$1-b$2-$s.json &
  done
done
wait
