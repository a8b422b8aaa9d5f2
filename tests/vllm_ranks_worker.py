"""Worker of `tests/test_vllm.py`'s two-rank tests (2 CPU ranks, gloo): each rank starts its own colocated vLLM
engine, trains 3 updates with a sync before each rollout, then samples once more and writes its record: the
largest gap between its engine's log-probs and the trainer's forward, the syncs it logged, its coefficient, its
responses, the prompts it trained on, whether its weights are sharded, the weight gathers of its syncs, and whether it
refused a rollout in which rank 1 alone had a prompt longer than the engine takes.

    accelerate launch --config_file <a DDP, FSDP2 or ZeRO-3 config> tests/vllm_ranks_worker.py <out_dir> [lora] [head] [tied]

Under FSDP without a GPU, FSDP is turned on for the CPU ranks first (`dist_trainer_worker.fsdp_on_cpu`).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

import torch
from datasets import Dataset

from dist_trainer_worker import fsdp_on_cpu, under_deepspeed, under_fsdp
from klppo import KLPPOTrainer
from klppo.models import resolve_model_path
from klppo.testing import klppo_config
from klppo.testing.bandit import PROMPT, two_token_reward


def sharded(trainer) -> bool:
    """Whether this rank holds a shard of the policy's decoder weights only (FSDP2's DTensors, ZeRO-3's partitions)."""
    weight = next(p for n, p in trainer.model.named_parameters() if "layers.0." in n and "q_proj" in n)
    return hasattr(weight, "device_mesh") or hasattr(weight, "ds_id")


def spy_on_gathers() -> dict:
    """Count the blocks the sync hands over (`_whole`: gathered where the weights are sharded, a no-op otherwise):
    how many, and how many at once at most."""
    import klppo.ppo.generation.vllm as engine_module

    whole, counts = engine_module._whole, {"open": 0, "most": 0, "entered": 0}

    @contextmanager
    def counted(module, params):
        with whole(module, params):
            counts["open"] += 1
            counts["entered"] += 1
            counts["most"] = max(counts["most"], counts["open"])
            try:
                yield
            finally:
                counts["open"] -= 1

    engine_module._whole = counted
    return counts


def main(out: str, options: list[str]) -> None:
    """`options`: `lora` (LoRA on q, v and down projections), `head` (and on the LM head), `tied` (the tied model)."""
    peft_config = None
    if "lora" in options:
        from peft import LoraConfig

        targets = ["q_proj", "v_proj", "down_proj"] + (["lm_head"] if "head" in options else [])
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    gathers = spy_on_gathers()
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
        use_cpu=not under_deepspeed(),  # DeepSpeed runs on its CPU accelerator (gloo)
        num_sample_generations=0,
        temperature=1.0,
        use_vllm=True,
    )
    seen = []  # the prompts this rank decoded in training

    def reward(prompts, completions, completion_ids=None, **kwargs):
        seen.extend(prompts)
        return two_token_reward(prompts, completions, completion_ids=completion_ids)

    # 48 distinct prompts: the 3 updates of 8 per rank take one epoch, each rank its own 24
    prompts = Dataset.from_dict({"prompt": [f"{PROMPT} {i}" for i in range(48)]})
    trainer = KLPPOTrainer(
        model=resolve_model_path("klppo:tiny-llama-vllm" + ("-tied" if "tied" in options else "")),
        args=args,
        train_dataset=prompts,
        reward_funcs=reward,
        peft_config=peft_config,
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
        "sharded": sharded(trainer),
        "prompts": sorted(set(seen)),
        "layers": trainer.model.policy.config.num_hidden_layers,
        "engine_syncs": len(trainer.sampler.sync_seconds),
        "gathers": gathers["entered"],
        "gathers_at_once": gathers["most"],
    }
    # a prompt longer than the engine takes on rank 1 alone: both ranks refuse it (neither waits for the other)
    try:
        trainer.rollout(trainer.prompt_batch([" ".join(["word"] * 40) if rank == 1 else PROMPT] * 8))
        record["refused"] = False
    except ValueError as error:
        record["refused"] = "vllm_max_model_length" in str(error)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    trainer.shutdown()


if __name__ == "__main__":
    if under_fsdp() and not torch.cuda.is_available():
        fsdp_on_cpu()
    main(sys.argv[1], sys.argv[2:])
