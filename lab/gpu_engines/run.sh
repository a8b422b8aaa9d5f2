#!/bin/bash
# klppo on one GPU under each engine that accelerate launches (run from the repository root as
# `bash lab/gpu_engines/run.sh [RUNS]`, default RUNS results/gpu_engines/runs, in an environment with
# klppo and a CUDA build of torch): the default job (SmolLM2 + LoRA, bf16) under plain accelerate, FSDP2 and
# DeepSpeed ZeRO-3, side by side; the tiny job in float32 under plain accelerate, FSDP2, ZeRO-2 and ZeRO-3, each
# resumed from its checkpoint-2; the tiny job with LoRA in bf16 under FSDP2 and ZeRO-3. Then lab.gpu_engines.check_engines.
set -u
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
R=${1:-results/gpu_engines/runs}; mkdir -p $R/default $R/tiny
L="python -m accelerate.commands.launch"
DJ="scripts/train.py --config configs/default.yaml --use_cpu false --report_to none --num_sample_generations 0"
p=29611; for e in single_gpu fsdp deepspeed_zero3; do
  timeout 250 $L --config_file configs/accelerate/$e.yaml --num_processes 1 --main_process_port $p $DJ \
    --output_dir $R/default/$e > $R/default/$e.log 2>&1 &
  p=$((p+1)); done
TJ="scripts/train.py --config configs/tiny.yaml --use_cpu false --max_steps 3 --save_strategy steps --save_steps 1 --eval_steps 1"
p=29620; for e in single_gpu fsdp deepspeed_zero2 deepspeed_zero3; do
  timeout 120 $L --config_file configs/accelerate/$e.yaml --num_processes 1 --mixed_precision no --main_process_port $p \
    $TJ --output_dir $R/tiny/$e > $R/tiny/$e.log 2>&1 &
  p=$((p+1)); done
LJ="$TJ --use_peft true --lora_r 4 --lora_target_modules q_proj v_proj --learning_rate 0.01"
for e in fsdp deepspeed_zero3; do
  timeout 120 $L --config_file configs/accelerate/$e.yaml --num_processes 1 --main_process_port $p $LJ \
    --output_dir $R/tiny/lora-bf16-$e > $R/tiny/lora-bf16-$e.log 2>&1 &
  p=$((p+1)); done
for e in single_gpu fsdp deepspeed_zero2 deepspeed_zero3; do
  while [ ! -f $R/tiny/$e/summary.json ] && pgrep -f "output_dir $R/tiny/$e\$" >/dev/null; do sleep 2; done; done
p=29630; for e in single_gpu fsdp deepspeed_zero2 deepspeed_zero3; do
  timeout 100 $L --config_file configs/accelerate/$e.yaml --num_processes 1 --mixed_precision no --main_process_port $p \
    $TJ --output_dir $R/tiny/$e-resumed --resume_from_checkpoint $R/tiny/$e/checkpoint-2 > $R/tiny/$e-resumed.log 2>&1 &
  p=$((p+1)); done
wait
python -m lab.gpu_engines.check_engines $R/tiny > $R/tiny/check.json
