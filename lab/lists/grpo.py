"""TRL's GRPOTrainer on the list task (`configs/lists.yaml`) with klppo's equilibrium controller setting its beta
(`add_kl_control`), at the klppo runs' budget: 16 completions per update (4 prompts x 4), 30 updates, the same LoRA,
learning rate, temperature, 128-token responses and KL target (8 nats per sequence). Saves the adapter to `<out>/`
and its logs to `<out>/log.jsonl`, `<out>/summary.json`. From the repository root:

    python -m lab.lists.grpo --seed 1 --out outputs/lists-grpo-1
"""

import argparse
import json
import os
import time

import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from klppo.data import list_prompts
from klppo.integrations.trl import add_kl_control
from klppo.models import resolve_model_path
from klppo.rewards import list_items_reward
from lab.grpo_kl_control.run import LogLines

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lists.yaml")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="default: the config's max_steps")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(CONFIG) as f:
        c = yaml.safe_load(f)
    steps = a.steps or c["max_steps"]
    batch = c["per_device_train_batch_size"] * c["num_mini_batches"]  # klppo's sequences per update
    config = GRPOConfig(
        output_dir=a.out,
        beta=c["kl_coef"],
        num_generations=4,
        per_device_train_batch_size=batch,
        max_completion_length=c["response_length"],
        learning_rate=c["learning_rate"],
        lr_scheduler_type="constant",
        temperature=c["temperature"],
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in list_prompts("train")]})
    lora = LoraConfig(
        r=c["lora_r"], lora_alpha=c["lora_alpha"], target_modules=c["lora_target_modules"], task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=resolve_model_path(c["model_name_or_path"]),
        reward_funcs=list_items_reward,
        args=config,
        train_dataset=prompts,
        peft_config=lora,
    )
    add_kl_control(trainer, kl_controller=c["kl_controller"], kl_target=c["kl_target"], kl_target_unit="sequence")
    os.makedirs(a.out, exist_ok=True)
    trainer.add_callback(LogLines(os.path.join(a.out, "log.jsonl")))
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    trainer.save_model(a.out)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    summary = dict(
        arm="trl-grpo",
        seed=a.seed,
        updates=steps,
        sequences_per_update=batch,
        seconds=seconds,
        reward=[h["reward"] for h in logs],
        kl_token=[h.get("kl") for h in logs],
        kl_sequence=[h.get("kl/value") for h in logs],
        beta=[h.get("kl/coef", c["kl_coef"]) for h in logs],
        completion_length=[h.get("completions/mean_length") for h in logs],
    )
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
