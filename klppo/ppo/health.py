"""PPO health: the ranges in which a PPO update is trustworthy, and a monitor that warns, naming the fix,
when the logged metrics leave them.

Healthy ranges (per PPO update; "The 37 Implementation Details of PPO", Huang et al. 2022, and "The N
Implementation Details of RLHF with PPO", Huang et al. 2023, report the same orders of magnitude):

- `policy/approxkl` (mean `(log pi - log pi_old)^2 / 2` over the PPO epochs) at most 0.02: the policy
  moves a little per update. Far above it, the update is driven by the few samples of one batch.
- `policy/clipfrac` at most 0.2: most tokens are inside the trust region. Above it the clipped objective
  has no gradient for a large share of the tokens.
- `policy/entropy` above half its value at the first update: the policy has not collapsed onto a few
  tokens.
- `val/clipfrac` at most 0.5: the critic can follow the returns; when most value predictions are clipped,
  the critic is stale and its errors go into the advantages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = [
    "HEALTH_RANGES", "HealthRange", "NonfiniteGuard", "PPOHealthMonitor", "TrainingDiverged", "policy_outputs_finite",
    "rollout_outputs_finite",
]  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthRange:
    metric: str
    limit: float
    above: bool  # True: healthy values are <= limit; False: healthy values are >= limit (relative to first)
    fix: str


HEALTH_RANGES = (
    HealthRange(
        "policy/approxkl",
        0.02,
        True,
        "the policy moves too far per update: lower learning_rate, use fewer num_ppo_epochs, or sample more "
        "sequences per update (per_device_train_batch_size / num_mini_batches)",
    ),
    HealthRange(
        "policy/clipfrac",
        0.2,
        True,
        "most tokens leave the trust region: lower learning_rate or num_ppo_epochs, or sample more sequences "
        "per update",
    ),
    HealthRange(
        "policy/entropy",
        0.5,
        False,
        "the policy is collapsing onto a few tokens: raise kl_coef (or lower kl_target), lower learning_rate, "
        "or raise temperature",
    ),
    HealthRange(
        "val/clipfrac",
        0.5,
        True,
        "the critic cannot follow the returns: raise cliprange_value or vf_coef, or whiten_rewards",
    ),
)


class PPOHealthMonitor:
    """Warn once when a metric stays outside its healthy range for `patience` consecutive updates.

    `update(metrics) -> list[str]` takes one update's logged metrics and returns the warnings to emit (at most
    one per metric per excursion: a metric warns again only after it has come back into range). The entropy
    limit is relative to the entropy of the first update seen.
    """

    def __init__(self, patience: int = 3, ranges: tuple[HealthRange, ...] = HEALTH_RANGES):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = int(patience)
        self.ranges = ranges
        self.streaks: dict[str, int] = {r.metric: 0 for r in ranges}
        self.warned: dict[str, bool] = {r.metric: False for r in ranges}
        self.first: dict[str, float] = {}

    def update(self, metrics: dict[str, float]) -> list[str]:
        messages = []
        for r in self.ranges:
            value = metrics.get(r.metric)
            if value is None or value != value:  # missing or NaN
                continue
            self.first.setdefault(r.metric, float(value))
            limit = r.limit if r.above else r.limit * self.first[r.metric]
            bad = value > limit if r.above else value < limit
            if not bad:
                self.streaks[r.metric], self.warned[r.metric] = 0, False
                continue
            self.streaks[r.metric] += 1
            if self.streaks[r.metric] >= self.patience and not self.warned[r.metric]:
                self.warned[r.metric] = True
                side = "above" if r.above else "below"
                messages.append(
                    f"PPO health: {r.metric} = {value:.4g} has been {side} its healthy limit {limit:.4g} for "
                    f"{self.streaks[r.metric]} updates; {r.fix}."
                )
        return messages

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks), "warned": dict(self.warned), "first": dict(self.first)}

    def load_state_dict(self, state: dict) -> None:
        self.streaks.update(state.get("streaks", {}))
        self.warned.update(state.get("warned", {}))
        self.first.update(state.get("first", {}))


class TrainingDiverged(RuntimeError):
    """Training stopped on non-finite values; the message says what diverged and how to fix the run."""


@torch.no_grad()
def policy_outputs_finite(model, sequences, accelerator, chunk: int, logits_block_mb: float = 256.0) -> bool:
    """Whether the actor-critic `model` gives finite logits and values on `sequences` (a `Sequences` of this rank,
    in forward passes of `chunk` rows, the LM head read in blocks of `logits_block_mb`), on every rank. An optimizer step can leave finite weights whose logits
    overflow on some inputs (a learning rate far too high): the weights alone do not tell. Every rank runs the
    forward passes (sharded models need all of them) and the verdicts are summed, so all ranks answer the same."""
    from ..kl.reduce import all_reduce_sum
    from .logprobs import position_ids_from_mask, read_response

    bad = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    for start in range(0, sequences.batch_size, chunk):
        part = sequences.select(slice(start, start + chunk))
        reads, values = model(
            part.query_responses, attention_mask=part.attention_mask,
            position_ids=position_ids_from_mask(part.attention_mask), response_length=part.responses.shape[1],
            read=lambda source: read_response(source, part.responses, 1.0, None, logits_block_mb, finite=True),
        )  # fmt: skip
        bad += (~reads["finite"]).sum()
        if values is not None:
            bad += (~torch.isfinite(values)).sum()
    return all_reduce_sum(bad, accelerator).item() == 0


@torch.no_grad()
def rollout_outputs_finite(rollout, accelerator) -> bool:
    """Whether the policy gave finite outputs while a rollout was sampled and scored: its sampling logits
    (`rollout.sampled_finite`), the response tokens' log-probs and the critic's values, on every rank."""
    from ..kl.reduce import all_reduce_sum

    mask = rollout.response_mask.bool()
    bad = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    bad += float(not rollout.sampled_finite)
    for x in (rollout.logp, rollout.values):
        bad += (~torch.isfinite(x[mask])).sum()
    return all_reduce_sum(bad, accelerator).item() == 0


class NonfiniteGuard:
    """Counts updates skipped for NaN/inf and stops training after `max_in_a_row` of them in a row.

    `record(step, what, outcome)` logs one skipped update (`what` held non-finite values, `outcome` says what
    happened to the weights) and raises `TrainingDiverged` once too many follow each other; `reset()` after a
    clean update; `stop(message)` ends training at once. `stopped` tells that the guard ended training: the
    weights are then not to be saved.
    """

    def __init__(self, max_in_a_row: int = 3):
        self.max_in_a_row = int(max_in_a_row)
        self.skips = 0
        self.consecutive = 0
        self.stopped = False

    def record(self, step: int, what: str, outcome: str, log: bool = True) -> dict[str, float]:
        self.skips += 1
        self.consecutive += 1
        if log:
            logger.warning(
                "Skipped PPO update %d: non-finite values in %s (%d skipped so far); %s.", step, what, self.skips, outcome
            )
        if self.consecutive >= self.max_in_a_row:
            self.stop(
                f"{self.consecutive} PPO updates in a row had non-finite values in {what}; training "
                "stopped (checkpoints already written are intact). Lower the learning rate, set "
                "`kl_value_clamp`, check the reward functions for NaN/inf, or use bf16/fp32 instead of fp16."
            )
        return {"train/skipped_update": 1.0}

    def stop(self, message: str) -> None:
        """End training with `message` (raises `TrainingDiverged`)."""
        self.stopped = True
        raise TrainingDiverged(message)

    def policy_diverged(self, step: int, applied_steps: int, args) -> None:
        """End training: update `step`'s `applied_steps` optimizer steps left a policy with non-finite logits
        (or critic values) and no copy to undo them; the message names the fixes in `args` (a `KLPPOConfig`)."""
        self.stop(
            f"The policy diverged at PPO update {step}: after {applied_steps} optimizer step(s) its logits (or the "
            "critic's values) are not finite. Training stopped; no checkpoint holds these weights (those written "
            f"before are intact). Lower learning_rate (now {args.learning_rate:g}) or max_grad_norm (now "
            f"{args.max_grad_norm}), or set nonfinite_rollback: true to undo such an update and go on."
        )

    def reset(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"nonfinite_skips": self.skips, "consecutive_nonfinite": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skips = state.get("nonfinite_skips", 0)
        self.consecutive = state.get("consecutive_nonfinite", 0)
