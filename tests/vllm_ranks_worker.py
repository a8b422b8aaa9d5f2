"""Worker of `tests/test_vllm.py`'s two-rank test (run by torchrun, 2 CPU ranks, gloo): each rank starts its own
colocated vLLM engine, trains 3 updates with a sync before each rollout, then samples once more and writes its
record: the largest gap between its engine's log-probs and the trainer's forward, the syncs it logged, its
coefficient and its responses.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm_ranks_worker.py <out_dir>
"""

from __future__ import annotations

import json
import os
import sys

from datasets import Dataset

from klppo import KLPPOTrainer
from klppo.models import resolve_model_path
from klppo.testing import klppo_config
from klppo.testing.bandit import PROMPT, two_token_reward


def main(out: str) -> None:
    args = klppo_config(
        output_dir=os.path.join(out, "run"),
        per_device_train_batch_size=8,
        num_ppo_epochs=1,
        max_steps=3,
        response_length=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        kl_coef=0.5,
        kl_controller="adaptive",
        kl_target=2.0,
        critic="shared",
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        temperature=1.0,
        use_vllm=True,
    )
    prompts = Dataset.from_dict({"prompt": [PROMPT] * 32})
    trainer = KLPPOTrainer(
        model=resolve_model_path("klppo:tiny-llama-vllm"),
        args=args,
        train_dataset=prompts,
        reward_funcs=two_token_reward,
    )
    trainer.train()
    rollout = trainer.rollout(trainer.prompt_batch([PROMPT] * 8))
    keep = rollout.response_mask.bool()
    rank = trainer.accelerator.process_index
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "gap": float((rollout.logp - rollout.sampling_logp).abs()[keep].max()),
        "moved": float((rollout.ref_logp - rollout.sampling_logp).abs()[keep].max()),
        "syncs": sum("time/weight_sync" in h for h in trainer.state.log_history),
        "coef": trainer.kl_controller.value,
        "responses": rollout.responses.tolist(),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    trainer.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
