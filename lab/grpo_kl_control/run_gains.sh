#!/bin/bash
# Run from the repository root: bash lab/grpo_kl_control/run_gains.sh
# The tracking controller with faster gains (kl_controller_kwargs) on seed 0, 60 updates from beta 0.04, the two runs
# side by side on one thread each; summaries are copied to results/grpo_kl_control/summaries/.
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
PY=${PY:-.venv/bin/python}
R=results/grpo_kl_control/runs
mkdir -p $R results/grpo_kl_control/summaries
run() {
  $PY -m lab.grpo_kl_control.run --mode tracking --seed 0 --steps 60 --lr 3e-5 --beta 0.04 --kl_target 0.03 \
    --kwargs "$2" --out $R/$1 > $R/$1.log 2>&1 && cp $R/$1/summary.json results/grpo_kl_control/summaries/$1.json
}
run pilotA-0 '{"ki": 0.5, "kp": 0.6, "lookahead": 4}' &
run pilotB-0 '{"ki": 1.0, "kp": 0.6, "lookahead": 4}' &
wait
