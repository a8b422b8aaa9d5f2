#!/bin/bash
# Run from the repository root: bash lab/grpo_kl_control/run_cpu60.sh
# 60 updates of TRL's GRPOTrainer, 32 completions per step, on a CPU: add_kl_control's default (equilibrium)
# controller from beta 0.1 and from 10, seeds 2-4, then the tracking controller on seeds 2-3 from both starts, then a
# fixed beta 1.0 (where the equilibrium controller settled) on seeds 2-4; two runs side by side, one thread each.
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
PY=${PY:-python}
lane() {
  for run in "$@"; do
    set -- $run; d=results/grpo_kl_control/runs/cpu60-$1-b$3-$2; mkdir -p $d
    $PY -m lab.grpo_kl_control.run --mode $1 --seed $2 --steps 60 --lr 3e-5 --beta $3 --kl_target 0.03 \
      --batch 32 --out $d > $d.log 2>&1 && cp $d/summary.json results/grpo_kl_control/summaries/cpu60-$1-b$3-$2.json
  done
}
lane "equilibrium 2 0.1" "equilibrium 3 10" "equilibrium 4 0.1" "tracking 2 0.1" "tracking 3 10" "fixed 2 1.0" "fixed 4 1.0" &
lane "equilibrium 2 10" "equilibrium 3 0.1" "equilibrium 4 10" "tracking 2 10" "tracking 3 0.1" "fixed 3 1.0" &
wait
