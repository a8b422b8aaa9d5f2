"""The steps of one PPO update after the rollout, as functions of what they read, each returning a typed result
(`klppo.ppo.results`). `KLPPOTrainer.ppo_update` calls them in order:

4. `compute_rewards`: the reward functions' scores, and the missing-EOS penalty       -> `Rewards`
5. `kl_penalty`: every estimator logged; the configured one in the per-token rewards   -> `KLPenalty`
6. `update_controller`: the controller's step from the globally reduced statistic      -> its metrics
7. `compute_advantages`: GAE (or RLOO / GRPO) and whitening; the KL loss term's weight  -> `Advantages`
8. `micro_batch_loss`, per micro-batch of the PPO epochs: the clipped policy and value losses and the KL term

Every KL decision they follow comes from the run's `KLPlan`, decided once when the trainer is built.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import torch

from ..kl import GlobalSums, aggregate_loss, check_same_on_all_ranks, kl_loss, kl_reward, kl_statistic, reduce_sum_count
from ..kl.reduce import explained_variance, global_masked_whiten, unit_count
from ..rewards import combine_rewards
from .advantages import advantage_slope, gae_advantages, sequence_advantages
from .config import KL_LOSS_MIN_ADVANTAGE_STD
from .generation.sampling import contains_token, ends_with_stop
from .losses import clipped_policy_loss, clipped_value_loss, ppo_statistics
from .plan import LOGGED_ESTIMATORS, KLPlan
from .results import Advantages, KLPenalty, Rewards, Rollout, Sequences
from .safety.step_checks import guard_sample
from .scoring.logprobs import position_ids_from_mask, read_response

logger = logging.getLogger(__name__)


@torch.no_grad()
def compute_rewards(
    rollout: Sequences,
    reward_funcs,
    weights,
    names,
    tokenizer,
    stop_token_id: int | None,
    eos_scored: bool,
    missing_eos_penalty: float | None,
    accelerator,
    log: bool,
) -> Rewards:
    """Step 4: decode the completions, call the reward functions, combine them by weight, and subtract
    `missing_eos_penalty` from the responses that did not reach their end: without a stop token and with EOS scored
    like any token (`eos_scored`, TRL 1.12's rule), those with no EOS anywhere; else those that do not end with the
    stop token (none, without one)."""
    mask = rollout.response_mask
    completion_ids = [r[m.bool()].tolist() for r, m in zip(rollout.responses, mask)]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompt_mask = rollout.attention_mask[:, : rollout.context_length].bool()
    prompt_ids = [q[m].tolist() for q, m in zip(rollout.query_responses[:, : rollout.context_length], prompt_mask)]
    scores, applicable, per_function = combine_rewards(
        reward_funcs,
        weights,
        names,
        rollout.prompts,
        completions,
        completion_ids,
        {**rollout.extra, "prompt_ids": prompt_ids},
        accelerator.device,
    )
    if not bool(applicable.all()) and log:
        logger.warning(
            "%d of %d completions got None from every reward function: they get score 0 and no policy "
            "gradient (advantage 0), as in TRL. Make sure at least one reward function scores every sample.",
            int((~applicable).sum()),
            len(completions),
        )
    scores = scores.float()
    if eos_scored:
        has_end = contains_token(rollout.responses, mask, tokenizer.eos_token_id)
    else:
        has_end = ends_with_stop(rollout.responses, mask, stop_token_id)
    if missing_eos_penalty is not None:
        scores = torch.where(has_end, scores, scores - missing_eos_penalty)
    stats = GlobalSums()
    for name, (total, count) in per_function.items():
        stats.add(f"rewards/{name}", total, count)
    stats.add("objective/scores", scores.sum(), scores.numel())
    if stop_token_id is not None or eos_scored:  # with EOS suppressed, no response can reach it
        stats.add("objective/eos_frac", has_end.float().sum(), has_end.numel())
    stats.add("objective/response_length", mask.sum(), mask.shape[0])
    return Rewards(completions, scores, applicable, stats.means(accelerator))


@torch.no_grad()
def kl_penalty(rollout: Rollout, rewards: Rewards, plan: KLPlan, coef: float, accelerator) -> KLPenalty:
    """Step 5: the configured estimate, times `coef`, in the per-token rewards when the plan puts it there (the
    score at the last response token), and the controller statistic reduced over all ranks. Every estimator of
    `LOGGED_ESTIMATORS` is logged, whatever the configured one. Nothing changes state here."""
    mask = rollout.response_mask
    stats = GlobalSums()
    per_unit = unit_count(mask, plan.unit)
    for i, name in enumerate(LOGGED_ESTIMATORS):  # each estimator's own reading (scoring masked them)
        stats.add(f"kl/{name}", rollout.logged_kl[..., i].sum(), per_unit)
    if plan.statistic not in LOGGED_ESTIMATORS:
        stats.add(f"kl/{plan.statistic}", rollout.statistic_kl.sum(), per_unit)
    stats.add("kl/clamped_frac", rollout.kl_clamped.sum(), mask.sum())
    non_score = kl_reward(rollout.kl, mask, coef) if "reward" in plan.places else torch.zeros_like(rollout.kl)
    per_token = non_score.clone()
    last = mask.sum(dim=1) - 1
    per_token[torch.arange(per_token.shape[0], device=per_token.device), last] += rewards.scores
    stats.add("objective/non_score_reward", non_score.sum(), mask.shape[0])
    stats.add("objective/rlhf_reward", per_token.sum(), mask.shape[0])
    nonfinite, _ = reduce_sum_count((~torch.isfinite(per_token)).sum(), 0, accelerator)
    metrics = stats.means(accelerator)
    reading = kl_statistic(rollout.statistic_kl, mask, unit=plan.unit, accelerator=accelerator).item()
    metrics.update({"kl/value": reading, "kl/coef": coef})
    if plan.target:
        metrics.update({"kl/target": plan.target, "kl/error": (reading - plan.target) / plan.target})
    return KLPenalty(per_token, coef, reading, math.isfinite(reading) and nonfinite.item() == 0, metrics)


def update_controller(
    controller,
    guard,
    drift,
    plan: KLPlan,
    rollout: Rollout,
    rewards: Rewards,
    penalty: KLPenalty,
    accelerator,
    num_generations: int,
    log: bool,
) -> dict[str, float]:
    """Step 6, the same on every rank (the statistic is global): a controller that reads the batch itself
    (`reads_sequences`) is given every scored sequence's score, summed log-ratio and length, gathered over all ranks
    in rank order; then the controller steps on the statistic; the guard's low side arms once a reading reaches its
    bound; the drift monitor sees the same reading. Returns the coefficient of the next update and what the
    controller logs."""
    if controller.reads_sequences:
        mask = rollout.response_mask
        # an inexact engine sampled the sequences: the batch's importance weights toward the family's member at b
        # (`log pi_b / pi_old`) times each sequence's truncated `pi_old / mu` (`generation/correction.py`); both
        # families' weights read `d` only as `exp(-d)`, so that is `d - log w` in place of `d`, and the KL estimate
        # `E_w[log(n w) + d']` is the same formula (untruncated, `d'` is `log mu / ref`)
        log_weight = getattr(rollout, "is_log_weight", None)
        log_weight = 0.0 if log_weight is None else log_weight.double()
        table = torch.stack(
            [
                rewards.scores.double(),
                rollout.log_ratio.double().sum(dim=1) - log_weight,
                mask.sum(dim=1).double(),
                rewards.scorable.double(),
            ],
            dim=1,
        )
        table = accelerator.gather(table).cpu()
        # the reward the KL in the loss is weighed against (docs/kl.md, "GRPO's group normalisation")
        if plan.grpo_slope:
            scores = table[:, 0]
            table[:, 0] = scores * advantage_slope(
                sequence_advantages("grpo", scores, num_generations), scores, num_generations
            )
        table = table[table[:, 3] > 0]  # sequences no reward function scored get no policy gradient
        controller.observe_sequences(table[:, 0], table[:, 1], table[:, 2], unit=plan.unit)
    controller.update(penalty.reading, n_steps=rollout.response_mask.shape[0] * accelerator.num_processes)
    guard.observe(penalty.reading)
    check_same_on_all_ranks(controller.value, accelerator, "KL coefficient")
    if drift is not None:
        message = drift.update(penalty.reading)
        if message and log:
            logger.warning(message)
    return {"kl/coef_next": controller.value, **controller.metrics()}


@torch.no_grad()
def compute_advantages(
    args, plan: KLPlan, rollout: Rollout, rewards: Rewards, penalty: KLPenalty, accelerator
) -> Advantages:
    """Step 7: GAE over the per-token rewards (or, critic-free, RLOO / GRPO on each sequence's return, the same on
    every token), whitened with global statistics (not GRPO's, normalised per group already). Samples no reward
    function applied to carry no policy gradient (advantage 0) and stay out of the whitening. Whitening divides the
    policy-gradient term by std(A), so the loss E[A]/std - c * KL maximises E[r] - c * std * KL: the KL term's
    weight is beta / std (`loss_scale_by_advantage_std`, std floored, since collapsed advantages would leave it at
    the whitening's epsilon), so that beta means what it means in the reward."""
    mask = rollout.response_mask
    per_token = penalty.token_rewards
    if args.whiten_rewards:
        per_token = global_masked_whiten(per_token, mask, accelerator=accelerator, shift_mean=False)
    if args.critic_free:  # the sequence's RLHF reward: score + summed KL rewards; groups of num_generations rows
        returns = (per_token * mask).sum(dim=1)
        advantages = sequence_advantages(args.advantage_estimator, returns, args.num_generations)
        advantages, returns = advantages[:, None] * mask, returns[:, None] * mask
    else:
        advantages, returns = gae_advantages(per_token, rollout.values, mask, args.gamma, args.lam)
    scorable = rewards.scorable.to(advantages.dtype)[:, None]
    metrics = {}
    if not args.critic_free:  # how much of the returns' variance the rollout's values explain
        metrics["val/explained_variance"] = explained_variance(returns, rollout.values, mask, accelerator)
    advantages = advantages * scorable
    std = 1.0
    if args.experimental.whiten_advantages and args.advantage_estimator != "grpo":
        advantages, std = global_masked_whiten(advantages, mask * scorable, accelerator=accelerator, return_std=True)
        std = std.item()
    scale = max(std, KL_LOSS_MIN_ADVANTAGE_STD) if plan.loss_scale_by_advantage_std else 1.0
    baseline = None
    if plan.loss_baseline:
        baseline, metrics["kl/loss_baseline"] = kl_loss_baseline(plan, rollout, accelerator)
    return Advantages(
        advantages, returns, penalty.coef / scale, {"policy/advantage_std": std, **metrics}, kl_loss_baseline=baseline
    )


def kl_loss_baseline(plan: KLPlan, rollout: Rollout, accelerator) -> tuple[torch.Tensor, float]:
    """`kl_loss_baseline`'s b per sequence `[B, 1]`, and the rollout's mean for the log. `g` is the coefficient the
    configured estimator puts on `w * grad log pi` in the loss, at the sampling policy (`d/dx` of the estimate at
    log-ratios `d + x` to the reference and `x` to the sampling policy, x = 0); a sequence's b is the token mean of
    `g` over every other sequence of the rollout, on all processes, so that it does not depend on the sequence's own
    tokens."""
    mask = rollout.response_mask
    with torch.enable_grad():
        x = torch.zeros_like(rollout.log_ratio, dtype=torch.float64, requires_grad=True)
        kl = plan.estimate(plan.estimator, rollout.log_ratio.double() + x, x)
        (g,) = torch.autograd.grad(kl.sum(), x)
    if getattr(rollout, "is_weight", None) is not None:  # an inexact engine's tokens: the mean under pi_old
        mask = mask.double() * rollout.is_weight.double()
    rows, lengths = (g * mask).sum(dim=1), mask.sum(dim=1).double()
    total, count = reduce_sum_count(rows.sum(), lengths.sum(), accelerator)
    others = (total - rows) / (count - lengths).clamp(min=1)
    return others[:, None], (total / count.clamp(min=1)).item()


def micro_batch_loss(
    model,
    mb: Rollout,
    advantages: Advantages,
    idx: torch.Tensor,
    counts: dict,
    args,
    plan: KLPlan,
    suppressed_ids,
    reference,
    warming: bool,
    share: float,
):
    """Step 8's loss of one micro-batch `mb` (rows `idx` of the rollout) through `model` (the wrapped actor-critic),
    normalised by the mini-batch's GLOBAL counts (`counts`: its tokens and sequences summed over micro-batches and
    ranks; `share`, this micro-batch's part of them, weighs only the logged parts). Returns the loss, its logging parts `{name: (sum, count)}` and its reading for the
    KL guard (`GuardSample`). In loss mode the configured estimate at the current policy joins the loss, with the
    baseline taken out of its gradient when the plan says so; a logits-based estimator reads the reference's logits
    from `reference(mb)` (a `ResponseLogits`). The LM head is read in blocks of `logits_block_mb`
    (`read_response`): no `[B, R, V]` logits are held at once. `warming`: the critic alone (a shared head reads the
    trunk detached, and the policy loss is left out)."""
    mask, resp = mb.response_mask, mb.responses
    kl_from_logits = "loss" in plan.places and not warming and plan.estimator_needs_logits
    ref, estimates = None, {}
    if kl_from_logits:
        with torch.no_grad():
            ref = reference(mb)
        estimates = {plan.estimator: partial(plan.estimate_from_logits, plan.estimator)}
    budget = args.experimental.logits_block_mb

    def read(source):
        return read_response(
            source, resp, args.temperature, suppressed_ids, budget, reference=ref, estimates=estimates, entropy=True
        )

    reads, values = model(
        mb.query_responses,
        attention_mask=mb.attention_mask,
        position_ids=position_ids_from_mask(mb.attention_mask),
        response_length=resp.shape[1],
        read=read,
        **({"detach_value_input": True} if warming else {}),
    )
    values = values[:, mb.context_length - 1 : -1].float() if values is not None else None
    logp = reads["logp"]
    # PPO's clipped losses, token means over the mini-batch's global token count
    pg_tok, pg_clipped, to_old = clipped_policy_loss(logp, mb.logp, advantages.advantages[idx], args.cliprange)
    loss, value_loss, vf_clipped = (
        aggregate_loss(pg_tok, mask, "token-mean", num_tokens=counts["num_tokens"]),
        None,
        None,
    )
    if values is not None:  # no critic: critic-free advantages
        vf_tok, vf_clipped = clipped_value_loss(values, mb.values, advantages.returns[idx], args.cliprange_value)
        value_loss = aggregate_loss(vf_tok, mask, "token-mean", num_tokens=counts["num_tokens"])
    # the log-ratios at the current policy: to the sampling policy, and to the reference from the rollout's
    # (0 after the stop token, where the sampled token was replaced by padding)
    old_log_ratio = torch.where(mask.bool(), to_old, 0.0)
    log_ratio = mb.log_ratio + old_log_ratio
    parts = ppo_statistics(
        reads["entropy"], old_log_ratio, pg_clipped, vf_clipped, mask, share, policy=loss, value=value_loss
    )
    sample = guard_sample(
        log_ratio.detach(), old_log_ratio.detach(), mb.log_ratio, mask, plan.unit, getattr(mb, "is_weight", None)
    )
    parts["kl/during_update"] = (sample.kl_now, sample.count)  # the KL statistic at the current policy
    if warming:  # the critic alone: neither the policy loss nor the KL reaches the policy's weights
        loss = None
    elif "loss" in plan.places:  # the estimator at the current policy, per the aggregation
        if kl_from_logits:
            kl = reads[plan.estimator]
        else:
            kl = plan.estimate(plan.estimator, log_ratio, old_log_ratio)
        if advantages.kl_loss_baseline is not None:  # a zero-mean control variate: E_old[w * grad log pi] = 0
            c = plan.log_ratio_clamp
            w = (old_log_ratio if c is None else old_log_ratio.clamp(-c, c)).exp()
            kl = kl - advantages.kl_loss_baseline[idx].to(w.dtype) * (w - w.detach())
        if getattr(mb, "is_weight", None) is not None:  # an inexact engine's tokens: the expectation under pi_old
            kl = kl * mb.is_weight.to(kl.dtype)
        kl_term = kl_loss(
            kl, mask, advantages.kl_loss_coef, plan.loss_agg_mode, **counts, norm_len=args.response_length
        )
        loss = loss + kl_term
        parts["loss/kl"] = (kl_term.detach(), share)
    if value_loss is not None:
        loss = args.vf_coef * value_loss if loss is None else loss + args.vf_coef * value_loss
    return loss, parts, sample
