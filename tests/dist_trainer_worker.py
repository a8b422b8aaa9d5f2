"""Worker for the distributed trainer tests (run by `torchrun`, or by `python` as one process).

    python tests/dist_trainer_worker.py update <rollout.pt> <out_dir> <grad_accum>
        One PPO optimisation pass on a saved rollout: each rank takes its contiguous slice of the rows.
        Writes the KL statistic, the coefficient before/after, and (rank 0) the parameter deltas.
    python tests/dist_trainer_worker.py train <out_dir>
        A few real PPO updates with the equilibrium controller; every rank writes its coefficient trajectory.
    python tests/dist_trainer_worker.py engine <rollout.pt> <out_dir> [<seed> <stop_token_id>]
        Under any engine (torchrun for DDP, `accelerate launch` for DeepSpeed and FSDP2): one PPO update of 2
        mini-batches x gradient accumulation 2 on a saved rollout, with SGD. Writes the optimizer steps taken, the
        coefficient and (rank 0) every trainable weight before and after the update, gathered in full. With a seed
        and a stop token, first each rank samples its own prompt from the seed (`sample_alone`) and the trainer
        evaluates one prompt (`EVAL_PROMPTS`): the tokens, log-probs and evaluation are written too.
    python tests/dist_trainer_worker.py tied <out_dir>
        Full fine-tuning of the tied tiny model, 2 updates: is the LM head still the embedding after them?
    python tests/dist_trainer_worker.py cli <scripts/train.py arguments>
        `scripts/train.py`, under whatever launched the worker.

Under `ACCELERATE_USE_FSDP=true` (`accelerate launch` with an FSDP config) without a GPU, FSDP is turned on for the
CPU ranks first (`fsdp_on_cpu`).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset

from klppo import KLPPOTrainer
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.ppo.distributed import is_fsdp2
from klppo.testing import klppo_config


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def token_reward(prompts, completions, completion_ids=None, **kwargs):
    """Varies between sequences even when every response runs to full length (the equilibrium controller leaves
    beta where it is on a batch whose scores are all equal)."""
    return [float(sum(ids) % 7) / 7.0 for ids in completion_ids]


PROMPTS = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 4})


def under_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def under_fsdp() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_on_cpu() -> None:
    """Let accelerate run FSDP on CPU ranks. `AcceleratorState` turns FSDP on (distributed type FSDP, with the
    plugin) only for the device types of GPUs and other accelerators; on CPU ranks (`use_cpu`: MULTI_CPU, gloo) it
    leaves the plugin out and runs DDP. This does for MULTI_CPU what it does for those, once, when the Trainer's
    `Accelerator` creates the state: everything after it (the Trainer's `is_fsdp_enabled`, `prepare`'s
    `fsdp2_prepare_model`, `fully_shard` on a CPU mesh) is accelerate's and klppo's own code. Test-only: a GPU run
    needs none of it."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        fresh = not AcceleratorState._shared_state
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fresh and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self.mixed_precision)
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = __init__


def make_trainer(
    out_dir: str, reward=length_reward, eval_dataset=None, model: str = TINY_MODEL, **overrides
) -> KLPPOTrainer:
    args = dict(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_ppo_epochs=1,
        num_mini_batches=1,
        max_steps=3,
        response_length=6,
        learning_rate=0.5,
        optim="sgd",
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not under_deepspeed(),  # DeepSpeed runs on its CPU accelerator (gloo)
        seed=0,
        kl_controller="adaptive",
        kl_coef=0.1,
        kl_target=1e-3,
        kl_target_unit="token",
        kl_controller_kwargs={"horizon": 4},
        kl_mode="both",
        kl_estimator="k1",
        num_sample_generations=0,
    )
    args.update(overrides)
    return KLPPOTrainer(
        model=resolve_model_path(model),
        args=klppo_config(**args),
        reward_funcs=reward,
        train_dataset=PROMPTS,
        eval_dataset=eval_dataset,
    )


def rank_share(rollout_path: str, acc):
    """This rank's contiguous slice of a saved `(rollout, rewards)`."""
    full_rollout, full_rewards = torch.load(rollout_path, weights_only=False)
    per_rank = full_rollout.batch_size // acc.num_processes
    rows = slice(acc.process_index * per_rank, (acc.process_index + 1) * per_rank)
    return full_rollout.select(rows), full_rewards.select(rows)


def run_update(rollout_path: str, out_dir: str, grad_accum: int) -> dict:
    trainer = make_trainer(out_dir, gradient_accumulation_steps=grad_accum)
    acc = trainer.accelerator
    rollout, rewards = rank_share(rollout_path, acc)
    trainer.setup_optimisation(num_updates=1)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    coef_before = trainer.kl_controller.value
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    metrics = penalty.metrics
    trainer.optimise(rollout, trainer.compute_advantages(rollout, rewards, penalty))
    deltas = {name: (p.detach() - before[name]) for name, p in trainer.model.named_parameters() if name in before}
    result = {
        "rank": acc.process_index,
        "world": acc.num_processes,
        "tokens": int(rollout.response_mask.sum()),
        "kl_value": metrics["kl/value"],
        "coef_before": coef_before,
        "coef_after": trainer.kl_controller.value,
    }
    with open(os.path.join(out_dir, f"update_rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    if acc.is_main_process:
        torch.save(deltas, os.path.join(out_dir, f"deltas_world{acc.num_processes}.pt"))
    trainer.shutdown()
    return result


def run_train(out_dir: str) -> None:
    # the equilibrium controller reads every rank's sequences (gathered in rank order): both ranks must agree
    trainer = make_trainer(
        out_dir,
        reward=token_reward,
        kl_mode="reward",
        kl_target=0.5,
        kl_target_unit="sequence",
        kl_controller="equilibrium",
        kl_controller_kwargs={},
    )
    trainer.train()
    coefs = [h["kl/coef"] for h in trainer.state.log_history if "kl/coef" in h] + [trainer.kl_controller.value]
    values = [h["kl/value"] for h in trainer.state.log_history if "kl/value" in h]
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"train_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "coefs": coefs, "kl": values}, f)
    trainer.shutdown()


def run_tied(out_dir: str) -> None:
    """Full fine-tuning of a tiny Llama whose LM head is its embedding, 2 updates: writes, per rank, whether the head
    is still the embedding's parameter and how far the embedding moved."""
    from klppo.ppo.distributed import root_unsharded

    trainer = make_trainer(out_dir, model="klppo:tiny-llama-vllm-tied", max_steps=2)
    policy = trainer.model.policy
    before = policy.get_input_embeddings().weight.detach().clone()
    trainer.train()
    with root_unsharded(trainer.model_wrapped):
        head, embedding = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
        record = {"tied": head is embedding, "moved": float((embedding.detach() - before).abs().max())}
    with open(os.path.join(out_dir, f"tied_rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    trainer.shutdown()


def run_warmup(out_dir: str, critic: str) -> None:
    """Two critic warm-up updates then one PPO update, each of 2 mini-batches, under DDP or FSDP2: the policy's
    weights take no part in the warm-up's losses. Writes, per rank, whether the policy held still through the warm-up
    (AdamW with weight decay, which moves any weight it steps) with no optimizer state, and moved after it, whether
    the critic moved, and a checksum of every weight."""
    from transformers import TrainerCallback

    trainer = make_trainer(
        out_dir,
        critic=critic,
        critic_warmup_steps=2,
        num_mini_batches=2,
        per_device_train_batch_size=1,
        optim="adamw_torch",
        learning_rate=1e-2,
        weight_decay=0.1,
    )
    policy = trainer.model.policy

    def full(named):  # an FSDP2 weight is a DTensor: `full_tensor` gathers it (every rank calls it)
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named}

    def critic_named():
        return [(n, p) for n, p in trainer.model.named_parameters() if not n.startswith("policy.")]

    start, critic_start = full(policy.named_parameters()), full(critic_named())
    seen = {}

    class AfterWarmup(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                now, critic_now = full(policy.named_parameters()), full(critic_named())
                seen["policy_held"] = all(torch.equal(now[n], start[n]) for n in start)
                seen["critic_moved"] = any(not torch.equal(critic_now[n], critic_start[n]) for n in critic_start)
                held = {id(p) for p in trainer.optimizer.optimizer.state}
                seen["policy_without_optimizer_state"] = not any(id(p) in held for p in policy.parameters())

    trainer.add_callback(AfterWarmup())
    trainer.train()
    end = full(trainer.model.named_parameters())
    seen["policy_moved_after"] = any(not torch.equal(end[f"policy.{n}"], start[n]) for n in start)
    seen["checksum"] = float(sum(t.double().abs().sum() for t in end.values()))
    seen["world"], seen["find_unused"] = trainer.accelerator.num_processes, trainer.args.ddp_find_unused_parameters
    with open(os.path.join(out_dir, f"warmup_rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(seen, f)
    trainer.shutdown()


def count_optimizer_steps() -> dict[int, int]:
    """Steps per parameter tensor, counted from every optimizer's `step` (DeepSpeed's ZeRO-1/2 optimizer steps its
    inner optimizer once per parameter group): the number of optimizer steps is the largest count."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    counts: dict[int, int] = {}

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                counts[id(p)] = counts.get(id(p), 0) + 1

    register_optimizer_step_post_hook(hook)
    return counts


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every trainable weight of the actor-critic, gathered in full under ZeRO-3 and FSDP2."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if hasattr(params[0][1], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    # an FSDP2 weight is a DTensor: `full_tensor` gathers its shards (a collective: every rank calls it)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params}


# one evaluation prompt: fewer than ranks, so that the ranks hold different numbers of them
EVAL_PROMPTS = Dataset.from_dict({"prompt": PROMPTS["prompt"][:1]})


def engine_trainer(out_dir: str, stop_token_id: int | None = None) -> KLPPOTrainer:
    """The `engine` mode's trainer: 2 mini-batches x gradient accumulation 2 of one sequence, SGD; `EVAL_PROMPTS`
    and 2 held-out texts for an evaluation; the stop token `stop_token_id` (default: end of sequence)."""
    from klppo.models import load_tokenizer

    stop = (
        "eos"
        if stop_token_id is None
        else load_tokenizer(resolve_model_path(TINY_MODEL)).convert_ids_to_tokens(stop_token_id)
    )
    return make_trainer(
        out_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        learning_rate=0.05,
        kl_mode="reward",
        nonfinite_rollback=False,
        stop_token=stop,
        eval_dataset=EVAL_PROMPTS,
        heldout_eval_texts=2,
    )


def sample_alone(trainer, rank: int, seed: int):
    """The rollout of rank `rank`'s prompt (row `rank` of PROMPTS), sampled from `seed`."""
    torch.manual_seed(seed)
    return trainer.rollout(trainer.prompt_batch([PROMPTS["prompt"][rank]]))


def run_engine_update(
    rollout_path: str, out_dir: str, seed: int | None = None, stop_token_id: int | None = None
) -> None:
    counts = count_optimizer_steps()
    trainer = engine_trainer(out_dir, stop_token_id)
    acc = trainer.accelerator
    rank = acc.process_index
    rollout, rewards = rank_share(rollout_path, acc)
    trainer.setup_optimisation(num_updates=1)
    record = {
        "world": acc.num_processes,
        "deepspeed": trainer.is_deepspeed_enabled,
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "fsdp2": is_fsdp2(trainer.model_wrapped),
    }
    if seed is not None:  # first each rank samples its own prompt, then an evaluation; neither changes the update
        scoring_models, score = [], trainer.scorer.score
        # a rollout that raises inside the generation context (under ZeRO-3: on gathered weights, hooks off) leaves
        # the engine as it was: scoring through it afterwards gives what it gave before
        before_failure = trainer.score(rollout.sequences())

        def failing(*args, **kwargs):
            raise RuntimeError("scoring failed")

        trainer.scorer.score = failing
        try:
            trainer.rollout(trainer.prompt_batch([PROMPTS["prompt"][rank]]))
        except RuntimeError as failure:
            record["failed_rollout"] = str(failure)
        trainer.scorer.score = score
        after_failure = trainer.score(rollout.sequences())
        record["after_failed_rollout_difference"] = max(
            float((getattr(before_failure, k) - getattr(after_failure, k)).abs().max())
            for k in ("logp", "ref_logp", "values")
        )
        trainer.scorer.score = lambda model, *a, **k: (
            scoring_models.append(type(model).__name__) or score(model, *a, **k)
        )
        sampled = sample_alone(trainer, rank, seed)
        trainer.scorer.score = score
        record["rollout_scored_with"] = scoring_models
        record["sampled"] = {
            "responses": sampled.responses.tolist(),
            "response_mask": sampled.response_mask.tolist(),
            "logp": sampled.logp.tolist(),
            "ref_logp": sampled.ref_logp.tolist(),
        }
        rescored = trainer.score(sampled.sequences())  # scored through the wrapped model, not as the rollout scored
        record["rescored_difference"] = {
            k: float((getattr(sampled, k) - getattr(rescored, k)).abs().max()) for k in ("logp", "ref_logp", "values")
        }
        record["eval"] = trainer.evaluate_policy()
        record["steps_sampling"] = len(counts)
    before = full_weights(trainer)
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    torch.manual_seed(1)  # the same mini-batch order under every engine
    result = trainer.optimise(rollout, trainer.compute_advantages(rollout, rewards, penalty))
    after = full_weights(trainer)
    record.update(
        steps=max(counts.values()),
        applied=result.applied_steps,
        kl_value=penalty.metrics["kl/value"],
        coef_after=trainer.kl_controller.value,
    )
    with open(os.path.join(out_dir, f"engine_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if acc.is_main_process:
        torch.save({n: (before[n], after[n]) for n in before}, os.path.join(out_dir, "weights.pt"))
    trainer.shutdown()


def run_cli(argv: list[str]) -> int:
    """`scripts/train.py` with `argv`."""
    from klppo.cli import cli

    return cli(argv)


if __name__ == "__main__":
    if under_fsdp() and not torch.cuda.is_available():
        fsdp_on_cpu()
    mode = sys.argv[1]
    if mode == "update":
        run_update(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "train":
        run_train(sys.argv[2])
    elif mode == "tied":
        run_tied(sys.argv[2])
    elif mode == "warmup":
        run_warmup(sys.argv[2], sys.argv[3])
    elif mode == "engine":
        run_engine_update(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:6]))
    elif mode == "cli":
        sys.exit(run_cli(sys.argv[2:]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: use 'update', 'train', 'tied', 'warmup', 'engine' or 'cli'")
