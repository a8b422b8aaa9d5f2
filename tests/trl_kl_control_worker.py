"""One rank of `test_trl_integration.py::test_two_processes_read_every_ranks_completions_and_hold_one_beta`
(torchrun, gloo): TRL's RLOOTrainer and GRPOTrainer with `add_kl_control`, 4 steps on the tiny model. Writes, per
rank and trainer, the batches the controller was handed, beta in force at each step and after the last, and TRL's
logged KL and rewards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from klppo.integrations.trl import add_kl_control


def even_reward(prompts, completions, completion_ids=None, **kwargs):
    return [sum(i % 2 == 0 for i in ids) / max(1, len(ids)) for ids in completion_ids]


def main(out: Path, model: str) -> None:
    prompts = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 4})
    for kind, config_cls, trainer_cls in (("rloo", RLOOConfig, RLOOTrainer), ("grpo", GRPOConfig, GRPOTrainer)):
        args = config_cls(
            output_dir=str(out / kind), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
            max_steps=4, logging_steps=1, report_to="none", beta=0.05, learning_rate=1e-2, use_cpu=True,
            save_strategy="no", seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_cls(model=model, reward_funcs=even_reward, args=args,
                              train_dataset=prompts)  # fmt: skip
        add_kl_control(trainer, kl_target=1.0)
        seen, observe = [], trainer.kl_control.controller.observe_sequences
        trainer.kl_control.controller.observe_sequences = lambda *a, **k: (seen.append(a), observe(*a, **k))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "kl/coef" in h]
        record = {
            "world": trainer.accelerator.num_processes,
            "batches": [[t.tolist() for t in batch] for batch in seen],
            "coef": [h["kl/coef"] for h in logs],
            "final_beta": float(trainer.beta),  # set after the last step
            "kl": [h["kl"] for h in logs],
            "rewards": [float(v) for v in list(trainer._logs["rewards"]["even_reward"])],
            "advantages": [float(v) for v in list(trainer._logs["advantages"])] if kind == "grpo" else [],
        }
        rank = trainer.accelerator.process_index
        (out / f"{kind}_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])  # the tiny model's path, built by the test
