"""Train a causal LM with PPO and KL control from a YAML experiment.

Single process (CPU or one GPU; not `accelerate launch`, whose single-process launcher exits at a stop signal without
waiting for the script to save its checkpoint):
    python scripts/train.py --config configs/default.yaml
    python scripts/train.py --config configs/tiny.yaml --kl_controller pid --kl_target 2.0 --kl_controller_kwargs '{}'
    (`kl_controller_kwargs` holds one controller's constants: tiny.yaml's are the adaptive controller's, so a
    switch of controller replaces them, here with the PID controller's defaults)

Several GPUs on one machine (DDP; or pick a DeepSpeed / FSDP file in configs/accelerate/):
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml scripts/train.py --config configs/qwen_hub.yaml

Several CPU processes (gloo), e.g. to check distributed behaviour on a laptop:
    torchrun --nproc_per_node 2 scripts/train.py --config configs/tiny.yaml

`--config` sets defaults, command-line flags override them, and an unknown key is an error. Fields come
from `ScriptArguments` (in `klppo/cli.py`), `klppo.KLPPOConfig` (all of transformers' TrainingArguments plus the KL and
PPO fields) and TRL's `ModelConfig` (model, dtype, LoRA).
"""

import sys

from klppo.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
