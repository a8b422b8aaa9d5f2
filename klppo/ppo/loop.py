"""The training loop around the PPO updates: transformers' `Trainer` state, callbacks, logging, evaluation and
checkpoints, with one PPO update (`KLPPOTrainer.ppo_update`) as one step."""

from __future__ import annotations

import math
import time

from transformers.trainer_utils import TrainOutput

from .lock import OutputDirLock
from .rollout import endless_prompt_batches


class TrainingLoopMixin:
    """`train()` for `KLPPOTrainer`: counts PPO updates as Trainer steps (`max_steps`), holds the output-folder
    lock, resumes, and logs / evaluates / saves on Trainer's schedule."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Run the PPO updates. One run per `output_dir`: a second run on the same folder stops at once
        (`OutputDirInUse`). `resume_from_checkpoint`: a checkpoint folder, or True for the latest complete one."""
        with OutputDirLock(self.args.output_dir, enabled=self.is_world_process_zero() and self.args.should_save):
            return self._train(resume_from_checkpoint)

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        args = self.args
        self.is_in_train = True
        num_updates = self.num_updates()
        self.setup_optimisation(num_updates)
        self._init_state(num_updates)
        checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        if checkpoint:
            self._resume(checkpoint)
        generations = args.num_generations or 1  # each prompt's responses in consecutive rows, on this rank
        batches = endless_prompt_batches(
            self.train_dataset, args.local_prompts_per_rollout,
            lambda rows: self.prompt_batch([row for row in rows for _ in range(generations)]), self.accelerator,
            args.seed, skip=self.state.global_step,
        )  # fmt: skip
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time, metrics = time.time(), {}
        while self.state.global_step < num_updates:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            metrics = self.ppo_update(next(batches))
            self.state.global_step += 1
            self.state.epoch = self.state.global_step * self._prompts_per_update() / len(self.train_dataset)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_evaluate_save(metrics)
            if self.control.should_training_stop:
                break
        self._settle_last_update()  # the last update's policy, checked before anything samples from or saves it
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        runtime = time.time() - start_time
        return TrainOutput(self.state.global_step, metrics.get("loss/policy", float("nan")), {"train_runtime": runtime})

    def _prompts_per_update(self) -> int:
        """Prompts per update, all ranks (each sampled `num_generations` times)."""
        return self.args.local_prompts_per_rollout * self.accelerator.num_processes

    def _init_state(self, num_updates: int) -> None:
        self.state.max_steps = num_updates
        self.state.num_train_epochs = math.ceil(num_updates * self._prompts_per_update() / len(self.train_dataset))
        self.state.compute_steps(self.args, num_updates)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()

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
            optimizer_steps = num_updates * args.num_ppo_epochs * args.num_mini_batches
            self.create_optimizer_and_scheduler(num_training_steps=optimizer_steps)
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
        acc.free_memory()
        acc.end_training()
