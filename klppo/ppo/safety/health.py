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

from dataclasses import dataclass

__all__ = ["HEALTH_RANGES", "HealthRange", "PPOHealthMonitor"]


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
