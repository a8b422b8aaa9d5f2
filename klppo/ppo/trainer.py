"""`KLPPOTrainer`: PPO for causal LMs with KL control, on transformers' `Trainer` and accelerate.

One PPO update (`ppo_update`), each step a public method that returns a typed result (`klppo.ppo.results`):

0. draw a batch of prompts (`_train`, the endless prompt loader)   `prompt_batch`       -> `PromptBatch`
1. sample responses (a `GenerationEngine`, `generation/`)         `rollout`
2. truncate at the stop token, build masks                         `rollout`
3. score: policy / reference log-probs, values, and every KL       `rollout`            -> `Rollout` (`scoring/`)
   estimate (the configured one, the statistic, k1-k3 logged)
4. rewards, missing-EOS penalty                                    `compute_rewards`    -> `Rewards`
5. the KL penalty: in reward mode beta times step 3's estimate     `apply_kl`           -> `KLPenalty`
   charged to each token's reward; the statistic reduced across ranks
6. the controller's step on the globally reduced statistic         `update_controller`  (serves the next update)
7. advantages (GAE, or critic-free RLOO / GRPO), whitening         `compute_advantages` -> `Advantages`
8. PPO epochs over mini-batches; each micro-batch's loss           `optimise`           -> `OptimiseResult`
   (`micro_batch_loss`), and beside it the step's checks
   (`StepChecks`, `safety/step_checks.py`: non-finite loss, the KL guard)
9. log, evaluate, checkpoint                                       `_train` -> `_log_evaluate_save`

Steps 4-7 and step 8's loss are functions of what they read, in `update.py`; step 8's loop over epochs and
mini-batches (`optimise`) and step 6's gate (the controller keeps still while the critic warms up) stay in the
trainer, which owns the optimizer and the run's state. Every KL decision they follow (the estimator and where
it acts, the statistic and its unit, the loss term's weight and baseline, the guard, the target) is decided once
when the trainer is built (`self.kl_plan`, `plan.py`). What an update leaves for the next ones (the controller, the
guard, the monitors, the update no rollout has checked yet, the reference resets and the reference before the
first) is one object, `self.run` (`RunState`, `run/state.py`), saved in every checkpoint. Every statistic is reduced
across ranks as `(sum, count)` (`klppo.kl.GlobalSums`), so each rank logs, and the controller sees, the same global
value.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from contextlib import ExitStack, nullcontext
from dataclasses import replace
from functools import partial

import torch
from torch.profiler import record_function
from transformers import PreTrainedTokenizerBase, Trainer, set_seed
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from ..kl import (
    GlobalSums,
    reduce_sum_count,
)
from . import update
from .build import (
    as_prompt_dataset,
    build_models,
    check_trainer_inputs,
    enable_activation_checkpointing,
    load_policy_and_tokenizer,
    load_rewards,
    prepare_frozen_models,
)
from .config import KLPPOConfig
from .distributed import backward, destroy_process_group_at_exit, is_fsdp2, optimizer_step, root_unsharded, unwrap
from .generation import make_engine
from .generation.correction import correct_rollout, weight_advantages
from .generation.sampling import DIVERGED_SAMPLING, eos_scored_as_any_token
from .plan import make_kl_plan
from .prompts import collate_prompts, endless_prompt_batches
from .results import Advantages, KLPenalty, OptimiseResult, PromptBatch, Rewards, Rollout, Sequences
from .run import checkpoint as ckpt
from .run.callbacks import KLProgressCallback, now, offline_wandb, timed
from .run.heap import decoding_heap
from .run.preemption import StopRequest
from .run.reference_resets import (
    check_reference_resets,
    clear_optimizer_state,
    kl_to_initial,
    reference_tensors,
    reset_reference,
)
from .run.state import RunState
from .safety.kl_guard import LOWER, UPPER, reset_momentum
from .safety.nonfinite import TrainingDiverged, rollout_outputs_finite
from .safety.rollback import snapshot_optimisation
from .safety.step_checks import APPLIED, NONFINITE, StepChecks
from .scoring.scorer import RolloutScorer

logger = logging.getLogger(__name__)


class KLPPOTrainer(Trainer):
    """PPO trainer for causal LMs whose centre is KL control.

    Args:
        model: a causal LM (`PreTrainedModel`) or its path / hub id.
        args: a [`KLPPOConfig`].
        processing_class: the tokenizer (loaded from `model` when it is a path and this is None).
        reward_funcs: one or several of: a callable with TRL's signature
            `fn(prompts, completions, completion_ids=None, **kwargs) -> list[float]`, a sequence-classification
            model, or a path / hub id of one. Weighted by `args.reward_weights`.
        train_dataset: prompts, in a `prompt` column (plain text or conversational messages).
        eval_dataset: optional held-out prompts: `eval/scores` is their mean reward at `eval_steps`.
        ref_model: the frozen reference. None: the policy with its adapter disabled when `peft_config` is
            given (no second copy in memory), else a frozen copy of the initial policy.
        value_model: a critic model for `critic="separate"` (default: built per `args.critic_init`).
        peft_config: a `peft.PeftConfig`; the policy is wrapped with `get_peft_model`.
        callbacks: extra `TrainerCallback`s.
        heldout_texts: texts for `eval/perplexity` (default: klppo's offline held-out set).

    Building it seeds the global random generators (Python's, numpy's, torch's) with `args.seed`, as transformers'
    `Trainer` does when it is built, and earlier, so that the value heads and model copies made before
    `Trainer.__init__` are the same run after run. It changes neither the process's environment nor the objects
    passed in (a tokenizer that needs a pad token or left padding is copied first). Building it is collective under
    several processes (every rank builds it): it decides there, once, whether updates are rolled back
    (`decide_rollback_on_all_ranks`).
    """

    _tag_names = ["klppo", "ppo"]

    def __init__(
        self,
        model,
        args: KLPPOConfig | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_funcs=None,
        train_dataset=None,
        eval_dataset=None,
        ref_model=None,
        value_model=None,
        peft_config=None,
        callbacks=None,
        heldout_texts: list[str] | None = None,
    ):
        train_dataset, eval_dataset = as_prompt_dataset(train_dataset), as_prompt_dataset(eval_dataset)
        args = check_trainer_inputs(args, train_dataset, reward_funcs, eval_dataset)
        set_seed(args.seed)  # value heads and copies are created below, before Trainer seeds (see the docstring)
        given_path = model if isinstance(model, str) else None
        model, _, processing_class = load_policy_and_tokenizer(model, processing_class)
        self.reward_funcs, self.reward_weights, self.reward_func_names = load_rewards(
            reward_funcs, args, processing_class
        )
        args = args.for_model(lora=peft_config is not None or hasattr(model, "peft_config"))
        actor_critic, self.ref_model, self.use_adapter_reference, self.ref_adapter_name = build_models(
            model,
            given_path,
            args,
            ref_model,
            value_model,
            peft_config,
            self.reward_funcs,
            ref_adapter_name=getattr(args, "ref_adapter_name", None),
        )
        self.checkpointing_kwargs = enable_activation_checkpointing(actor_critic, args)  # kept for after decoding
        self.heldout_texts, self.eval_prompts = heldout_texts, eval_dataset
        # Trainer insists on an eval_dataset when eval_strategy is set; evaluation here is held-out perplexity
        # (+ eval prompts when given), so a one-row placeholder satisfies that check.
        placeholder = train_dataset.select(range(1)) if args.eval_strategy != "no" else None
        super().__init__(
            model=actor_critic,
            args=args,
            data_collator=lambda features: features,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset if eval_dataset is not None else placeholder,
            processing_class=processing_class,
            callbacks=callbacks,
        )
        self._build_update_parts(self.model.policy)
        self.completion_samples: list[dict] = []
        self.stop_request = StopRequest.for_trainer(self)  # SIGTERM while training (`checkpoint_on_sigterm`)
        self.stopped_by_signal: int | None = None  # the update a SIGTERM stopped the run after
        self._last_saved_step: int | None = None
        if args.ref_reset_steps:
            check_reference_resets(
                self.is_fsdp_enabled,
                self.model.policy,
                self.ref_model,
                self.use_adapter_reference,
                self.ref_adapter_name,
            )
        self.decide_rollback_on_all_ranks()
        logger.info("%s; controller %s", self.kl_plan.describe(), self.kl_controller.name)

    def _build_update_parts(self, policy) -> None:
        """After Trainer's own setup: the progress bar, the frozen models prepared beside the policy, and the parts of
        an update decided once: the generation engine (`make_engine`), the KL plan (`make_kl_plan`), the
        scorer (`RolloutScorer`) and the state that lives across updates (`RunState`)."""
        args = self.args
        self.remove_callback(ProgressCallback)
        if self.accelerator.num_processes > 1:
            destroy_process_group_at_exit()
        if not args.disable_tqdm:
            self.add_callback(KLProgressCallback())
        self.ref_model = prepare_frozen_models(
            self.ref_model,
            self.reward_funcs,
            self.accelerator,
            deepspeed=self.is_deepspeed_enabled,
            fsdp=self.is_fsdp_enabled,
        )
        engine = "deepspeed" if self.is_deepspeed_enabled else "fsdp" if self.is_fsdp_enabled else None
        # the generation engine (`klppo.ppo.generation`): the trainer asks it for sequences and syncs its weights
        self.sampler = make_engine(
            args,
            self.accelerator,
            self.processing_class,
            policy,
            engine,
            self.checkpointing_kwargs,
            (self.train_dataset, self.eval_prompts),
        )
        try:  # a check below that refuses the run frees the engine (a vLLM engine holds memory and a process group)
            self.kl_plan = make_kl_plan(
                args,
                policy,
                self._mixed_precision(),
                self._vocab_size(policy),
                compiled_decoding=self.sampler.compiled,
                decode_reads=self.sampler.reads_while_decoding,
            )
            self.scorer = RolloutScorer(
                self.kl_plan,
                self.accelerator,
                self.ref_model,
                self.use_adapter_reference,
                self.ref_adapter_name,
                args.temperature,
                self.sampler.suppressed_ids,
                args.rollout_forward_batch_size,
                args.critic_free,
                args.experimental.logits_block_mb,
            )
            # what one update leaves for the next: the KL controller, the guard, the monitors, the non-finite path
            self.run = RunState.build(args, self.kl_plan, self.accelerator, log=self.is_world_process_zero())
        except BaseException:
            self.sampler.shutdown()
            raise

    @property
    def kl_controller(self):
        """The live KL controller (`RunState.controller`)."""
        return self.run.controller

    @property
    def kl_guard(self):
        """The KL guard (`RunState.guard`)."""
        return self.run.guard

    @property
    def reference_resets(self) -> int:
        """Reference resets so far (`ref_reset_steps`)."""
        return self.run.reference_resets

    def _mixed_precision(self) -> bool:
        """Whether the arguments or accelerate (`mixed_precision` in an accelerate config file) set mixed precision."""
        return bool(self.args.bf16 or self.args.fp16 or self.accelerator.mixed_precision != "no")

    @staticmethod
    def _vocab_size(policy) -> int:
        config = policy.config
        return (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size

    @property
    def critic_warming_up(self) -> bool:
        """Whether this update trains the critic alone (`critic_warmup_steps`)."""
        return self.state.global_step < self.args.critic_warmup_steps

    @property
    def logprobs_from_generation(self) -> bool:
        """Whether the sampling policy's log-probs are read while decoding (`KLPlan.read_while_decoding`)."""
        return self.kl_plan.read_while_decoding

    # ------------------------------------------------------------------ data
    def prompt_batch(self, prompts: list) -> PromptBatch:
        """Prompts (strings or conversations) or dataset rows (dicts with a `prompt` key) as one batch."""
        rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
        return collate_prompts(rows, self.processing_class, self.args.max_prompt_length)

    # ------------------------------------------------------------------ the loop (step 9)
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Run the PPO updates. One run per `output_dir`: a second run on the same folder stops at once
        (`OutputDirInUse`). `resume_from_checkpoint`: a checkpoint folder, or True for the latest complete one."""
        from .run.lock import OutputDirLock

        if self.state.global_step and not resume_from_checkpoint:
            raise RuntimeError(
                f"This trainer has already run {self.state.global_step} PPO updates, and its learning-rate schedule "
                "was made for them: `train()` does not start over or extend a run. To train on from the trained "
                "weights, build a new KLPPOTrainer from `trainer.model`; to extend the run, build one with a larger "
                "`max_steps` and `resume_from_checkpoint=True`."
            )
        if self.args.experimental.checkpoint_on_sigterm:
            self.stop_request.install()
        try:
            with OutputDirLock(self.args.output_dir, enabled=self.is_world_process_zero() and self.args.should_save):
                return self._train(resume_from_checkpoint)
        finally:
            self.stop_request.uninstall()

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        args = self.args
        self.is_in_train = True
        num_updates = self.num_updates()
        self.setup_optimisation(num_updates)
        self.state.max_steps = num_updates
        self.state.num_train_epochs = math.ceil(num_updates * self._prompts_per_update() / len(self.train_dataset))
        self.state.compute_steps(args, num_updates)
        self.state.is_local_process_zero, self.state.is_world_process_zero = (
            self.is_local_process_zero(),
            self.is_world_process_zero(),
        )
        checkpoint = ckpt.resolve_resume_target(resume_from_checkpoint, args.output_dir)
        if checkpoint:
            self._resume(checkpoint)
        generations = args.num_generations or 1  # each prompt's responses in consecutive rows, on this rank
        batches = endless_prompt_batches(
            self.train_dataset,
            args.local_prompts_per_rollout,
            lambda rows: self.prompt_batch([row for row in rows for _ in range(generations)]),
            self.accelerator,
            args.seed,
            skip=self.state.global_step,
        )
        with offline_wandb(args):  # wandb starts its run here: offline without credentials, the environment kept
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time, metrics = time.time(), {}
        while self.state.global_step < num_updates:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            metrics = self.ppo_update(next(batches))
            self.state.global_step += 1
            self.state.epoch = self.state.global_step * self._prompts_per_update() / len(self.train_dataset)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_evaluate_save(metrics)
            if self.stop_request.agreed(self.accelerator):  # one collective per update: all ranks stop here
                self._stop_on_signal(num_updates)
                break
            if self.control.should_training_stop:
                break
        self._settle_last_update()  # the last update's policy, checked before anything samples from or saves it
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(
            self.state.global_step,
            metrics.get("loss/policy", float("nan")),
            {"train_runtime": time.time() - start_time},
        )

    def _stop_on_signal(self, num_updates: int) -> None:
        """A SIGTERM reached a rank: save this update's checkpoint (unless one was just written) through the usual
        atomic save, and mark the run as stopped."""
        step = self.state.global_step
        if self._last_saved_step != step:
            self._save_checkpoint(self.model, trial=None)
        self.stopped_by_signal = step
        self.control.should_training_stop = True
        if self.is_world_process_zero():
            logger.warning(
                "SIGTERM: the run stopped after update %d of %d and saved %s. Resume with --resume_from_checkpoint true "
                "(Python: train(resume_from_checkpoint=True)).",
                step,
                num_updates,
                os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"),
            )

    def _prompts_per_update(self) -> int:
        """Prompts per update, all ranks (each sampled `num_generations` times)."""
        return self.args.local_prompts_per_rollout * self.accelerator.num_processes

    def _log_evaluate_save(self, metrics: dict) -> None:
        if self.control.should_evaluate or self.control.should_save:  # check the policy before using it
            metrics = {**metrics, **(self._settle_last_update() or {})}
        if self.control.should_log:
            self.log(dict(metrics))
        if self.control.should_evaluate:
            self.log(self.evaluate_policy())
            self.control.should_evaluate = False
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def num_updates(self) -> int:
        """PPO updates of a whole run: `max_steps`, else `num_train_epochs` over the prompts."""
        return self.args.num_updates(len(self.train_dataset), self.accelerator.num_processes)

    def setup_optimisation(self, num_updates: int | None = None) -> None:
        """Create the optimizer and scheduler and wrap the actor-critic for distributed training (once; sampling
        and evaluation before `train()` call it too, since a ZeRO-3 or FSDP policy only runs inside its engine).
        The scheduler is not handed to accelerate: it steps once per optimizer step, on every rank."""
        args = self.args
        if self.optimizer is None:
            num_updates = self.num_updates() if num_updates is None else num_updates
            self.create_optimizer_and_scheduler(
                num_training_steps=num_updates * args.num_ppo_epochs * args.num_mini_batches
            )
            # checkpoints hold every trainable weight in full: ZeRO-3 gathers them when saving, FSDP saves a full
            # state dict (a sharded one would bypass klppo's checkpoint files)
            if self.is_deepspeed_enabled:
                zero = self.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("zero_optimization", {})
                zero["stage3_gather_16bit_weights_on_model_save"] = True
            if self.is_fsdp_enabled:
                self.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
            self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
            if self.is_deepspeed_enabled:
                self.deepspeed = self.model_wrapped

    def shutdown(self) -> None:
        """End a (distributed) run cleanly; call it last. Waits for every rank, drops the data-parallel
        wrapper (it holds the process group: left to interpreter exit, gloo can abort the process), finishes
        trackers and destroys the process group. The unwrapped models (`trainer.model`) stay usable."""
        acc = self.accelerator
        acc.wait_for_everyone()
        self.model_wrapped = self.model
        self.optimizer = self.lr_scheduler = None
        acc.free_memory()  # DeepSpeed's engine reads the process group as it is destroyed
        self.sampler.shutdown()  # a vLLM engine frees its memory, its process groups, and the default one if it made it
        acc.end_training()
        if "wandb" in (self.args.report_to or []):  # transformers' wandb callback leaves its run open: a next run
            import wandb  # in the same process would log into it

            if wandb.run is not None:
                wandb.finish()

    # ------------------------------------------------------------------ one update
    def ppo_update(self, batch: PromptBatch) -> dict[str, float]:
        """One PPO update on a batch of prompts; returns its logged metrics."""
        timings: dict[str, float] = defaultdict(float)
        acc = self.accelerator
        lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self.args.learning_rate
        start = now(acc)
        steps = self.args.ref_reset_steps
        if steps and self.state.global_step and self.state.global_step % steps == 0:
            self.reset_reference()
        rollout = self.rollout(batch, timings)  # steps 1-3
        undone = self._settle_last_update(rollout)
        if undone:  # the last update left non-finite outputs and was undone: sample again from the policy before it
            rollout = self.rollout(batch, timings)
        initial = self._kl_to_initial(rollout, timings) if self.run.initial_reference is not None else {}
        with timed(timings, "time/reward", acc):
            rewards = self.compute_rewards(rollout)  # step 4
        with timed(timings, "time/kl", acc):
            penalty = self.apply_kl(rollout, rewards)  # step 5
            controller = self.update_controller(rollout, rewards, penalty)  # step 6
        metrics = {
            **rewards.metrics,
            **penalty.metrics,
            **controller,
            **(undone or {}),
            **initial,
            **getattr(rollout, "sampling_metrics", {}),
        }
        if self.args.critic_warmup_steps:
            metrics["train/critic_warmup"] = float(self.critic_warming_up)
        if steps:
            metrics["kl/reference_resets"] = float(self.reference_resets)
        if not penalty.finite:
            metrics.update(
                self.run.safety.record(
                    self.state.global_step + 1, "rollout scores or KL", "no optimizer step was taken", self.optimizer
                )
            )
        else:
            with timed(timings, "time/advantages", acc):
                advantages = self.compute_advantages(rollout, rewards, penalty)  # step 7
            snapshot = None
            if self.rollback_updates:
                with timed(timings, "time/rollback_snapshot", acc):
                    snapshot = snapshot_optimisation(unwrap(acc, self.model_wrapped), self.optimizer, self.lr_scheduler)
            with timed(timings, "time/optimise", acc):
                result = self.optimise(rollout, advantages, kl_reading=penalty.reading)  # step 8
            metrics.update(result.metrics, **advantages.metrics)
            metrics.update(
                self.run.safety.after_optimise(
                    self.state.global_step + 1,
                    result,
                    snapshot,
                    unwrap(acc, self.model_wrapped),
                    self.optimizer,
                    self.lr_scheduler,
                )
            )
            self.run.safety.checked_rows = rollout.sequences()  # what a check before a save feeds this update's policy
        timings["time/update"] = now(acc) - start
        metrics.update(timings, **{"train/nonfinite_skips": float(self.nonfinite_skips), "lr": lr})
        for message in self.run.health.update(metrics):
            if self.is_world_process_zero():
                logger.warning(message)
        self._record_samples(rollout.prompts, rewards)
        return metrics

    # ------------------------------------------------------------------ steps 1-3: rollout
    @torch.no_grad()
    def rollout(self, batch: PromptBatch, timings: dict | None = None) -> Rollout:
        """Steps 1-3: sample responses, truncate them at the stop token, score them (`RolloutScorer`). What the
        plan reads while decoding (the sampled tokens' log-probs, a shared critic's values, the logits a statistic
        reads) comes from generation; scoring runs the rest."""
        timings = timings if timings is not None else defaultdict(float)
        acc, engine = self.accelerator, self.sampler
        batch = replace(
            batch, input_ids=batch.input_ids.to(acc.device), attention_mask=batch.attention_mask.to(acc.device)
        )
        if engine.holds_weights:  # the engine decodes from its own copy: the policy's weights now, every rollout
            with timed(timings, "time/weight_sync", acc):
                engine.sync_weights(self.model_wrapped)
        with ExitStack() as generation_context:
            with timed(timings, "time/generation", acc):
                # the model to score with: under ZeRO-3 the one gathered for generation (one gather per rollout)
                model = generation_context.enter_context(engine.generating(self.model_wrapped))
                with decoding_heap():  # a CPU run's heap as decoding needs it, where the command fixed it
                    sampled = engine.generate(batch, self.kl_plan)
            rollout = self.scorer.score(model, sampled.sequences, sampled.generated, timings)
            with timed(timings, "time/generation", acc):  # ZeRO-3 partitions the weights again
                generation_context.close()
        x = self.args.experimental  # an inexact engine's drift, measured and corrected (`generation/correction.py`)
        return correct_rollout(
            rollout,
            x.vllm_importance_sampling_correction,
            x.vllm_importance_sampling_mode,
            x.vllm_importance_sampling_clip_max,
            acc,
        )

    def score(self, sequences: Sequences, timings: dict | None = None) -> Rollout:
        """Step 3 alone: the `Rollout` of `sequences` from forward passes only (nothing read while decoding)."""
        return self.scorer.score(self.model_wrapped, sequences, None, timings)

    # ------------------------------------------------------------------ step 4: rewards
    def compute_rewards(self, rollout: Sequences) -> Rewards:
        """Step 4: the reward functions' scores, and the missing-EOS penalty (`klppo.ppo.update.compute_rewards`)."""
        return update.compute_rewards(
            rollout,
            self.reward_funcs,
            self.reward_weights,
            self.reward_func_names,
            self.processing_class,
            self.sampler.stop_token_id,
            eos_scored_as_any_token(self.args, self.sampler.stop_token_id),
            self.args.missing_eos_penalty,
            self.accelerator,
            log=self.is_world_process_zero(),
        )

    # ------------------------------------------------------------------ steps 5-6: KL and controller
    def apply_kl(self, rollout: Rollout, rewards: Rewards) -> KLPenalty:
        """Step 5: the configured estimate in the per-token rewards, at the coefficient in force, and the controller
        statistic (`klppo.ppo.update.kl_penalty`); the controller does not move here (`update_controller`)."""
        return update.kl_penalty(rollout, rewards, self.kl_plan, self.kl_controller.value, self.accelerator)

    def update_controller(self, rollout: Rollout, rewards: Rewards, penalty: KLPenalty) -> dict[str, float]:
        """Step 6: the controller's step on the rollout's statistic, the guard's and the drift monitor's reading
        (`klppo.ppo.update.update_controller`); it does not move on a non-finite rollout or while the critic warms
        up. Returns the next coefficient and the controller's metrics."""
        if not penalty.finite:
            return {"kl/coef_next": self.kl_controller.value}
        if self.critic_warming_up:  # the controller keeps still; what it reports is logged all the same
            return {"kl/coef_next": self.kl_controller.value, **self.kl_controller.metrics()}
        return update.update_controller(
            self.kl_controller,
            self.kl_guard,
            self.run.drift,
            self.kl_plan,
            rollout,
            rewards,
            penalty,
            self.accelerator,
            self.args.num_generations,
            self.is_world_process_zero(),
        )

    # ------------------------------------------------------------------ step 7: advantages
    def compute_advantages(self, rollout: Rollout, rewards: Rewards, penalty: KLPenalty) -> Advantages:
        """Step 7: advantages, returns and the KL loss term's weight (`klppo.ppo.update.compute_advantages`)."""
        advantages = update.compute_advantages(self.args, self.kl_plan, rollout, rewards, penalty, self.accelerator)
        if getattr(rollout, "is_weight", None) is None:
            return advantages
        # an inexact engine's truncated importance weights, on the tokens that carry a policy gradient
        valid = rollout.response_mask * rewards.scorable.to(rollout.response_mask.dtype)[:, None]
        return weight_advantages(advantages, rollout, valid, self.accelerator)

    # ------------------------------------------------------------------ step 8: optimisation
    def optimise(self, rollout: Rollout, advantages: Advantages, kl_reading: float | None = None) -> OptimiseResult:
        """Step 8: `num_ppo_epochs` passes over shuffled mini-batches. A mini-batch accumulates gradients over
        micro-batches (`klppo.ppo.update.micro_batch_loss`); before the last one's backward pass (under DeepSpeed,
        the accumulation boundary that reduces the gradients), the step's checks (`StepChecks`: a non-finite loss,
        the KL guard `klppo.ppo.safety.kl_guard.KLGuard`) decide, the same on every rank, whether its gradients are kept; then
        one optimizer step (`_end_step`). A non-finite step ends the update when updates are rolled back (`rollback_updates`); the
        guard ends it once the KL to the reference leaves its bounds. `kl_reading` (the rollout's controller
        statistic, `KLPenalty.reading`) is where the guard's estimate starts."""
        args, acc, model = self.args, self.accelerator, self.model_wrapped
        model.train()
        n_local, mb_size, micro = rollout.batch_size, args.local_mini_batch_size, args.per_device_train_batch_size
        if n_local % mb_size:
            raise ValueError(f"Rollout batch {n_local} is not a multiple of the mini-batch size {mb_size}.")
        stats, skipped, applied, verdict, stop = GlobalSums(), False, 0, None, False
        micro_batch_loss = self.loss_function()
        for _epoch in range(args.num_ppo_epochs):
            for mb_idx in torch.randperm(n_local, device=rollout.responses.device).split(mb_size):
                # the mini-batch's global counts: every loss is a global mean, whatever the split
                tokens, seqs = reduce_sum_count(rollout.response_mask[mb_idx].sum().double(), float(len(mb_idx)), acc)
                checks, verdict, micro_batches = StepChecks(acc.device), None, mb_idx.split(micro)
                for i, idx in enumerate(micro_batches):
                    boundary = i == len(micro_batches) - 1
                    # DDP reduces at the boundary only; DeepSpeed is told the boundary in `backward` (its ZeRO-2/3
                    # refuse no_sync)
                    with (
                        nullcontext()
                        if boundary or acc.num_processes == 1 or self.is_deepspeed_enabled
                        else acc.no_sync(model)
                    ):
                        with record_function("klppo/forward"):
                            mb = rollout.select(idx).without_padding_columns()
                            loss, parts, sample = micro_batch_loss(
                                mb, advantages, idx, dict(num_tokens=tokens, num_seqs=seqs)
                            )
                        checks.add(loss, sample)
                        if boundary:  # one collective and host sync per step
                            verdict = checks.verdict(acc, self.kl_guard, kl_reading, applied)
                        with record_function("klppo/backward"):
                            backward(acc, model, loss, boundary, self.is_deepspeed_enabled, discard=verdict is not None)
                    for name, (total, count) in parts.items():
                        stats.add(name, total, count)
                verdict = self._end_step(verdict, stats)
                skipped, applied = skipped or verdict == NONFINITE, applied + int(verdict == APPLIED)
                stop = verdict in (UPPER, LOWER) or (verdict == NONFINITE and self.rollback_updates)
                if stop:
                    break  # the guard fired, or the whole update is undone: no point in more steps
            if stop:
                break
        guarded = verdict if verdict in (UPPER, LOWER) else None
        metrics = {**stats.means(acc), **self.kl_guard.metrics(guarded)}
        if "val/ratio_sq" in metrics:  # the ratio's variance over the update's tokens, from its two moments
            metrics["val/ratio_var"] = max(metrics.pop("val/ratio_sq") - metrics["val/ratio"] ** 2, 0.0)
        if guarded and self.is_world_process_zero():
            logger.info(self.kl_guard.describe(guarded, applied))
        return OptimiseResult(metrics, skipped, applied)

    def _end_step(self, verdict: str | None, stats: GlobalSums) -> str:
        """The end of one mini-batch: with the checks passed (`verdict` None), one optimizer step on the accumulated
        gradients (the critic's alone while it warms up). Returns "applied", or, with the gradients dropped,
        "nonfinite" (a rank saw a non-finite loss or gradient norm) or the KL guard's verdict ("guard" /
        "guard_low")."""
        acc, model = self.accelerator, self.model_wrapped
        if verdict is None:
            grad_norm = optimizer_step(
                acc, model, self.optimizer, self.lr_scheduler, self.args.max_grad_norm, self.is_deepspeed_enabled
            )
            if grad_norm is not None and math.isfinite(grad_norm):
                stats.add(
                    "train/grad_norm",
                    torch.tensor(grad_norm / acc.num_processes, dtype=torch.float64),
                    1.0 / acc.num_processes,
                )
            verdict = APPLIED if grad_norm is None or math.isfinite(grad_norm) else NONFINITE
        elif self.is_deepspeed_enabled:
            model.step()  # finds the poisoned gradients non-finite: drops them and skips the step
        if verdict in (UPPER, LOWER) and self.kl_guard.clears_momentum and not reset_momentum(self.optimizer):
            logger.warning(
                "kl_guard: the optimizer keeps no exp_avg or momentum_buffer tensor, so its momentum was not "
                "cleared when the KL guard fired."
            )
        self.optimizer.zero_grad(set_to_none=True)
        return verdict

    def loss_function(self):
        """This update's `micro_batch_loss(mb, advantages, idx, counts)` (`klppo.ppo.update.micro_batch_loss`, with
        the run's model, settings and KL plan bound): the loss of one micro-batch `mb` (rows `idx` of the rollout),
        normalised by the mini-batch's GLOBAL counts, its logging parts and its reading for the KL guard."""
        share = 1.0 / (self.args.gradient_accumulation_steps * self.accelerator.num_processes)
        return partial(
            update.micro_batch_loss,
            self.model_wrapped,
            args=self.args,
            plan=self.kl_plan,
            suppressed_ids=self.sampler.suppressed_ids,
            warming=self.critic_warming_up,
            share=share,
            reference=self._loss_reference,
        )

    def _loss_reference(self, mb):
        """The reference's logits for a logits-based KL in the loss (`micro_batch_loss`): its hidden states and head,
        read in blocks inside the policy's forward and backward passes; under FSDP2, whose roots are resharded
        between the two, its whole logits."""
        whole = is_fsdp2(self.model_wrapped)
        return self.scorer.reference_source(self.model_wrapped, mb, whole=whole)

    # ------------------------------------------------------------------ reference resets
    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        policy = unwrap(self.accelerator, self.model_wrapped).policy
        return reference_tensors(policy, self.ref_model, self.ref_adapter_name, self.use_adapter_reference)

    def reset_reference(self) -> None:
        """Make the reference the current policy (`klppo.ppo.run.reference_resets`): the last update's policy is checked first
        (it can no longer be undone once the reference holds it), the reference's tensors before the first reset are
        kept for `kl/initial`, the optimizer's state is cleared (`ref_reset_optimizer`) and the KL controller, the
        guard's low side and the drift monitor start again from a KL of 0 (`RunState.reference_reset`)."""
        self._settle_last_update()  # a diverged policy must not become the reference
        if self.run.safety.unsettled is not None:
            self.run.safety.unsettled.snapshot = None  # no undoing past a reset
        self.run.reference_reset(self._reference_tensors())
        policy = unwrap(self.accelerator, self.model_wrapped).policy
        reset_reference(policy, self.ref_model, self.ref_adapter_name, self.use_adapter_reference)
        if self.args.experimental.ref_reset_optimizer and self.optimizer is not None:
            clear_optimizer_state(self.optimizer)
        if self.is_world_process_zero():
            logger.info(
                "Reference reset %d at update %d: the reference is now the policy.",
                self.reference_resets,
                self.state.global_step,
            )

    def _kl_to_initial(self, rollout: Rollout, timings: dict) -> dict[str, float]:
        """`kl/initial`: the KL to the reference before the first reset (`klppo.ppo.run.reference_resets.kl_to_initial`)."""
        with timed(timings, "time/score_initial", self.accelerator):
            return kl_to_initial(
                rollout,
                lambda part: self.scorer.reference_logprobs(self.model_wrapped, part),
                self._reference_tensors(),
                self.run.initial_reference,
                self.kl_plan,
                self.args.rollout_forward_batch_size,
                self.accelerator,
            )

    # ------------------------------------------------------------------ non-finite values
    def _settle_last_update(self, rollout: Rollout | None = None) -> dict[str, float] | None:
        """Check the policy the last update left (`UpdateSafety.settle`): with `rollout`'s forward passes, or with
        one over the last rollout before an evaluation, a save, a reset or the end of training."""
        return self.run.safety.settle(
            rollout,
            self.model_wrapped,
            unwrap(self.accelerator, self.model_wrapped),
            self.optimizer,
            self.lr_scheduler,
            self.args,
        )

    @property
    def nonfinite_skips(self) -> int:
        """Updates skipped so far because of NaN/inf in the rewards, the KL, a loss or a gradient."""
        return self.run.safety.nonfinite.skips

    def decide_rollback_on_all_ranks(self) -> bool:
        """Decide, once, whether a non-finite step undoes its whole update (`UpdateSafety.decide_rollback`): a
        collective (the weights are counted over all ranks), so every rank calls it at the same point; the
        constructor does."""
        engine = "deepspeed" if self.is_deepspeed_enabled else None
        return self.run.safety.decide_rollback(
            self.args.experimental.nonfinite_rollback, unwrap(self.accelerator, self.model_wrapped), engine
        )

    @property
    def rollback_updates(self) -> bool:
        """Whether a non-finite step undoes its whole update, as `decide_rollback_on_all_ranks` decided (no
        communication)."""
        return bool(self.run.safety.rollback)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the policy (HF format: full model or PEFT adapter), the tokenizer, and every trainable weight of
        the actor-critic (value head / critic included) for resuming; never weights that are not finite."""
        output_dir = output_dir or self.args.output_dir
        self._settle_last_update()
        if not self.run.safety.weights_finite(unwrap(self.accelerator, self.model_wrapped)):
            if self.is_world_process_zero():
                logger.warning(
                    "Not saving to %s: the trainable weights are not finite, or training stopped on a diverged policy.",
                    output_dir,
                )
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        state_dict = unwrapped.state_dict() if state_dict is None else state_dict
        if self.args.should_save:
            # after a reset, a LoRA adapter belongs to a merged base no hub model has: the policy is saved whole
            merged = self.reference_resets > 0 and self.use_adapter_reference and self.ref_adapter_name is None
            ckpt.save_model_files(output_dir, unwrapped, state_dict, self.processing_class, self.args, merged=merged)

    def _save_checkpoint(self, model, trial) -> None:
        """Write `checkpoint-N` atomically (`klppo.ppo.run.checkpoint.staged`): every file, Trainer's and klppo's (the
        run's state, the reference after a reset), goes into a staging folder renamed into place when complete."""
        self._settle_last_update()
        if not self.run.safety.weights_finite(unwrap(self.accelerator, self.model_wrapped)):
            if self.is_world_process_zero():
                logger.warning(
                    "Not writing checkpoint %d: the trainable weights are not finite, or training stopped on "
                    "a diverged policy; the last checkpoint is kept.",
                    self.state.global_step,
                )
            return
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with ckpt.staged(
            self._get_output_dir(trial), name, self.args, self.accelerator, self.state.best_model_checkpoint
        ) as (staging_root, folder):
            self._get_output_dir = lambda trial=None: staging_root  # Trainer writes (and rotates) inside staging
            try:
                super()._save_checkpoint(model, trial)
            finally:
                del self._get_output_dir
            if self.args.should_save:
                ckpt.write_controller_state(folder, self._klppo_state())
                if self.run.initial_reference is not None:  # after a reset: the reference and the initial one
                    ckpt.save_reference(folder, self._reference_tensors(), self.run.initial_reference)
        self._last_saved_step = self.state.global_step

    def _klppo_state(self) -> dict:
        """The state a checkpoint carries beside the weights (`RunState`), and the run's settings that resuming
        compares."""
        return {**self.run.state_dict(), "settings": ckpt.resume_settings(self.args)}

    def latest_checkpoint(self) -> str | None:
        """The newest complete klppo checkpoint in `output_dir`, or None (`klppo.ppo.run.checkpoint.latest_checkpoint`)."""
        return ckpt.latest_checkpoint(self.args.output_dir)

    def _resume(self, checkpoint: str) -> None:
        """Restore weights, optimizer, scheduler, trainer state, RNG, the KL controller and the monitors."""
        from transformers.trainer_callback import TrainerState

        state = ckpt.read_controller_state(checkpoint)
        ckpt.check_resume_settings(state.get("settings"), self.args, log=self.is_world_process_zero())
        ckpt.load_weights(
            checkpoint,
            self.model_wrapped,
            unwrap(self.accelerator, self.model_wrapped),
            deepspeed=self.is_deepspeed_enabled,
        )
        self._load_optimizer_and_scheduler(checkpoint)
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)  # the engines keep the optimizer elsewhere
        if plain and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)) and self.is_world_process_zero():
            logger.warning(
                "%s holds no optimizer state (saved with save_only_model=True): the optimizer's moments, "
                "the learning-rate schedule and the random state start afresh.",
                checkpoint,
            )
        self._load_rng_state(checkpoint)
        max_steps = self.state.max_steps
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max_steps)
        self.run.load_state_dict(state)
        if self.reference_resets:
            current, initial = ckpt.load_reference(checkpoint)
            tensors = self._reference_tensors()
            with torch.no_grad():
                for name, tensor in tensors.items():
                    tensor.copy_(current[name])
            self.run.initial_reference = {name: initial[name].to(tensors[name].device) for name in tensors}
        logger.info(
            "Resumed from %s at update %d with KL coefficient %.6g",
            checkpoint,
            self.state.global_step,
            self.kl_controller.value,
        )

    # ------------------------------------------------------------------ diagnostics
    def sample(self, prompts: list, seed: int | None = None) -> tuple[Rollout, Rewards]:
        """Completions of `prompts` by the current policy, sampled as in training, and their rewards. With
        `seed`, from a private random stream: the training run's later rollouts do not change."""
        self.setup_optimisation()
        batch = self.prompt_batch(prompts)
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            rollout = self.rollout(batch)
        if not rollout_outputs_finite(rollout, self.accelerator):
            raise TrainingDiverged(DIVERGED_SAMPLING)
        return rollout, self.compute_rewards(rollout)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`evaluate_policy()`, under the name transformers' Trainer gives evaluation (its loss-based evaluation
        does not apply to a PPO policy); the metrics are logged too. `eval_dataset` is not supported: the prompts
        are those of the trainer's `eval_dataset`."""
        if eval_dataset is not None or metric_key_prefix != "eval":
            raise ValueError(
                "KLPPOTrainer.evaluate() takes no `eval_dataset` or `metric_key_prefix`: it evaluates "
                "the policy on the trainer's eval_dataset and held-out texts (`evaluate_policy`)."
            )
        metrics = self.evaluate_policy()
        self.log(dict(metrics))
        return metrics

    @torch.no_grad()
    def evaluate_policy(self) -> dict[str, float]:
        """`eval/perplexity` of the policy on held-out text (klppo's offline set unless `heldout_texts` were given)
        and, with eval prompts, `eval/scores`: their mean reward (`klppo.evaluation.eval_scores`)."""
        from ..data import load_heldout_texts
        from ..evaluation import eval_scores, heldout_perplexity

        acc = self.accelerator
        self.setup_optimisation()  # a sharded policy (ZeRO-3, FSDP) runs inside its engine only
        if self.heldout_texts is None:
            self.heldout_texts = load_heldout_texts(max_texts=self.args.heldout_eval_texts)
        policy = unwrap(acc, self.model_wrapped).policy
        with root_unsharded(self.model_wrapped):  # the forward enters through the policy, not the FSDP root
            metrics = {
                "eval/perplexity": heldout_perplexity(
                    policy, self.processing_class, self.heldout_texts, accelerator=acc
                )
            }
        if self.eval_prompts is not None and len(self.eval_prompts) > 0:
            metrics["eval/scores"] = eval_scores(self, self.eval_prompts)
        return metrics

    def _record_samples(self, prompts: list, rewards: Rewards) -> None:
        """Keep up to 4 completions of this update in `completion_samples` (and log them to wandb as a table),
        `num_sample_generations` times over the run, on the main process."""
        from ..evaluation import completion_rows

        n, state = self.args.num_sample_generations, self.state
        if n <= 0 or not self.is_world_process_zero() or state.global_step % max(1, state.max_steps // n):
            return
        rows = completion_rows(state.global_step, prompts, rewards)
        self.completion_samples.extend(rows)
        if "wandb" in (self.args.report_to or []):
            import pandas as pd
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=pd.DataFrame(rows))})
