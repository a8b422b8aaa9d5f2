"""`KLPPOTrainer`: PPO for causal LMs with KL control, on transformers' `Trainer` and accelerate.

One PPO update (`ppo_update`), each step a public method that returns a typed result (`klppo.ppo.steps`):

1. sample prompts, generate responses                        `rollout`
2. truncate at the stop token, build masks                   `rollout`
3. score: policy / reference log-probs, values               `rollout` (`score`, in `scoring.py`)
4. rewards, missing-EOS penalty                              `compute_rewards`
5. KL: every estimator logged, the configured one applied    `apply_kl`
6. controller update from the globally reduced statistic     `apply_kl`
7. advantages (GAE, or critic-free RLOO / GRPO), whitening   `compute_advantages`
8. PPO epochs over mini-batches                              `optimise`
9. log, evaluate, checkpoint                                 `train`

Every statistic is reduced across ranks as `(sum, count)` (`klppo.kl.GlobalSums`), so each rank logs, and the
controller sees, the same global value.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch import nn
from torch.profiler import record_function
from transformers import PreTrainedTokenizerBase, Trainer, set_seed
from transformers.trainer_callback import ProgressCallback
from trl.models.utils import unwrap_model_for_generation

from ..kl import (
    GlobalSums,
    check_same_on_all_ranks,
    KLDriftMonitor,
    build_kl_controller,
    estimate_kl,
    get_kl_estimator_spec,
    global_masked_whiten,
    kl_loss,
    kl_reward,
    kl_statistic,
    reduce_sum_count,
)
from ..kl.reduce import all_reduce_sum
from ..rewards import combine_rewards, load_reward_funcs, reward_func_name
from .advantages import gae_advantages, sequence_advantages
from .build import build_models, check_trainer_inputs, default_learning_rate, load_policy_and_tokenizer, prepare_frozen
from .callbacks import KLProgressCallback, maybe_offline_wandb, now, record_samples, timed
from .checkpoint import CheckpointMixin
from .loop import TrainingLoopMixin
from .config import KL_LOSS_MIN_ADVANTAGE_STD, KLPPOConfig
from .engines import root_unsharded
from .guard import LOWER, UPPER, build_kl_guard, reset_momentum
from .health import NonfiniteGuard, PPOHealthMonitor, TrainingDiverged, policy_outputs_finite, rollout_outputs_finite
from .losses import ppo_losses
from .rollback import restore_optimisation, snapshot_optimisation
from .scoring import ScoringMixin
from .rollout import (
    DIVERGED_SAMPLING,
    StaticCaches,
    collate_prompts,
    ends_with_stop,
    generate_responses,
    position_ids_from_mask,
    response_logits,
    response_logprobs,
    sampling_setup,
    supports_static_cache,
    truncate_at_stop,
)
from .steps import Advantages, KLPenalty, OptimiseResult, PromptBatch, Rewards, Rollout, Sequences

logger = logging.getLogger(__name__)

LOGGED_ESTIMATORS = ("k1", "k2", "k3")  # logged whatever the configured estimator (TRL issue 1161)


class KLPPOTrainer(ScoringMixin, TrainingLoopMixin, CheckpointMixin, Trainer):
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
        args = check_trainer_inputs(args, train_dataset, reward_funcs)
        set_seed(args.seed)  # value heads and copies are created below, before Trainer seeds
        maybe_offline_wandb(args)
        given_path = model if isinstance(model, str) else None
        model, _, processing_class = load_policy_and_tokenizer(model, processing_class)
        specs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.reward_funcs, self.reward_weights = load_reward_funcs(specs, args.reward_weights, policy_tokenizer=processing_class)
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        if args.learning_rate is None:
            args.learning_rate = default_learning_rate(model, peft_config)
            logger.info("learning_rate not set: %g (the default for this kind of fine-tuning)", args.learning_rate)
        actor_critic, self.ref_model, self.use_adapter_reference, self.ref_adapter_name = build_models(
            model, given_path, args, ref_model, value_model, peft_config, self.reward_funcs,
            ref_adapter_name=getattr(args, "ref_adapter_name", None),
        )  # fmt: skip
        if args.activation_checkpointing:
            actor_critic.activation_checkpointing_enable(args.activation_checkpointing_kwargs)
            args.activation_checkpointing = args.gradient_checkpointing = False  # done; not for Trainer to redo
        self.heldout_texts, self.eval_prompts = heldout_texts, eval_dataset
        # Trainer insists on an eval_dataset when eval_strategy is set; evaluation here is held-out perplexity
        # (+ eval prompts when given), so a one-row placeholder satisfies that check.
        placeholder = train_dataset.select(range(1)) if args.eval_strategy != "no" else None
        super().__init__(
            model=actor_critic, args=args, data_collator=lambda features: features, train_dataset=train_dataset,
            eval_dataset=eval_dataset if eval_dataset is not None else placeholder,
            processing_class=processing_class, callbacks=callbacks,
        )  # fmt: skip
        self.remove_callback(ProgressCallback)
        if not self.args.disable_tqdm:
            self.add_callback(KLProgressCallback())
        self._init_kl_control()
        self._place_frozen_models()
        policy_generation_config = getattr(self.model.policy, "generation_config", None)
        self.stop_token_id, self.suppressed_ids, self.generation_config = sampling_setup(
            self.args, self.processing_class, policy_generation_config
        )
        self.static_caches = self._static_caches()

    def _static_caches(self) -> StaticCaches | None:
        """The static KV caches of `cache_implementation="static"`, or None (the dynamic cache): also None, with one
        log line, for a model that transformers does not mark as compilable and under DeepSpeed or FSDP, whose
        gathered weights are not the same tensors from one rollout to the next."""
        if self.args.cache_implementation != "static":
            return None
        policy = self.accelerator.unwrap_model(self.model).policy
        why = None
        if not supports_static_cache(policy):
            why = f"{type(policy).__name__} is not marked as compilable by transformers"
        elif self.is_deepspeed_enabled or self.is_fsdp_enabled:
            why = "DeepSpeed and FSDP gather the weights anew for every rollout"
        if why:
            logger.warning("cache_implementation='static' is not used: %s; generation keeps the dynamic cache.", why)
            return None
        return StaticCaches(policy.config, self.args.max_prompt_length + self.args.response_length)

    def _init_kl_control(self) -> None:
        args = self.args
        self.kl_estimator = get_kl_estimator_spec(args.kl_estimator)
        self.kl_statistic_spec = get_kl_estimator_spec(args.kl_statistic)
        self.kl_controller = build_kl_controller(args)
        self.kl_guard = build_kl_guard(args.kl_guard, args.kl_target)
        self.drift_monitor = KLDriftMonitor(args.kl_target, patience=args.kl_drift_patience) if args.kl_target else None
        self.health_monitor = PPOHealthMonitor(patience=args.health_patience)
        self.nonfinite_guard = NonfiniteGuard(args.max_nonfinite_updates)
        self.completion_samples: list[dict] = []
        logger.info("KL applied in: %s (estimator %s, controller %s, statistic %s in unit: %s)", args.kl_mode,
                    args.kl_estimator, args.kl_controller, args.kl_statistic, args.kl_target_unit)  # fmt: skip

    def _place_frozen_models(self) -> None:
        """Reference and reward models live beside the policy (sharded under ZeRO-3 / FSDP)."""
        if self.ref_model is not None:
            self.ref_model = prepare_frozen(self.ref_model, self)
        for fn in self.reward_funcs:
            if isinstance(getattr(fn, "model", None), nn.Module):
                fn.model = prepare_frozen(fn.model, self)

    # ------------------------------------------------------------------ data
    def prompt_batch(self, prompts: list) -> PromptBatch:
        """Prompts (strings or conversations) or dataset rows (dicts with a `prompt` key) as one batch."""
        rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
        return collate_prompts(rows, self.processing_class, self.args.max_prompt_length)

    def ppo_update(self, batch: PromptBatch) -> dict[str, float]:
        """One PPO update on a batch of prompts; returns its logged metrics."""
        timings: dict[str, float] = defaultdict(float)
        lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self.args.learning_rate
        start = now(self.accelerator)
        rollout = self.rollout(batch, timings)  # steps 1-3
        undone = self._settle_last_update(rollout)
        if undone:  # the last update left non-finite outputs and was undone: sample again from the policy before it
            rollout = self.rollout(batch, timings)
        with timed(timings, "time/reward", self.accelerator):
            rewards = self.compute_rewards(rollout)  # step 4
        with timed(timings, "time/kl", self.accelerator):
            penalty = self.apply_kl(rollout, rewards)  # steps 5-6
        metrics = {**rewards.metrics, **penalty.metrics, **(undone or {})}
        if not penalty.finite:
            metrics.update(self._record_nonfinite("rollout scores or KL", "no optimizer step was taken"))
        else:
            with timed(timings, "time/advantages", self.accelerator):
                advantages = self.compute_advantages(rollout, rewards, penalty)  # step 7
            snapshot = None
            if self.rollback_updates:
                with timed(timings, "time/rollback_snapshot", self.accelerator):
                    snapshot = snapshot_optimisation(self.accelerator.unwrap_model(self.model_wrapped), self.optimizer, self.lr_scheduler)
            with timed(timings, "time/optimise", self.accelerator):
                result = self.optimise(rollout, advantages, kl_reading=penalty.metrics["kl/value"])  # step 8
            metrics.update(result.metrics, **advantages.metrics)
            metrics.update(self._after_optimise(result, snapshot, rollout))
            self._checked_rows = rollout.sequences()  # what a forward check before a save reads
        timings["time/update"] = now(self.accelerator) - start
        metrics.update(timings, **{"train/nonfinite_skips": float(self.nonfinite_skips), "lr": lr})
        for message in self.health_monitor.update(metrics):
            if self.is_world_process_zero():
                logger.warning(message)
        record_samples(self, rollout.prompts, rewards)
        return metrics

    @functools.cached_property
    def rollback_updates(self) -> bool:
        """Whether a non-finite step undoes its whole update: `nonfinite_rollback`, or when that is None, whether
        the trainable weights (policy and critic) are at most 10% of all weights, as with LoRA and the shared
        critic, so that the copy it takes is small. Counted over all ranks (FSDP shards the weights), so every rank
        decides the same. Never under DeepSpeed, whose optimizer state is sharded."""
        if self.is_deepspeed_enabled:  # sharded optimizer state: DeepSpeed drops a non-finite step itself
            return False
        if self.args.nonfinite_rollback is not None:
            return bool(self.args.nonfinite_rollback)
        trainable = total = 0
        for p in self.accelerator.unwrap_model(self.model_wrapped).parameters():
            n = p.numel()  # the full size, also of an FSDP2 DTensor shard
            trainable, total = trainable + (n if p.requires_grad else 0), total + n
        counts = torch.tensor([trainable, total], dtype=torch.float64, device=self.accelerator.device)
        trainable, total = all_reduce_sum(counts, self.accelerator).tolist()
        return 10 * trainable <= total

    def _after_optimise(self, result: OptimiseResult, snapshot: dict | None, rollout: Rollout) -> dict[str, float]:
        """Roll back (or report) an update stopped by a non-finite loss or gradient. An update whose steps went
        through is checked later, by the forward passes that run anyway (`_settle_last_update`): its `snapshot` is
        kept until then."""
        if not result.skipped:
            self._unsettled = (self.state.global_step + 1, result.applied_steps, snapshot)
            return {}
        if snapshot is not None:
            restore_optimisation(snapshot, self.accelerator.unwrap_model(self.model_wrapped), self.optimizer, self.lr_scheduler)
            outcome = "the weights and optimizer state were restored to the start of the update"
        else:
            self._unsettled = (self.state.global_step + 1, result.applied_steps, None)  # partly applied: check it
            outcome = f"{result.applied_steps} optimizer step(s) of this update had already been applied"
        return self._record_nonfinite("the loss or its gradient", outcome)

    def _settle_last_update(self, rollout: Rollout | None = None) -> dict[str, float] | None:
        """Check the policy that the last update left, with forward passes that run anyway: the next rollout's
        (`rollout`: its sampling logits, its log-probs and values), which settles it; before a save and at the end
        of training, a forward pass over the last rollout's sequences. An optimizer step can leave finite weights
        whose logits overflow on some inputs (a learning rate far too high): the weights alone do not tell.
        Finite: nothing to do (None). Not finite: the update is undone from its copy, and the metrics of the skip
        are returned; without a copy training stops (`TrainingDiverged`, nothing saved from then on). Decided alike
        on every rank."""
        if getattr(self, "_unsettled", None) is None:
            return None
        step, applied, snapshot = self._unsettled
        if rollout is not None:
            finite = rollout_outputs_finite(rollout, self.accelerator)
        else:  # the next rollout checks again
            finite = policy_outputs_finite(self.model_wrapped, self._checked_rows, self.accelerator,
                                           self.args.rollout_forward_batch_size)  # fmt: skip
            if finite:
                return None
        self._unsettled = None
        if finite:
            self.nonfinite_guard.reset()
            return None
        if snapshot is None:
            self.nonfinite_guard.policy_diverged(step, applied, self.args)
        restore_optimisation(snapshot, self.accelerator.unwrap_model(self.model_wrapped), self.optimizer, self.lr_scheduler)
        return self._record_nonfinite(f"the policy's logits or values after update {step}",
                                      "the weights and optimizer state were restored to the start of that update",
                                      step=step)  # fmt: skip

    # ------------------------------------------------------------------ steps 1-3: rollout
    @torch.no_grad()
    def rollout(self, batch: PromptBatch, timings: dict | None = None) -> Rollout:
        """Steps 1-3: sample responses, truncate them at the stop token, score them. The sampling policy's
        log-probs (and a shared critic's values) are read from generation, except for a logits-based KL
        estimator or statistic, which needs the policy's logits beside the reference's."""
        timings = timings if timings is not None else defaultdict(float)
        acc = self.accelerator
        input_ids, attention_mask = batch.input_ids.to(acc.device), batch.attention_mask.to(acc.device)
        # a logits-based statistic reads the generation's own logits when they fit in `generation_logits_max_mb`
        keep = self.kl_statistic_spec.needs_logits and self._generation_logits_fit()
        reuse = self.logprobs_from_generation and not self.kl_estimator.needs_logits and (
            keep or not self.kl_statistic_spec.needs_logits)  # fmt: skip
        with timed(timings, "time/generation", acc):
            with unwrap_model_for_generation(self.model_wrapped, acc) as unwrapped, \
                    root_unsharded(self.model_wrapped), self._sampling_form(unwrapped.policy):  # fmt: skip
                generated = generate_responses(
                    unwrapped.policy, input_ids, attention_mask, self.generation_config, with_logprobs=reuse,
                    value_head=unwrapped.value_head if reuse else None, keep_logits=keep and reuse,
                    synced=self.is_fsdp_enabled and acc.num_processes > 1, check_finite=False,
                    cache=self.static_caches(input_ids.shape[0]) if self.static_caches else None,
                )  # fmt: skip
        responses, response_mask = truncate_at_stop(generated.tokens, self.stop_token_id, self.processing_class.pad_token_id)
        sequences = Sequences(
            prompts=batch.prompts, extra=batch.extra, query_responses=torch.cat([input_ids, responses], dim=1),
            attention_mask=torch.cat([attention_mask, response_mask], dim=1), responses=responses,
            response_mask=response_mask, context_length=input_ids.shape[1], sampled_finite=generated.finite,
        )  # fmt: skip
        return self.score(sequences, logp=generated.logp, values=generated.values, timings=timings,
                          policy_logits=generated.logits)  # fmt: skip

    # ------------------------------------------------------------------ step 4: rewards
    @torch.no_grad()
    def compute_rewards(self, rollout: Sequences) -> Rewards:
        """Step 4: decode the completions, call the reward functions, combine them by weight."""
        mask = rollout.response_mask
        completion_ids = [r[m.bool()].tolist() for r, m in zip(rollout.responses, mask)]
        completions = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompt_mask = rollout.attention_mask[:, : rollout.context_length].bool()
        prompt_ids = [q[m].tolist() for q, m in zip(rollout.query_responses[:, : rollout.context_length], prompt_mask)]
        scores, applicable, per_function = combine_rewards(
            self.reward_funcs, self.reward_weights, self.reward_func_names, rollout.prompts, completions,
            completion_ids, {**rollout.extra, "prompt_ids": prompt_ids}, self.accelerator.device,
        )  # fmt: skip
        if not bool(applicable.all()) and self.is_world_process_zero():
            logger.warning(
                "%d of %d completions got None from every reward function: they get score 0 and no policy "
                "gradient (advantage 0), as in TRL. Make sure at least one reward function scores every sample.",
                int((~applicable).sum()), len(completions),
            )  # fmt: skip
        scores = scores.float()
        has_stop = ends_with_stop(rollout.responses, mask, self.stop_token_id)
        if self.args.missing_eos_penalty is not None:
            scores = torch.where(has_stop, scores, scores - self.args.missing_eos_penalty)
        stats = GlobalSums()
        for name, (total, count) in per_function.items():
            stats.add(f"rewards/{name}", total, count)
        stats.add("objective/scores", scores.sum(), scores.numel())
        if self.stop_token_id is not None:  # fixed-length responses never end with a stop token
            stats.add("objective/eos_frac", has_stop.float().sum(), has_stop.numel())
        stats.add("objective/response_length", mask.sum(), mask.shape[0])
        return Rewards(completions, scores, applicable, stats.means(self.accelerator))

    # ------------------------------------------------------------------ steps 5-6: KL and controller
    @torch.no_grad()
    def apply_kl(self, rollout: Rollout, rewards: Rewards) -> KLPenalty:
        """Steps 5-6: the configured estimator per token, in the rewards (score at the last response token) when
        `kl_mode` applies it there; then one controller update from the globally reduced statistic."""
        args, acc, mask = self.args, self.accelerator, rollout.response_mask
        stats = GlobalSums()
        per_seq_count = mask.shape[0] if args.kl_target_unit == "sequence" else mask.sum()
        for name in LOGGED_ESTIMATORS:
            values = estimate_kl(name, rollout.logp, rollout.ref_logp, log_ratio_clamp=args.kl_log_ratio_clamp)
            stats.add(f"kl/{name}", (values * mask).sum(), per_seq_count)
        if rollout.logits_kl is not None:
            kl, clamped = rollout.logits_kl, torch.zeros_like(mask, dtype=torch.bool)
        else:
            kl, clamped = self._estimate_kl(rollout.logp, rollout.ref_logp, rollout.logp, return_clamped=True)
        stats.add("kl/clamped_frac", (clamped & mask.bool()).sum(), mask.sum())
        coef = self.kl_controller.value
        non_score = kl_reward(kl, mask, coef) if "reward" in args.kl_modes_applied else torch.zeros_like(kl)
        per_token = non_score.clone()
        last = mask.sum(dim=1) - 1
        per_token[torch.arange(per_token.shape[0], device=per_token.device), last] += rewards.scores
        stats.add("objective/non_score_reward", non_score.sum(), mask.shape[0])
        stats.add("objective/rlhf_reward", per_token.sum(), mask.shape[0])
        nonfinite, _ = reduce_sum_count((~torch.isfinite(per_token)).sum(), 0, acc)
        statistic = self._statistic_per_token(rollout, kl)
        if args.kl_statistic not in LOGGED_ESTIMATORS:
            stats.add(f"kl/{args.kl_statistic}", (statistic * mask).sum(), per_seq_count)
        metrics = stats.means(acc)
        value = kl_statistic(statistic, mask, unit=args.kl_target_unit, accelerator=acc).item()
        finite = math.isfinite(value) and nonfinite.item() == 0
        if finite:
            if hasattr(self.kl_controller, "observe_sequences"):
                self._observe_sequences(rollout, rewards)
            self._update_controller(value, mask.shape[0] * acc.num_processes)
        metrics.update({"kl/value": value, "kl/coef": coef, "kl/coef_next": self.kl_controller.value})
        if finite and hasattr(self.kl_controller, "metrics"):
            metrics.update(self.kl_controller.metrics())
        if args.kl_target:
            metrics.update({"kl/target": args.kl_target, "kl/error": (value - args.kl_target) / args.kl_target})
        return KLPenalty(kl, per_token, coef, finite, metrics)

    def _observe_sequences(self, rollout: Rollout, rewards: Rewards) -> None:
        """Give a controller that reads the batch itself every scored sequence's score, summed log-ratio to the
        reference (k1 over its tokens) and length, gathered over all ranks in rank order (the same on every rank).
        Sequences no reward function scored are left out: they get no policy gradient."""
        mask = rollout.response_mask
        log_ratio = ((rollout.logp - rollout.ref_logp).double() * mask).sum(dim=1)
        table = torch.stack([rewards.scores.double(), log_ratio, mask.sum(dim=1).double(),
                             rewards.scorable.double()], dim=1)  # fmt: skip
        table = self.accelerator.gather(table).cpu()
        table = table[table[:, 3] > 0]
        self.kl_controller.observe_sequences(table[:, 0], table[:, 1], table[:, 2], unit=self.args.kl_target_unit)

    def _statistic_per_token(self, rollout: Rollout, kl: torch.Tensor) -> torch.Tensor:
        """`kl_statistic` per token: the configured estimator's values when they are the same estimator, else
        the statistic's own (scored from logits, or from the log-probs)."""
        args = self.args
        if args.kl_statistic == args.kl_estimator:
            return kl
        if rollout.statistic_kl is not None:
            return rollout.statistic_kl
        return estimate_kl(args.kl_statistic, rollout.logp, rollout.ref_logp, old_logp=rollout.logp,
                           log_ratio_clamp=args.kl_log_ratio_clamp, value_clamp=args.kl_value_clamp)  # fmt: skip

    def _update_controller(self, statistic: float, n_sequences: int) -> None:
        """Step 6 on every rank alike (the statistic is global); the drift monitor sees the same value, and the
        guard's low side arms once a reading reaches its bound."""
        self.kl_controller.update(statistic, n_steps=n_sequences)
        self.kl_guard.observe(statistic)
        check_same_on_all_ranks(self.kl_controller.value, self.accelerator, "KL coefficient")
        if self.drift_monitor is not None:
            message = self.drift_monitor.update(statistic)
            if message and self.is_world_process_zero():
                logger.warning(message)

    def _estimate_kl(self, logp=None, ref_logp=None, old_logp=None, logits=None, ref_logits=None, return_clamped=False):
        """The configured estimator with the configured clamps (`klppo.kl.estimate_kl`)."""
        args = self.args
        return estimate_kl(
            args.kl_estimator, logp, ref_logp, old_logp=old_logp, logits=logits, ref_logits=ref_logits,
            chunk_size=args.full_kl_chunk_size, return_clamped=return_clamped,
            log_ratio_clamp=args.kl_log_ratio_clamp, value_clamp=args.kl_value_clamp,
        )  # fmt: skip

    # ------------------------------------------------------------------ step 7: advantages
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout, rewards: Rewards, penalty: KLPenalty) -> Advantages:
        """Step 7: GAE over the per-token rewards (or, critic-free, RLOO / GRPO on each sequence's return, the same
        on every token), whitened with global statistics (not GRPO's, normalised per group already). Samples no
        reward function applied to carry no policy gradient (advantage 0) and stay out of the whitening."""
        args, acc, mask = self.args, self.accelerator, rollout.response_mask
        per_token = penalty.rewards
        if args.whiten_rewards:
            per_token = global_masked_whiten(per_token, mask, accelerator=acc, shift_mean=False)
        if args.critic_free:  # the sequence's RLHF reward: score + summed KL rewards; groups of num_generations rows
            returns = (per_token * mask).sum(dim=1)
            advantages = sequence_advantages(args.advantage_estimator, returns, args.num_generations)
            advantages, returns = advantages[:, None] * mask, returns[:, None] * mask
        else:
            advantages, returns = gae_advantages(per_token, rollout.values, mask, args.gamma, args.lam)
        scorable = rewards.scorable.to(advantages.dtype)[:, None]
        advantages = advantages * scorable
        std = 1.0
        if args.whiten_advantages and args.advantage_estimator != "grpo":
            advantages, std = global_masked_whiten(advantages, mask * scorable, accelerator=acc, return_std=True)
            std = std.item()
        # Whitening divides the policy-gradient term by std(A), so the loss E[A]/std - c * KL maximises
        # E[r] - c * std * KL: a loss-mode coefficient beta / std keeps beta's meaning that of reward mode
        # (std floored: collapsed advantages would leave it at the whitening's epsilon)
        # (GRPO: each group has its own scale; beta weighs KL against the group-normalised reward, as in TRL)
        rescale = args.kl_loss_scale == "advantage_std" and args.advantage_estimator != "grpo"
        scale = max(std, KL_LOSS_MIN_ADVANTAGE_STD) if rescale else 1.0
        kl_loss_coef = penalty.coef / scale
        return Advantages(advantages, returns, kl_loss_coef, {"policy/advantage_std": std})

    # ------------------------------------------------------------------ step 8: optimisation
    def optimise(self, rollout: Rollout, advantages: Advantages, kl_reading: float | None = None) -> OptimiseResult:
        """Step 8: `num_ppo_epochs` passes over shuffled mini-batches, one optimizer step each. A non-finite loss
        or gradient drops that step's gradients and, when updates are rolled back (`rollback_updates`), stops the
        update. The KL guard (`klppo.ppo.guard.KLGuard`) ends the update early once the KL to the reference leaves
        its bounds; `kl_reading` (the rollout's controller statistic) is where its estimate starts."""
        self.model_wrapped.train()
        n_local, mb_size = rollout.batch_size, self.args.local_mini_batch_size
        if n_local % mb_size:
            raise ValueError(f"Rollout batch {n_local} is not a multiple of the mini-batch size {mb_size}.")
        stats, skipped, applied, guarded = GlobalSums(), False, 0, None
        for _epoch in range(self.args.num_ppo_epochs):
            if (skipped and self.rollback_updates) or guarded:
                break  # the whole update is undone (or the guard fired): no point in more steps
            order = torch.randperm(n_local, device=rollout.responses.device)
            for mb_start in range(0, n_local, mb_size):
                status = self._optimizer_step(rollout, advantages, order[mb_start : mb_start + mb_size], stats, applied, kl_reading)
                skipped, applied = skipped or status == "nonfinite", applied + int(status == "applied")
                guarded = status if status in (UPPER, LOWER) else None
                if (status == "nonfinite" and self.rollback_updates) or guarded:
                    break
        metrics = {**stats.means(self.accelerator), **self.kl_guard.metrics(guarded)}
        if "val/ratio_sq" in metrics:  # the ratio's variance over the update's tokens, from its two moments
            metrics["val/ratio_var"] = max(metrics.pop("val/ratio_sq") - metrics["val/ratio"] ** 2, 0.0)
        if guarded and self.is_world_process_zero():
            logger.info(self.kl_guard.describe(guarded, applied))
        return OptimiseResult(metrics, skipped, applied)

    def _optimizer_step(self, rollout: Rollout, advantages: Advantages, mb_idx: torch.Tensor, stats, applied: int = 0,
                        kl_reading: float | None = None) -> str:
        """One mini-batch: gradient accumulation over micro-batches, then one optimizer step. Returns "applied",
        or, with the gradients dropped, "nonfinite" (a rank saw a non-finite loss or gradient norm) or the KL
        guard's verdict ("guard" / "guard_low"). Both are decided, the same on every rank, before the last
        micro-batch's backward pass: under DeepSpeed that pass is the accumulation boundary that reduces the
        gradients and lets its engine step."""
        args, acc, model = self.args, self.accelerator, self.model_wrapped
        micro = args.per_device_train_batch_size
        # Global counts of the mini-batch: every loss is a global mean, whatever the split
        tokens, seqs = reduce_sum_count(rollout.response_mask[mb_idx].sum().double(), float(len(mb_idx)), acc)
        counts = dict(num_tokens=tokens, num_seqs=seqs)
        # non-finite losses; the guard's KL sum and count at the current policy; the same tokens' KL sum at the rollout
        checks = torch.zeros(4, dtype=torch.float64, device=acc.device)
        verdict = None
        for micro_start in range(0, len(mb_idx), micro):
            idx = mb_idx[micro_start : micro_start + micro]
            boundary = micro_start + micro >= len(mb_idx)
            # DDP reduces at the boundary only; DeepSpeed is told the boundary in `_backward` (its ZeRO-2/3 refuse no_sync)
            with nullcontext() if boundary or acc.num_processes == 1 or self.is_deepspeed_enabled else acc.no_sync(model):
                with record_function("klppo/forward"):
                    loss, parts = self.micro_batch_loss(rollout.select(idx), advantages, idx, counts)
                checks[0] += (~torch.isfinite(loss.detach())).double()
                checks[1:3] += torch.stack([torch.as_tensor(x, dtype=torch.float64, device=checks.device)
                                            for x in parts["kl/during_update"]])  # a count in sequences is a host int
                checks[3] += ((rollout.logp[idx].double() - rollout.ref_logp[idx].double()) * rollout.response_mask[idx]).sum()
                if boundary:  # one collective and host sync per step
                    bad, kl_sum, kl_count, kl_rollout = all_reduce_sum(checks, acc).tolist()
                    fired = self.kl_guard.check(kl_sum, kl_count, kl_rollout, kl_reading) if applied > 0 else None
                    verdict = "nonfinite" if bad else fired  # the update's first step always goes ahead
                with record_function("klppo/backward"):
                    self._backward(loss, boundary, discard=verdict is not None)
            for name, (total, count) in parts.items():
                stats.add(name, total, count)
        if verdict is None:
            grad_norm = self._step()
            if grad_norm is not None and math.isfinite(grad_norm):
                stats.add("train/grad_norm", torch.tensor(grad_norm / acc.num_processes, dtype=torch.float64), 1.0 / acc.num_processes)
            verdict = "applied" if grad_norm is None or math.isfinite(grad_norm) else "nonfinite"
        elif self.is_deepspeed_enabled:
            model.step()  # finds the poisoned gradients non-finite: drops them and skips the step
        if verdict in (UPPER, LOWER) and self.kl_guard.clears_momentum and not reset_momentum(self.optimizer):
            logger.warning("kl_guard: the optimizer keeps no exp_avg or momentum_buffer tensor, so its momentum was not "
                           "cleared when the KL guard fired.")  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        return verdict

    def _backward(self, loss: torch.Tensor, boundary: bool, discard: bool = False) -> None:
        """Backward pass of one micro-batch's loss. The loss is this rank's share of the mini-batch's global mean,
        and data parallelism averages gradients over ranks, hence the factor `num_processes`. Under DeepSpeed the
        engine is told where the accumulation boundary is (accelerate would make every micro-batch one) and must
        not rescale by its own accumulation count; `discard` poisons the boundary pass so that the engine's
        overflow check drops the accumulated gradients (DeepSpeed offers no other way to drop them)."""
        loss = loss * self.accelerator.num_processes
        if not self.is_deepspeed_enabled:
            self.accelerator.backward(loss)
            return
        engine = self.model_wrapped
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss * math.nan if discard else loss, scale_wrt_gas=False)

    def _step(self) -> float | None:
        """Clip the gradients and take the optimizer step (and the scheduler's) unless their norm is not finite.
        Returns the gradient norm before clipping (None when it is not measured)."""
        args, acc = self.args, self.accelerator
        if self.is_deepspeed_enabled:  # the engine clips (`gradient_clipping`) and skips non-finite gradients
            self.model_wrapped.step()
            grad_norm = self.model_wrapped.get_global_grad_norm()
        else:
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0:
                with record_function("klppo/clip_grad_norm"):
                    grad_norm = float(acc.clip_grad_norm_(self.model_wrapped.parameters(), args.max_grad_norm))
            if grad_norm is None or math.isfinite(grad_norm):
                with record_function("klppo/optimizer_step"):
                    self.optimizer.step()
        grad_norm = None if grad_norm is None else float(grad_norm)
        if (grad_norm is None or math.isfinite(grad_norm)) and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return grad_norm

    def micro_batch_loss(self, mb: Rollout, advantages: Advantages, idx: torch.Tensor, counts: dict):
        """Loss of one micro-batch `mb` (rows `idx` of the rollout), normalised by the mini-batch's GLOBAL
        counts, and its logging parts `{name: (sum, count)}`."""
        args = self.args
        mask, resp = mb.response_mask, mb.responses
        pos = position_ids_from_mask(mb.attention_mask)
        logits, values = self.model_wrapped(
            mb.query_responses, attention_mask=mb.attention_mask, position_ids=pos, response_length=resp.shape[1]
        )
        logits = response_logits(logits, resp.shape[1], args.temperature, self.suppressed_ids)
        values = values[:, mb.context_length - 1 : -1].float() if values is not None else None
        logp = response_logprobs(logits, resp)
        # Each micro-batch holds a share of its mini-batch's global mean: summed over micro-batches and ranks,
        # the shares give one value per optimizer step.
        share = 1.0 / (args.gradient_accumulation_steps * self.accelerator.num_processes)
        loss, parts = ppo_losses(
            logits, logp, values, mb.logp, mb.values, advantages.advantages[idx], advantages.returns[idx], mask,
            counts["num_tokens"], args, share,
        )  # fmt: skip
        with torch.no_grad():  # the KL statistic at the current policy, for the guard: k1 importance-weighted
            # by pi / pi_old per token (the tokens were sampled by pi_old)
            k1 = torch.exp(logp.detach() - mb.logp) * (logp.detach() - mb.ref_logp) * mask
            count = mask.shape[0] if args.kl_target_unit == "sequence" else mask.sum()
            parts["kl/during_update"] = (k1.sum(), count)
        if "loss" in args.kl_modes_applied:
            kl_term = self._kl_loss_term(mb, logp, logits, advantages.kl_loss_coef, counts)
            loss = loss + kl_term
            parts["loss/kl"] = (kl_term.detach(), share)
        return loss, parts

    def _kl_loss_term(self, mb: Rollout, logp, logits, coef: float, counts: dict) -> torch.Tensor:
        """The loss-mode KL term: the configured estimator at the current policy, aggregated per `kl_loss_agg_mode`."""
        if self.kl_estimator.needs_logits:
            with torch.no_grad():
                ref_logits = self.reference_logits(mb)
            kl = self._estimate_kl(logits=logits, ref_logits=ref_logits)
        else:
            kl = self._estimate_kl(logp, mb.ref_logp, old_logp=mb.logp)
        mask = mb.response_mask
        return kl_loss(kl, mask, coef, self.args.kl_loss_agg_mode, **counts, norm_len=self.args.response_length)

    @property
    def nonfinite_skips(self) -> int:
        """Updates skipped so far because of NaN/inf in the rewards, the KL, a loss or a gradient."""
        return self.nonfinite_guard.skips

    def _record_nonfinite(self, what: str, outcome: str, step: int | None = None) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        step = self.state.global_step + 1 if step is None else step
        return self.nonfinite_guard.record(step, what, outcome, log=self.is_world_process_zero())

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

    def evaluate_policy(self) -> dict[str, float]:
        """`eval/perplexity` of the policy on held-out text and, with `eval_dataset`, `eval/scores`."""
        from ..evaluation import evaluate_policy

        return evaluate_policy(self)
