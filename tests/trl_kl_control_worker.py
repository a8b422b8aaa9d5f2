"""One rank of `test_trl_integration.py::test_two_processes_read_every_ranks_completions_and_hold_one_beta`
(torchrun, gloo): TRL's RLOOTrainer and GRPOTrainer with `add_kl_control`, 4 steps on the tiny model, built as that
file's single-process tests build them (torchrun puts this folder on the path). Writes, per rank and trainer, the
batches the controller was handed, beta in force at each step and after the last, and TRL's logged KL and
rewards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset

from klppo.integrations.trl import add_kl_control
from test_trl_integration import PROMPTS, make_trainer, read_batches, step_logs


def main(out: Path, model: str) -> None:
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    for kind in ("rloo", "grpo"):
        trainer = add_kl_control(
            make_trainer(kind, model, prompts, out / kind, max_steps=4, learning_rate=1e-2), kl_target=1.0
        )
        seen = read_batches(trainer)
        trainer.train()
        logs = step_logs(trainer)
        record = {
            "world": trainer.accelerator.num_processes,
            "batches": [[t.tolist() for t in batch] for batch in seen],
            "coef": [h["kl/coef"] for h in logs],
            "final_beta": float(trainer.beta),  # set after the last step
            "kl": [h["kl"] for h in logs],
            "rewards": [float(v) for v in list(trainer._logs["rewards"]["even_reward"])],
            "advantages": [float(v) for v in list(trainer._logs["advantages"])] if kind == "grpo" else [],
        }
        (out / f"{kind}_rank{trainer.accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])  # the tiny model's path, built by the test
