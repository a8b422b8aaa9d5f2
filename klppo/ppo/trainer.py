"""`KLPPOTrainer`: PPO for causal LMs with KL control, on transformers' `Trainer` and accelerate.

One PPO update (`_ppo_update`) follows the numbered steps of DESIGN.md:

1. sample prompts, generate responses            (`_rollout`)
2. truncate at the stop token, build masks       (`_rollout`)
3. score: policy / reference log-probs, values   (`_rollout`)
4. rewards, missing-EOS penalty                  (`_compute_scores`)
5. KL: every estimator logged, configured one applied (`_apply_kl`)
6. controller update from the global statistic   (`_apply_kl`)
7. GAE advantages and returns, whitening         (`_compute_advantages`)
8. PPO epochs over mini-batches                  (`_optimise`)
9. log, evaluate, checkpoint                     (`train`)
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback, set_seed
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model, entropy_from_logits

from ..kl import (
    build_kl_controller,
    compute_kl,
    full_kl,
    global_masked_whiten,
    kl_loss,
    kl_reward,
    kl_statistic,
    reduce_sum_count,
)
from ..kl.penalty import aggregate_loss
from ..kl.reduce import all_reduce_sum
from .advantages import gae_advantages
from .config import DEFAULT_FULL_LEARNING_RATE, DEFAULT_LORA_LEARNING_RATE, FULL_KL, KLPPOConfig
from .losses import clipped_policy_loss, clipped_value_loss
from .rollout import (
    ends_with_stop,
    generate_responses,
    make_generation_config,
    position_ids_from_mask,
    response_logits,
    response_logprobs,
    suppressed_token_ids,
    truncate_at_stop,
)
from .health import PPOHealthMonitor
from .lock import OutputDirLock
from .value import ActorCritic, CriticModel, ValueHead, hidden_size_of

logger = logging.getLogger(__name__)

CONTROLLER_STATE_NAME = "kl_controller.json"
TRAINABLE_STATE_NAME = "klppo_trainable.safetensors"
STAGING_DIR = ".checkpoint-staging"
# settings compared on resume: refused if changed / combined with the saved state / ignored for it
RESUME_REFUSED = ("kl_controller", "kl_target_unit", "kl_mode")
RESUME_COMBINED = ("kl_target", "kl_estimator", "kl_horizon", "kl_loss_scale")
RESUME_IGNORED = ("kl_coef", "learning_rate")
# what a complete klppo checkpoint holds (checked before resuming from "the latest")
CHECKPOINT_FILES = (TRAINABLE_STATE_NAME, CONTROLLER_STATE_NAME, "trainer_state.json")
LOGGED_ESTIMATORS = ("k1", "k2", "k3")


class ResumeMismatch(ValueError):
    """A checkpoint's settings cannot be combined with the resuming run's."""


class KLProgressCallback(TrainerCallback):
    """A progress bar over PPO updates showing the live KL statistic, coefficient and reward."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="PPO", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "kl/value" in logs:
            self.bar.set_postfix(
                kl=f"{logs['kl/value']:.3g}", coef=f"{logs['kl/coef']:.3g}", reward=f"{logs['objective/scores']:.3g}"
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _GlobalSums:
    """Collects (sum, count) pairs of metrics and reduces all of them across ranks in one collective."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, name: str, total: torch.Tensor, count) -> None:
        total = total.detach().double().reshape(())
        count = torch.as_tensor(count, dtype=torch.float64, device=total.device).reshape(())
        if name in self.sums:
            self.sums[name] = self.sums[name] + total
            self.counts[name] = self.counts[name] + count
        else:
            self.sums[name], self.counts[name] = total, count

    def means(self, accelerator) -> dict[str, float]:
        if not self.sums:
            return {}
        names = list(self.sums)
        packed = torch.stack([torch.stack([self.sums[n] for n in names]), torch.stack([self.counts[n] for n in names])])
        totals, counts = all_reduce_sum(packed, accelerator).tolist()
        return {n: t / c if c > 0 else float("nan") for n, t, c in zip(names, totals, counts)}


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
        if args is None:
            args = KLPPOConfig(output_dir="klppo-output")
        if not isinstance(args, KLPPOConfig):
            raise TypeError(f"`args` must be a KLPPOConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("KLPPOTrainer needs a `train_dataset` with a `prompt` column.")
        if "prompt" not in train_dataset.column_names:
            raise ValueError(
                f"`train_dataset` needs a `prompt` column; it has {train_dataset.column_names}. "
                "Rename the prompt column with `dataset.rename_column(old, 'prompt')`."
            )
        if len(train_dataset) == 0 or not any(train_dataset["prompt"]):
            raise ValueError(
                f"`train_dataset` has no non-empty prompt ({len(train_dataset)} rows): PPO needs prompts to continue."
            )
        if reward_funcs is None:
            raise ValueError("KLPPOTrainer needs `reward_funcs`: a callable, a reward model, or a path to one.")
        set_seed(args.seed)  # value heads and copies are created below, before Trainer seeds
        _maybe_offline_wandb(args)

        # Policy and tokenizer
        model_given_as_path = isinstance(model, str)
        model_path = model if model_given_as_path else getattr(getattr(model, "config", None), "_name_or_path", None)
        if isinstance(model, str):
            model = _load_causal_lm(model)
        if processing_class is None:
            if not model_path:
                raise ValueError("Pass `processing_class` (the tokenizer) when `model` is not a path.")
            processing_class = _load_tokenizer(model_path)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        processing_class.padding_side = "left"

        # Reward functions (loaded before the critic, which may start from the reward model)
        from ..rewards.loading import load_reward_funcs, reward_func_name

        self.reward_funcs, self.reward_weights = load_reward_funcs(
            reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs], args.reward_weights
        )
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]

        if args.learning_rate is None:
            args.learning_rate = default_learning_rate(model, peft_config)
            logger.info("learning_rate not set: %g (the default for this kind of fine-tuning)", args.learning_rate)

        # A separate critic initialised from the policy starts from the weights passed in (a copy taken
        # before any adapter is added), or from the policy's path when the policy was given as one
        critic_start = None
        if args.critic == "separate" and value_model is None and args.critic_init == "policy":
            critic_start = model_path if model_given_as_path else copy.deepcopy(model)

        # Reference: a frozen copy, or the policy with its adapter disabled
        self.use_adapter_reference = False
        if peft_config is not None:
            from peft import get_peft_model

            if ref_model is None:
                self.use_adapter_reference = True
            model = get_peft_model(model, peft_config)
        elif ref_model is None:
            ref_model = copy.deepcopy(model)
        if isinstance(ref_model, str):
            ref_model = _load_causal_lm(ref_model)
        self.ref_model = ref_model
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)

        # Critic
        if args.critic == "shared":
            if value_model is not None:
                raise ValueError("`value_model` is for critic='separate'; critic='shared' puts a head on the policy.")
            actor_critic = ActorCritic(
                model, value_head=ValueHead(hidden_size_of(model.config)), detach_value_input=args.shared_critic_detach
            )
        else:
            actor_critic = ActorCritic(model, critic=self._build_critic(value_model, args, critic_start))
        for module in (actor_critic, self.ref_model):
            if module is not None:
                disable_dropout_in_model(module)
        if args.activation_checkpointing:
            actor_critic.activation_checkpointing_enable(args.activation_checkpointing_kwargs)
            # done here; Trainer would look for it on the wrapper
            args.activation_checkpointing = args.gradient_checkpointing = False

        self.heldout_texts = heldout_texts
        self.eval_prompts = eval_dataset
        super().__init__(
            model=actor_critic,
            args=args,
            data_collator=lambda features: features,
            train_dataset=train_dataset,
            # Trainer insists on an eval_dataset when eval_strategy is set; evaluation here is held-out
            # perplexity (+ eval prompts when given), so a one-row placeholder satisfies that check.
            eval_dataset=eval_dataset
            if eval_dataset is not None or args.eval_strategy == "no"
            else train_dataset.select(range(1)),
            processing_class=processing_class,
            callbacks=callbacks,
        )
        self.remove_callback(ProgressCallback)
        if not self.args.disable_tqdm:
            self.add_callback(KLProgressCallback())

        # KL control state
        self.kl_controller = build_kl_controller(args)
        from ..evaluation import KLDriftMonitor

        self.drift_monitor = KLDriftMonitor(args.kl_target, patience=args.kl_drift_patience) if args.kl_target else None
        self.health_monitor = PPOHealthMonitor(patience=args.health_patience)
        self.nonfinite_skips = 0
        self.consecutive_nonfinite = 0
        self.completion_samples: list[dict] = []

        # Devices: reference and reward models live beside the policy (sharded under ZeRO-3 / FSDP)
        if self.ref_model is not None:
            self.ref_model = self._prepare_frozen(self.ref_model)
        for fn in self.reward_funcs:
            if isinstance(getattr(fn, "model", None), nn.Module):
                fn.model = self._prepare_frozen(fn.model)
        self.stop_token_id = args.stop_token_id
        if self.stop_token_id is None and args.stop_token == "eos":
            self.stop_token_id = processing_class.eos_token_id
        suppressed = suppressed_token_ids(
            self.stop_token_id, processing_class, getattr(self.model.policy, "generation_config", None)
        )
        self.suppressed_ids = torch.tensor(suppressed, dtype=torch.long) if suppressed else None
        self.generation_config = make_generation_config(args, processing_class, self.stop_token_id, suppressed)
        logger.info(
            "KL applied in: %s (estimator %s, controller %s, statistic unit: %s)",
            args.kl_mode,
            args.kl_estimator,
            args.kl_controller,
            args.kl_target_unit,
        )

    # ------------------------------------------------------------------ construction helpers
    def _build_critic(self, value_model, args: KLPPOConfig, policy_start) -> nn.Module:
        """A separate critic: `value_model` (a module or a path), else per `critic_init`; `policy_start` is the
        policy's path or a copy of its initial weights (for `critic_init="policy"`)."""
        if isinstance(value_model, nn.Module):
            return value_model if isinstance(value_model, CriticModel) else CriticModel.from_model(value_model)
        source = value_model or args.critic_init
        if source == "policy":
            if isinstance(policy_start, nn.Module):
                return CriticModel.from_model(policy_start)
            source = policy_start
        elif source == "reward":
            reward_model = next((f.model for f in self.reward_funcs if hasattr(f, "model")), None)
            if reward_model is None:
                raise ValueError("critic_init='reward' needs a reward model among `reward_funcs`.")
            return CriticModel.from_model(copy.deepcopy(reward_model))
        return CriticModel.from_model(_load_causal_lm(source))

    def _prepare_frozen(self, module: nn.Module) -> nn.Module:
        module.eval().requires_grad_(False)
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            return prepare_deepspeed(module, self.accelerator)
        if self.is_fsdp_enabled:
            from trl.models.utils import prepare_fsdp

            return prepare_fsdp(module, self.accelerator)
        return module.to(self.accelerator.device)

    # ------------------------------------------------------------------ data
    def _collate(self, features: list[dict]) -> dict:
        tokenizer = self.processing_class
        prompts = [f["prompt"] for f in features]
        if isinstance(prompts[0], list):  # conversational
            texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
            enc = tokenizer(texts, add_special_tokens=False, padding=False)
        else:
            enc = tokenizer(prompts, padding=False)
        ids = enc["input_ids"]
        if self.args.max_prompt_length:
            ids = [x[-self.args.max_prompt_length :] for x in ids]
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        extra = {k: [f[k] for f in features] for k in features[0] if k != "prompt"}
        return {"prompt": prompts, "input_ids": input_ids, "attention_mask": attention_mask, "extra": extra}

    def _prompt_batches(self, skip: int):
        """Endless rollout batches of prompts, reshuffled each pass; skips `skip` batches (resume)."""
        loader = DataLoader(
            self.train_dataset,
            batch_size=self.args.local_rollout_batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=self._collate,
            generator=torch.Generator().manual_seed(self.args.seed),
        )
        loader = self.accelerator.prepare_data_loader(loader)
        if len(loader) == 0:
            raise ValueError(
                f"The prompt set ({len(self.train_dataset)} prompts) is smaller than one global rollout batch "
                f"({self.args.local_rollout_batch_size * self.accelerator.num_processes}). Lower "
                "per_device_train_batch_size / gradient_accumulation_steps / num_mini_batches or add prompts."
            )
        seen, epoch = 0, 0
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            for batch in loader:
                seen += 1
                if seen > skip:
                    yield batch
            epoch += 1

    # ------------------------------------------------------------------ training loop
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Run the PPO updates. One run per `output_dir`: a second run on the same folder stops at once
        (`OutputDirInUse`). `resume_from_checkpoint`: a checkpoint folder, or True for the latest complete one."""
        with OutputDirLock(self.args.output_dir, enabled=self.is_world_process_zero() and self.args.should_save):
            return self._train(resume_from_checkpoint)

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        args, acc = self.args, self.accelerator
        self.is_in_train = True
        num_updates = args.num_updates(len(self.train_dataset), acc.num_processes)
        self._setup_optimisation(num_updates)
        self.state.max_steps = num_updates
        self.state.num_train_epochs = math.ceil(
            num_updates * args.local_rollout_batch_size * acc.num_processes / len(self.train_dataset)
        )
        self.state.compute_steps(args, num_updates)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()

        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"  # from a command line
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self.latest_checkpoint()
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No complete checkpoint found in {args.output_dir} to resume from. Start without "
                    "--resume_from_checkpoint, or pass the path of a checkpoint folder."
                )
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)

        batches = self._prompt_batches(skip=self.state.global_step)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time = time.time()
        metrics: dict[str, float] = {}
        while self.state.global_step < num_updates:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            metrics = self._ppo_update(next(batches))
            self.state.global_step += 1
            self.state.epoch = (
                self.state.global_step * args.local_rollout_batch_size * acc.num_processes / len(self.train_dataset)
            )
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log:
                self.log(dict(metrics))
            if self.control.should_evaluate:
                self.log(self.evaluate_policy())
                self.control.should_evaluate = False
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        runtime = time.time() - start_time
        return TrainOutput(self.state.global_step, metrics.get("loss/policy", float("nan")), {"train_runtime": runtime})

    def _setup_optimisation(self, num_updates: int) -> None:
        """Create the optimizer and scheduler and wrap the actor-critic for distributed training. The
        scheduler is not handed to accelerate: it steps once per optimizer step, on every rank."""
        args = self.args
        if self.optimizer is None:
            optimizer_steps = num_updates * args.num_ppo_epochs * args.num_mini_batches
            self.create_optimizer_and_scheduler(num_training_steps=optimizer_steps)
            self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
            if self.is_deepspeed_enabled:
                self.deepspeed = self.model_wrapped

    def _ppo_update(self, batch: dict) -> dict[str, float]:
        timings: dict[str, float] = defaultdict(float)
        lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self.args.learning_rate
        start = _now(self.accelerator)
        rollout = self._rollout(batch, timings)  # steps 1-3
        with _timed(timings, "time/reward", self.accelerator):
            reward_metrics = self._compute_scores(rollout)  # step 4
        with _timed(timings, "time/kl", self.accelerator):
            kl_metrics = self._apply_kl(rollout)  # steps 5-6
        finite = kl_metrics.pop("_finite")
        if not finite:
            skip = self._record_nonfinite("rollout scores or KL", "no optimizer step was taken")
            metrics = {**reward_metrics, **kl_metrics, **skip}
        else:
            advantage_metrics = self._compute_advantages(rollout)  # step 7
            snapshot = self._snapshot_optimisation() if self.args.nonfinite_rollback else None
            with _timed(timings, "time/optimise", self.accelerator):
                train_metrics = self._optimise(rollout)  # step 8
            train_metrics.update(advantage_metrics)
            applied = train_metrics.pop("_applied_steps")
            if train_metrics.pop("_skipped"):
                if snapshot is not None:
                    self._restore_optimisation(snapshot)
                    outcome = "the weights and optimizer state were restored to the start of the update"
                else:
                    outcome = f"{applied} optimizer step(s) of this update had already been applied"
                train_metrics.update(self._record_nonfinite("the loss or its gradient", outcome))
            else:
                self.consecutive_nonfinite = 0
            metrics = {**reward_metrics, **kl_metrics, **train_metrics}
        timings["time/update"] = _now(self.accelerator) - start
        metrics.update(timings)
        metrics["train/nonfinite_skips"] = float(self.nonfinite_skips)
        metrics["lr"] = lr
        for message in self.health_monitor.update(metrics):
            if self.is_world_process_zero():
                logger.warning(message)
        self._maybe_record_samples(rollout)
        return metrics

    # ------------------------------------------------------------------ steps 1-3: rollout
    @torch.no_grad()
    def _rollout(self, batch: dict, timings: dict | None = None) -> dict:
        timings = timings if timings is not None else defaultdict(float)
        args, acc = self.args, self.accelerator
        device = acc.device
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        context_length = input_ids.shape[1]

        # 1. generate; the sampling policy's log-probs (and a shared critic's values) come with it, except
        # for full-vocabulary KL, which needs the policy's logits beside the reference's
        reuse = args.kl_estimator != FULL_KL
        with _timed(timings, "time/generation", acc):
            with unwrap_model_for_generation(self.model_wrapped, acc) as unwrapped, _clear_sampling_errors():
                responses, logp, values = generate_responses(
                    unwrapped.policy,
                    input_ids,
                    attention_mask,
                    self.generation_config,
                    args.rollout_forward_batch_size,
                    temperature=args.temperature if reuse else None,
                    value_head=unwrapped.value_head if reuse else None,
                    suppressed=self.suppressed_ids,
                )
        # 2. truncate at the stop token
        responses, response_mask = truncate_at_stop(responses, self.stop_token_id, self.processing_class.pad_token_id)
        rollout = {
            "prompts": batch["prompt"],
            "extra": batch.get("extra", {}),
            "query_responses": torch.cat([input_ids, responses], dim=1),
            "attention_mask": torch.cat([attention_mask, response_mask], dim=1),
            "responses": responses,
            "response_mask": response_mask,
            "context_length": context_length,
        }
        if logp is not None:
            rollout["logp"] = logp
        if values is not None:
            rollout["values"] = values
        # 3. score: what generation did not give (old log-probs, values), reference log-probs, full-vocab KL
        rollout.update(self._score(rollout, timings))
        return rollout

    @torch.no_grad()
    def _score(self, rollout: dict, timings: dict) -> dict:
        """Forward passes in chunks of `rollout_forward_batch_size` sequences: the policy (unless generation
        already gave its log-probs), the critic (unless generation gave the values), the reference."""
        args, acc = self.args, self.accelerator
        chunk, ctx = args.rollout_forward_batch_size, rollout["context_length"]
        need_policy, need_values = "logp" not in rollout, "values" not in rollout
        out = defaultdict(list)
        unwrapped = acc.unwrap_model(self.model_wrapped)
        for start in range(0, rollout["responses"].shape[0], chunk):
            qr = rollout["query_responses"][start : start + chunk]
            attn = rollout["attention_mask"][start : start + chunk]
            resp = rollout["responses"][start : start + chunk]
            pos = position_ids_from_mask(attn)
            keep = resp.shape[1] + 1  # the LM head runs on response positions only
            values, logits = None, None
            if need_policy:
                with _timed(timings, "time/score_policy", acc):
                    # a shared critic's values come out of this same forward pass
                    logits, values = self.model_wrapped(
                        qr, attention_mask=attn, position_ids=pos, compute_values=need_values and unwrapped.shared,
                        logits_to_keep=keep,
                    )  # fmt: skip
                    logits = response_logits(logits, resp.shape[1], args.temperature, self.suppressed_ids)
                    out["logp"].append(response_logprobs(logits, resp))
            if need_values:
                if values is None:
                    with _timed(timings, "time/score_value", acc):
                        values = unwrapped.critic(qr, attention_mask=attn, position_ids=pos)
                out["values"].append(values[:, ctx - 1 : -1].float())
            with _timed(timings, "time/score_ref", acc):
                ref_logits = self._reference_logits(unwrapped, qr, attn, pos, resp.shape[1])
                out["ref_logp"].append(response_logprobs(ref_logits, resp))
            if args.kl_estimator == FULL_KL:
                with _timed(timings, "time/kl", acc):
                    out["full_kl"].append(full_kl(logits, ref_logits, chunk_size=args.full_kl_chunk_size))
            del logits, ref_logits
        return {k: torch.cat(v, dim=0) for k, v in out.items()}

    def _reference_logits(self, unwrapped: ActorCritic, qr, attn, pos, response_length: int) -> torch.Tensor:
        """Temperature-scaled reference logits for the response positions `[B, R, V]`."""
        kwargs = dict(
            input_ids=qr, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=response_length + 1
        )
        if self.use_adapter_reference:
            with unwrapped.policy.disable_adapter():
                logits = unwrapped.policy(**kwargs).logits
        else:
            logits = self.ref_model(**kwargs).logits
        return response_logits(logits, response_length, self.args.temperature, self.suppressed_ids)

    # ------------------------------------------------------------------ step 4: rewards
    @torch.no_grad()
    def _compute_scores(self, rollout: dict) -> dict[str, float]:
        tokenizer, device = self.processing_class, self.accelerator.device
        responses, mask = rollout["responses"], rollout["response_mask"]
        completion_ids = [r[m.bool()].tolist() for r, m in zip(responses, mask)]
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = rollout["prompts"]
        if isinstance(prompts[0], list):
            completions_arg = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            completions_arg = completions
        rollout["completions"] = completions
        stats = _GlobalSums()
        scores = torch.zeros(len(completions), device=device, dtype=torch.float64)
        applicable = torch.zeros(len(completions), device=device, dtype=torch.bool)
        for fn, weight, name in zip(self.reward_funcs, self.reward_weights, self.reward_func_names):
            raw = fn(prompts=prompts, completions=completions_arg, completion_ids=completion_ids, **rollout["extra"])
            checked = reward_values(raw, len(completions), name)
            known = torch.tensor([v is not None for v in checked], device=device)  # None: not applicable (TRL)
            values = torch.tensor([0.0 if v is None else v for v in checked], device=device, dtype=torch.float64)
            stats.add(f"rewards/{name}", values.sum(), known.sum())
            scores += weight * values  # a NaN or inf value stays: the non-finite guard skips the update
            applicable |= known
        if not bool(applicable.all()) and self.is_world_process_zero():
            logger.warning(
                "%d of %d completions got None from every reward function: they get score 0 and no policy "
                "gradient (advantage 0), as in TRL. Make sure at least one reward function scores every sample.",
                int((~applicable).sum()), len(completions),
            )
        rollout["scorable"] = applicable
        scores = scores.float()
        has_stop = ends_with_stop(responses, mask, self.stop_token_id)
        if self.args.missing_eos_penalty is not None:
            scores = torch.where(has_stop, scores, scores - self.args.missing_eos_penalty)
        rollout["scores"] = scores
        stats.add("objective/scores", scores.sum(), scores.numel())
        stats.add("objective/eos_frac", has_stop.float().sum(), has_stop.numel())
        stats.add("objective/response_length", mask.sum(), mask.shape[0])
        return stats.means(self.accelerator)

    # ------------------------------------------------------------------ steps 5-6: KL and controller
    @torch.no_grad()
    def _apply_kl(self, rollout: dict) -> dict:
        args, acc = self.args, self.accelerator
        mask = rollout["response_mask"]
        logp, ref_logp = rollout["logp"], rollout["ref_logp"]
        stats = _GlobalSums()
        per_seq_count = mask.shape[0] if args.kl_target_unit == "sequence" else mask.sum()
        # every estimator is logged, whatever the configured one (TRL issue 1161)
        for name in LOGGED_ESTIMATORS:
            values = compute_kl(logp, ref_logp, name, log_ratio_clamp=args.kl_log_ratio_clamp)
            stats.add(f"kl/{name}", (values * mask).sum(), per_seq_count)
        if args.kl_estimator == FULL_KL:
            kl, clamped = rollout["full_kl"], torch.zeros_like(mask, dtype=torch.bool)
        else:
            kl, clamped = self._configured_kl(logp, ref_logp, old_logp=logp, return_clamped=True)
        rollout["kl"] = kl
        stats.add("kl/clamped_frac", (clamped & mask.bool()).sum(), mask.sum())

        # 5. the configured estimator enters the rewards (score at the last response token)
        coef = self.kl_controller.value
        if "reward" in args.kl_modes_applied:
            non_score = kl_reward(kl, mask, coef)
        else:
            non_score = torch.zeros_like(kl)
        rewards = non_score.clone()
        last = mask.sum(dim=1) - 1
        rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += rollout["scores"]
        rollout["rewards"], rollout["kl_coef"] = rewards, coef
        stats.add("objective/non_score_reward", non_score.sum(), mask.shape[0])
        stats.add("objective/rlhf_reward", rewards.sum(), mask.shape[0])
        stats.add("_nonfinite", (~torch.isfinite(rewards)).sum(), 1.0 / acc.num_processes)
        means = stats.means(acc)

        # 6. controller: token-weighted (or per-sequence) global statistic, identical update on every rank
        value = kl_statistic(kl, mask, unit=args.kl_target_unit, accelerator=acc).item()
        finite = math.isfinite(value) and means.pop("_nonfinite") == 0
        if finite:
            self.kl_controller.update(value, n_steps=mask.shape[0] * acc.num_processes)
            self._check_coef_consistent()
        metrics = {
            **means,
            "kl/value": value,
            "kl/coef": coef,
            "kl/coef_next": self.kl_controller.value,
            "_finite": finite,
        }
        if args.kl_target:
            metrics["kl/target"] = args.kl_target
            metrics["kl/error"] = (value - args.kl_target) / args.kl_target
            if self.drift_monitor is not None and finite:
                message = self.drift_monitor.update(value)
                if message and self.is_world_process_zero():
                    logger.warning(message)
        return metrics

    def _configured_kl(self, logp, ref_logp, old_logp, return_clamped: bool = False):
        """The configured per-token estimator with the configured clamps (see `compute_kl`)."""
        return compute_kl(
            logp,
            ref_logp,
            self.args.kl_estimator,
            old_logp=old_logp,
            log_ratio_clamp=self.args.kl_log_ratio_clamp,
            value_clamp=self.args.kl_value_clamp,
            return_clamped=return_clamped,
        )

    def _check_coef_consistent(self) -> None:
        """Every rank must hold the same coefficient: one tiny all-gather per update."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return
        coefs = acc.gather(torch.tensor([self.kl_controller.value], dtype=torch.float64, device=acc.device))
        if not torch.allclose(coefs, coefs[0], rtol=1e-12, atol=0.0):
            raise RuntimeError(
                f"KL coefficients differ across ranks: {coefs.tolist()}. Every rank must update the controller "
                "from the same globally reduced statistic; this is a bug, please report it."
            )

    # ------------------------------------------------------------------ step 7: advantages
    @torch.no_grad()
    def _compute_advantages(self, rollout: dict) -> dict[str, float]:
        args, acc = self.args, self.accelerator
        mask = rollout["response_mask"]
        rewards = rollout["rewards"]
        if args.whiten_rewards:
            rewards = global_masked_whiten(rewards, mask, accelerator=acc, shift_mean=False)
        advantages, returns = gae_advantages(rewards, rollout["values"], mask, args.gamma, args.lam)
        # samples no reward function applied to carry no policy gradient (and stay out of the whitening)
        scorable = rollout["scorable"].to(advantages.dtype)[:, None]
        advantages = advantages * scorable
        advantage_scale = 1.0
        if args.whiten_advantages:
            advantages, std = global_masked_whiten(advantages, mask * scorable, accelerator=acc, return_std=True)
            advantage_scale = std.item()
        rollout["advantages"], rollout["returns"] = advantages, returns
        # Whitening divides the policy-gradient term by std(A), so the loss E[A]/std - c * KL maximises
        # E[r] - c * std * KL: a loss-mode coefficient beta / std keeps beta's meaning that of reward mode.
        rollout["kl_loss_coef"] = rollout["kl_coef"]
        if args.kl_loss_scale == "advantage_std":
            rollout["kl_loss_coef"] = rollout["kl_coef"] / advantage_scale
        return {"policy/advantage_std": advantage_scale}

    # ------------------------------------------------------------------ step 8: optimisation
    def _optimise(self, rollout: dict) -> dict:
        args, acc = self.args, self.accelerator
        model = self.model_wrapped
        model.train()
        n_local = rollout["responses"].shape[0]
        mb_size, micro = args.local_mini_batch_size, args.per_device_train_batch_size
        if n_local % mb_size:
            raise ValueError(f"Rollout batch {n_local} is not a multiple of the mini-batch size {mb_size}.")
        world = acc.num_processes
        coef = rollout["kl_loss_coef"]
        loss_modes = "loss" in args.kl_modes_applied
        stats = _GlobalSums()
        skipped, applied = False, 0
        for _epoch in range(args.num_ppo_epochs):
            if skipped and args.nonfinite_rollback:
                break  # the whole update is undone: no point in more steps
            order = torch.randperm(n_local, device=rollout["responses"].device)
            for mb_start in range(0, n_local, mb_size):
                mb_idx = order[mb_start : mb_start + mb_size]
                # Global counts of the mini-batch: every loss is a global mean, whatever the split
                tokens, seqs = reduce_sum_count(
                    rollout["response_mask"][mb_idx].sum().double(),
                    torch.tensor(float(len(mb_idx)), dtype=torch.float64, device=acc.device),
                    acc,
                )
                counts = dict(num_tokens=tokens, num_seqs=seqs)
                nonfinite = torch.zeros((), dtype=torch.float64, device=acc.device)
                for micro_start in range(0, mb_size, micro):
                    idx = mb_idx[micro_start : micro_start + micro]
                    last_micro = micro_start + micro >= mb_size
                    sync = nullcontext() if last_micro or world == 1 else acc.no_sync(model)
                    with sync:
                        loss, parts = self._micro_batch_loss(rollout, idx, counts, coef, loss_modes)
                        nonfinite += (~torch.isfinite(loss.detach())).double()
                        # DDP averages gradients over ranks; the loss is normalised by global counts. A non-finite
                        # loss still goes through backward on every rank (DDP stays in step); its gradients are
                        # dropped below, before they reach the weights.
                        scale = world * (args.gradient_accumulation_steps if self.is_deepspeed_enabled else 1)
                        acc.backward(loss * scale)
                    for name, (total, count) in parts.items():
                        stats.add(name, total, count)
                # one collective (and one host sync) per optimizer step: did any rank see a non-finite loss?
                bad, _ = reduce_sum_count(nonfinite, 1.0, acc)
                mb_skipped = bad.item() > 0
                grad_norm = None
                if args.max_grad_norm and args.max_grad_norm > 0 and not mb_skipped:
                    grad_norm = acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)).all():
                        mb_skipped = True
                if mb_skipped:
                    skipped = True
                    self.optimizer.zero_grad(set_to_none=True)
                    if args.nonfinite_rollback:
                        break
                    continue
                self.optimizer.step()
                applied += 1
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if grad_norm is not None:
                    stats.add("train/grad_norm", torch.as_tensor(grad_norm, dtype=torch.float64) / world, 1.0 / world)
        metrics = stats.means(acc)
        metrics["_skipped"], metrics["_applied_steps"] = skipped, applied
        return metrics

    def _snapshot_optimisation(self) -> dict:
        """Copies of the trainable weights, the optimizer state and the scheduler state (for a rollback). With
        LoRA this is small; for full fine-tuning it is one more copy of the weights and of the optimizer state."""
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        return {
            "params": {n: p.detach().clone() for n, p in unwrapped.named_parameters() if p.requires_grad},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None,
        }

    @torch.no_grad()
    def _restore_optimisation(self, snapshot: dict) -> None:
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        params = dict(unwrapped.named_parameters())
        for name, value in snapshot["params"].items():
            params[name].copy_(value)
        self.optimizer.load_state_dict(snapshot["optimizer"])
        if snapshot["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(snapshot["scheduler"])

    def _micro_batch_loss(self, rollout: dict, idx: torch.Tensor, counts: dict, coef: float, loss_modes: bool):
        """Loss of one micro-batch, normalised by the mini-batch's GLOBAL counts, and its logging parts."""
        args = self.args
        ctx = rollout["context_length"]
        qr, attn = rollout["query_responses"][idx], rollout["attention_mask"][idx]
        resp, mask = rollout["responses"][idx], rollout["response_mask"][idx]
        old_logp, ref_logp = rollout["logp"][idx], rollout["ref_logp"][idx]
        advantages, returns, old_values = rollout["advantages"][idx], rollout["returns"][idx], rollout["values"][idx]
        pos = position_ids_from_mask(attn)

        logits, values = self.model_wrapped(qr, attention_mask=attn, position_ids=pos, logits_to_keep=resp.shape[1] + 1)
        logits = response_logits(logits, resp.shape[1], args.temperature, self.suppressed_ids)
        values = values[:, ctx - 1 : -1].float()
        logp = response_logprobs(logits, resp)

        pg_tok, pg_clipped, log_ratio = clipped_policy_loss(logp, old_logp, advantages, args.cliprange)
        vf_tok, vf_clipped = clipped_value_loss(values, old_values, returns, args.cliprange_value)
        pg_loss = aggregate_loss(pg_tok, mask, "token-mean", num_tokens=counts["num_tokens"])
        vf_loss = aggregate_loss(vf_tok, mask, "token-mean", num_tokens=counts["num_tokens"])
        loss = pg_loss + args.vf_coef * vf_loss
        fmask = mask.to(logp.dtype)
        n_tok = fmask.sum()
        # Each micro-batch holds a share of its mini-batch's global mean: summed over micro-batches and
        # ranks, the shares give one value per optimizer step.
        share = 1.0 / (args.gradient_accumulation_steps * self.accelerator.num_processes)
        parts = {
            "loss/policy": (pg_loss.detach(), share),
            "loss/value": (vf_loss.detach(), share),
            "policy/approxkl": ((0.5 * log_ratio.detach() ** 2 * fmask).sum(), n_tok),
            "policy/clipfrac": ((pg_clipped.to(fmask.dtype) * fmask).sum(), n_tok),
            "val/clipfrac": ((vf_clipped.to(fmask.dtype) * fmask).sum(), n_tok),
        }
        with torch.no_grad():
            parts["policy/entropy"] = ((entropy_from_logits(logits.detach()) * fmask).sum(), n_tok)
        if loss_modes:
            if args.kl_estimator == FULL_KL:
                with torch.no_grad():
                    unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
                    ref_logits = self._reference_logits(unwrapped, qr, attn, pos, resp.shape[1])
                kl = full_kl(logits, ref_logits, chunk_size=args.full_kl_chunk_size)
            else:
                kl = self._configured_kl(logp, ref_logp, old_logp=old_logp)
            kl_term = kl_loss(kl, mask, coef, args.kl_loss_agg_mode, **counts, norm_len=mask.shape[1])
            loss = loss + kl_term
            parts["loss/kl"] = (kl_term.detach(), share)
        return loss, parts

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

    # ------------------------------------------------------------------ non-finite handling
    def _record_nonfinite(self, what: str, outcome: str) -> dict[str, float]:
        self.nonfinite_skips += 1
        self.consecutive_nonfinite += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_world_process_zero():
            logger.warning(
                "Skipped PPO update %d: non-finite values in %s (%d skipped so far); %s.",
                self.state.global_step + 1,
                what,
                self.nonfinite_skips,
                outcome,
            )
        if self.consecutive_nonfinite >= self.args.max_nonfinite_updates:
            raise RuntimeError(
                f"{self.consecutive_nonfinite} PPO updates in a row had non-finite values in {what}; training "
                "stopped (checkpoints already written are intact). Lower the learning rate, set "
                "`kl_value_clamp`, check the reward functions for NaN/inf, or use bf16/fp32 instead of fp16."
            )
        return {"train/skipped_update": 1.0}

    # ------------------------------------------------------------------ diagnostics
    def _maybe_record_samples(self, rollout: dict) -> None:
        n = self.args.num_sample_generations
        if n <= 0 or not self.is_world_process_zero():
            return
        every = max(1, self.state.max_steps // n)
        if self.state.global_step % every != 0:
            return
        rows = [
            {"step": self.state.global_step, "prompt": str(p), "completion": c, "score": float(s)}
            for p, c, s in list(zip(rollout["prompts"], rollout["completions"], rollout["scores"].tolist()))[:4]
        ]
        self.completion_samples.extend(rows)
        if "wandb" in (self.args.report_to or []):
            import wandb

            if wandb.run is not None:
                import pandas as pd

                wandb.log({"completions": wandb.Table(dataframe=pd.DataFrame(rows))})

    @torch.no_grad()
    def evaluate_policy(self) -> dict[str, float]:
        """`eval/perplexity` of the policy on held-out text and, with `eval_dataset`, `eval/scores`."""
        from ..evaluation import heldout_perplexity

        if self.heldout_texts is None:
            from ..data import load_heldout_texts

            self.heldout_texts = load_heldout_texts(max_texts=self.args.heldout_eval_texts)
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        metrics = {
            "eval/perplexity": heldout_perplexity(
                unwrapped.policy, self.processing_class, self.heldout_texts, accelerator=self.accelerator
            )
        }
        if self.eval_prompts is not None:
            n = min(len(self.eval_prompts), self.args.local_rollout_batch_size)
            rank, world = self.accelerator.process_index, self.accelerator.num_processes
            rows = [self.eval_prompts[i] for i in range(rank, n * world, world) if i < len(self.eval_prompts)]
            if rows:
                # a private random stream: evaluating must not change the training run's later rollouts
                devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(self.args.seed + self.state.global_step)
                    rollout = self._rollout(self._collate(rows))
                metrics["eval/scores"] = self._compute_scores(rollout)["objective/scores"]
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the policy (HF format: full model or PEFT adapter), the tokenizer, and every trainable
        weight of the actor-critic (value head / critic included) for resuming."""
        output_dir = output_dir or self.args.output_dir
        if not self._weights_finite():
            if self.is_world_process_zero():
                logger.warning("Not saving to %s: the trainable weights are not finite.", output_dir)
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        if state_dict is None:
            state_dict = unwrapped.state_dict()
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        prefix = "policy."
        policy_sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        unwrapped.policy.save_pretrained(output_dir, state_dict=policy_sd)
        trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k in trainable},
            os.path.join(output_dir, TRAINABLE_STATE_NAME),
        )
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """Write `checkpoint-N` atomically: every file (Trainer's and klppo's) goes into a staging folder that
        is renamed into place only when complete, so a crash mid-save never leaves a partial `checkpoint-N`."""
        if not self._weights_finite():
            if self.is_world_process_zero():
                logger.warning(
                    "Not writing checkpoint %d: the trainable weights are not finite; the last checkpoint is kept.",
                    self.state.global_step,
                )
            return
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR)
        staged = os.path.join(staging_root, name)
        if self.args.should_save and os.path.isdir(staged):
            shutil.rmtree(staged)  # left by a save that was interrupted
        self._get_output_dir = lambda trial=None: staging_root  # Trainer writes (and rotates) inside staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        if self.args.should_save:
            with open(os.path.join(staged, CONTROLLER_STATE_NAME), "w") as f:
                json.dump(self._klppo_state(), f, indent=2)
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are in place
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            shutil.rmtree(staging_root, ignore_errors=True)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _weights_finite(self) -> bool:
        """Whether every trainable weight is finite (identical on every rank: the weights are)."""
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        return all(bool(torch.isfinite(p).all()) for p in unwrapped.parameters() if p.requires_grad)

    def _klppo_state(self) -> dict:
        return {
            "kl_controller": self.kl_controller.state_dict(),
            "drift_monitor": self.drift_monitor.state_dict() if self.drift_monitor is not None else None,
            "health_monitor": self.health_monitor.state_dict(),
            "nonfinite_skips": self.nonfinite_skips,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "settings": {name: getattr(self.args, name) for name in RESUME_REFUSED + RESUME_COMBINED + RESUME_IGNORED},
        }

    def _check_resume_settings(self, saved: dict | None) -> None:
        """Compare the checkpoint's KL and optimisation settings with this run's: refuse what cannot be combined,
        warn (naming each field and both values) about what is combined or ignored."""
        if not saved:
            return
        changed = {
            k: (v, getattr(self.args, k)) for k, v in saved.items() if hasattr(self.args, k) and v != getattr(self.args, k)
        }
        refused = {k: v for k, v in changed.items() if k in RESUME_REFUSED}
        if refused:
            listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in refused.items())
            raise ResumeMismatch(
                f"Cannot resume with changed settings ({listed}): the checkpoint's controller state and KL statistic "
                "were built for the old ones. Resume with the checkpoint's values, or start a new run."
            )
        for key, (old, new) in changed.items():
            if key in RESUME_COMBINED:
                how = "the new value is used with the checkpoint's coefficient and controller state"
            else:
                how = "ignored: the checkpoint's saved state (coefficient, optimizer, scheduler) decides"
            if self.is_world_process_zero():
                logger.warning("Resuming with %s changed from %r to %r: %s.", key, old, new, how)

    def latest_checkpoint(self) -> str | None:
        """The newest complete klppo checkpoint in `output_dir` (None if there is none). Incomplete folders,
        such as one an older version left behind when it crashed while saving, are skipped with a warning."""
        import re

        root = self.args.output_dir
        if not os.path.isdir(root):
            return None
        found = sorted(
            (int(m.group(1)), entry)
            for entry in os.listdir(root)
            if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", entry)) and os.path.isdir(os.path.join(root, entry))
        )
        for _, entry in reversed(found):
            folder = os.path.join(root, entry)
            missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(folder, f))]
            if not missing:
                return folder
            logger.warning("Skipping incomplete checkpoint %s (missing %s).", folder, ", ".join(missing))
        return None

    def _resume(self, checkpoint: str) -> None:
        """Restore weights, optimizer, scheduler, trainer state, RNG and the KL controller."""
        from safetensors.torch import load_file
        from transformers.trainer_callback import TrainerState

        path = os.path.join(checkpoint, TRAINABLE_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"{checkpoint} is not a klppo checkpoint ({TRAINABLE_STATE_NAME} is missing).")
        with open(os.path.join(checkpoint, CONTROLLER_STATE_NAME)) as f:
            state = json.load(f)
        self._check_resume_settings(state.get("settings"))  # before anything is loaded
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        missing = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
        weights = load_file(path, device="cpu")
        missing -= set(weights)
        if missing:
            raise ValueError(f"Checkpoint {checkpoint} lacks trainable weights: {sorted(missing)[:5]}...")
        unwrapped.load_state_dict(weights, strict=False)
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_rng_state(checkpoint)
        max_steps = self.state.max_steps
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max_steps)
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.drift_monitor is not None and state.get("drift_monitor"):
            self.drift_monitor.load_state_dict(state["drift_monitor"])
        self.health_monitor.load_state_dict(state.get("health_monitor") or {})
        self.nonfinite_skips = state.get("nonfinite_skips", 0)
        self.consecutive_nonfinite = state.get("consecutive_nonfinite", 0)
        logger.info(
            "Resumed from %s at update %d with KL coefficient %.6g",
            checkpoint,
            self.state.global_step,
            self.kl_controller.value,
        )


# ---------------------------------------------------------------------- module helpers
def _now(accelerator) -> float:
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize(accelerator.device)
    return time.perf_counter()


@contextmanager
def _timed(timings: dict, key: str, accelerator):
    start = _now(accelerator)
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + _now(accelerator) - start


@contextmanager
def _clear_sampling_errors():
    """Sampling from a policy whose logits are NaN or inf fails deep inside torch; say what it means."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()
        if "inf" in text or "nan" in text:
            raise RuntimeError(
                "The policy's logits are not finite, so no response can be sampled: its weights have diverged. "
                "Lower the learning rate or max_grad_norm, raise the KL coefficient, or use bf16/fp32 instead of "
                "fp16; resume from the last checkpoint (checkpoints written so far are intact)."
            ) from err
        raise


def reward_values(raw, expected: int, name: str) -> list[float | None]:
    """Check one reward function's result and turn it into floats (None stays None: "not applicable").

    A reward function returns one number (or None) per completion; anything else is a bug in it, reported
    with its name, the expected length and what it returned.
    """
    fix = f"return a list of {expected} numbers (None for samples the function does not apply to)"
    if raw is None or isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__"):
        raise ValueError(f"Reward function {name!r} returned {type(raw).__name__} {raw!r:.80}; {fix}.")
    if torch.is_tensor(raw):
        raw = raw.detach().flatten().tolist()
    if len(raw) != expected:
        raise ValueError(f"Reward function {name!r} returned {len(raw)} values for {expected} completions; {fix}.")
    out: list[float | None] = []
    for i, v in enumerate(raw):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (str, bytes)) or (torch.is_tensor(v) and v.numel() != 1):
            raise ValueError(f"Reward function {name!r} returned {type(v).__name__} {v!r:.60} for completion {i}; {fix}.")
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise ValueError(
                f"Reward function {name!r} returned {type(v).__name__} {v!r:.60} for completion {i}; {fix}."
            ) from None
    return out


def default_learning_rate(model, peft_config=None) -> float:
    """The learning rate used when none is set: LoRA's (a `peft_config`, or a model that is already a PEFT
    model) or full fine-tuning's."""
    lora = peft_config is not None or hasattr(model, "peft_config")
    return DEFAULT_LORA_LEARNING_RATE if lora else DEFAULT_FULL_LEARNING_RATE


def _load_causal_lm(path: str):
    from ..models import load_causal_lm

    return load_causal_lm(path)


def _load_tokenizer(path: str):
    from ..models import load_tokenizer

    return load_tokenizer(path)


_WANDB_NOTICE_GIVEN = False


def _maybe_offline_wandb(args: KLPPOConfig) -> None:
    """With wandb in `report_to` and no credentials, log offline (and say so once) instead of failing."""
    global _WANDB_NOTICE_GIVEN
    if "wandb" not in (args.report_to or []) or os.environ.get("WANDB_MODE"):
        return
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = os.path.expanduser("~/.netrc")
    if not has_key and os.path.exists(netrc):
        with open(netrc) as f:
            has_key = "api.wandb.ai" in f.read()
    if not has_key:
        os.environ["WANDB_MODE"] = "offline"
        if not _WANDB_NOTICE_GIVEN:
            warnings.warn(
                "wandb has no credentials here: logging offline to ./wandb (sync later with `wandb sync`).",
                stacklevel=3,
            )
            _WANDB_NOTICE_GIVEN = True
