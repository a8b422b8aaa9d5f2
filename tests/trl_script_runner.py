"""Run a TRL-shaped script as `python <script> <flags>` runs it, and record what its `PPOTrainer` did.

    python tests/trl_script_runner.py examples/ppo.py --dataset_name ... (the script's own flags)

The script runs unchanged, as `__main__`, with `sys.argv` set to `[script, *flags]`; under `accelerate launch`
every rank runs it. When it ends, each rank writes `$KLPPO_RUN_RECORD/rank<RANK>.json`: every PPO update's metrics
(as `PPOTrainer.ppo_update` returns them, under klppo's names, whatever `logging_steps` says) and a few facts of the
trainer (its stop token, suppressed tokens, sampling configuration and arguments).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from klppo import PPOTrainer

ARGS_RECORDED = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "local_batch_size",
    "batch_size",
    "num_mini_batches",
    "num_ppo_epochs",
    "learning_rate",
    "response_length",
    "missing_eos_penalty",
    "stop_token",
    "stop_token_id",
    "total_episodes",
    "num_total_batches",
    "local_rollout_forward_batch_size",
    "rollout_forward_batch_size",
    "eval_steps",
    "output_dir",
    "world_size",
)


def main() -> None:
    script, flags = sys.argv[1], sys.argv[2:]
    updates: list[dict] = []
    ppo_update = PPOTrainer.ppo_update

    def recorded(self, batch):
        metrics = ppo_update(self, batch)
        updates.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        return metrics

    PPOTrainer.ppo_update = recorded
    sys.argv = [script, *flags]
    trainer = runpy.run_path(script, run_name="__main__")["trainer"]
    args = trainer.args
    record = {
        "updates": updates,
        "global_step": trainer.state.global_step,
        "world": trainer.accelerator.num_processes,
        "deepspeed": bool(trainer.is_deepspeed_enabled),
        "reward_names": list(trainer.reward_func_names),
        "eos_token_id": trainer.processing_class.eos_token_id,
        "stop_token_id": trainer.sampler.stop_token_id,
        "suppressed_ids": None if trainer.sampler.suppressed_ids is None else trainer.sampler.suppressed_ids.tolist(),
        "generation_eos_token_id": trainer.sampler.generation_config.eos_token_id,
        "eval_strategy": str(getattr(args.eval_strategy, "value", args.eval_strategy)),
        "args": {name: getattr(args, name) for name in ARGS_RECORDED},
    }
    folder = os.environ["KLPPO_RUN_RECORD"]
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
