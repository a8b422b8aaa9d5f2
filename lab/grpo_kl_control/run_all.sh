#!/bin/bash
# Run from the repository root: bash lab/grpo_kl_control/run_all.sh
# The runs of results/grpo_kl_control/README.md, one after another on one thread.
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
PY=${PY:-.venv/bin/python}
for seed in 0 1 2; do
  for mode in fixed tracking; do
    out=results/grpo_kl_control/runs/$mode-$seed
    [ -f $out/summary.json ] && continue
    $PY -m lab.grpo_kl_control.run --mode $mode --seed $seed --steps 30 --lr 3e-5 --beta 0.04 --kl_target 0.03 \
      --out $out > $out.log 2>&1
  done
done
