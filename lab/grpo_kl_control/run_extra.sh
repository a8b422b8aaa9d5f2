#!/bin/bash
# Run from the repository root: bash lab/grpo_kl_control/run_extra.sh
# Two further tracking runs (seed 0): 60 updates from beta 0.04, and 30 updates from beta 0.2.
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
PY=${PY:-.venv/bin/python}
out=results/grpo_kl_control/runs/tracking-60-updates-0
$PY -m lab.grpo_kl_control.run --mode tracking --seed 0 --steps 60 --lr 3e-5 --beta 0.04 --kl_target 0.03 --out $out > $out.log 2>&1
out=results/grpo_kl_control/runs/tracking-beta0.2-0
$PY -m lab.grpo_kl_control.run --mode tracking --seed 0 --steps 30 --lr 3e-5 --beta 0.2 --kl_target 0.03 --out $out > $out.log 2>&1
