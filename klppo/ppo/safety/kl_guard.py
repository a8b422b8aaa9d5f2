"""The KL guard: an early stop, inside one PPO update, on the KL to the reference.

CleanRL's `target_kl` stops an update's epochs once the approximate KL to the OLD policy passes a bound. The
guard does the same against the REFERENCE, the divergence the controller targets: once the KL at the current
policy passes `kl_target` and this update has pushed it up, the mini-batch takes no optimizer step, the update
ends and the optimizer's momentum is cleared. Its low side mirrors it below the target, and acts only after a
rollout's reading has once reached the target (before that, a low KL is the approach from the reference, not
an overshoot). It judges what the update has changed, so an update's first optimizer step always goes ahead
(`klppo.ppo.safety.step_checks.StepChecks.verdict`).
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

UPPER, LOWER = "guard", "guard_low"

_KL_GUARDS: dict[str, type] = {}


def register_kl_guard(name: str):
    """Class decorator: register a `KLGuard` subclass under `name`, selectable with the experimental setting
    `kl_guard: <name>` (for ablations: a variant changes `upper`, `lower` or `clears_momentum`, or overrides
    `check`)."""

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, KLGuard)):
            raise TypeError(f"register_kl_guard decorates KLGuard subclasses, got {cls!r}")
        if name in _KL_GUARDS:
            raise ValueError(f"A KL guard named {name!r} is already registered; unregister it first")
        _KL_GUARDS[name] = cls
        return cls

    return decorate


def unregister_kl_guard(name: str) -> None:
    """Remove a registered guard (for tests and plug-ins); unknown names raise `KeyError`."""
    del _KL_GUARDS[name]


def kl_guards() -> tuple[str, ...]:
    """Names of the registered guards."""
    return tuple(_KL_GUARDS)


def build_kl_guard(setting: bool | str, target: float | None) -> KLGuard:
    """The guard of a run: the registered class `setting` names (`True`: `"default"`), or an inactive one for
    `False`."""
    if not setting:
        return KLGuard(None)
    return _KL_GUARDS["default" if setting is True else setting](target)


class KLGuard:
    """Whether a mini-batch's optimizer step goes ahead, from the KL the update has reached (`kl_guard="default"`).

    Args:
        target: `kl_target` (None: the guard is off).

    Its upper bound is the target; its lower bound too (`lower_at` times the target), once armed. A variant changes
    the class attributes in a subclass registered with `register_kl_guard`: `upper` / `lower` turn a side off,
    `lower_at` moves the lower bound, `clears_momentum=False` keeps the optimizer's momentum when it fires,
    `low_significance=z` lets the low side act only on a fall of the KL larger than `z` standard errors of its
    estimate on the mini-batch.
    """

    upper = True
    lower = True
    lower_at = 1.0
    clears_momentum = True
    low_significance = 0.0

    def __init__(self, target: float | None):
        self.target = target
        self.low_armed = False

    @property
    def upper_on(self) -> bool:
        return bool(self.target) and self.upper

    @property
    def lower_on(self) -> bool:
        return bool(self.target) and self.lower

    def observe(self, reading: float) -> None:
        """A rollout's KL reading (the controller's statistic): the low side arms once one reaches the target."""
        if self.lower_on and reading >= self.target * self.lower_at:
            self.low_armed = True

    def check(
        self, kl_sum: float, kl_count: float, kl_rollout: float, reading: float | None, change_sq: float | None = None
    ) -> str | None:
        """`"guard"` (above the target), `"guard_low"` (below it, once armed) or None.

        The KL now is the rollout's `reading` plus this update's change on the mini-batch's tokens: `kl_sum` is
        their KL at the current policy (importance-weighted k1, `kl_count` the statistic's count) and `kl_rollout`
        the same tokens' KL at the rollout. Measured on the same tokens before and after, that change is far less
        noisy than a few sequences' own k1; `change_sq` is the sum over the units of their change squared (its
        noise, for `low_significance`). Without a reading, the KL now is the mini-batch's own. "Pushed" means
        by more than rounding (a thousandth of the target's KL): a rollout that already read above the target keeps
        stepping while its KL does not rise (else the policy, never stepping, could not come back).
        """
        if not (self.upper_on or self.low_armed) or kl_count == 0:
            return None
        change = kl_sum - kl_rollout
        pushed_up = change > 1e-3 * max(self.target * kl_count, abs(kl_rollout))
        pushed_down = -change > 1e-3 * max(self.target * kl_count, abs(kl_rollout))
        now = kl_sum / kl_count if reading is None else reading + change / kl_count
        if self.upper_on and now > self.target and pushed_up:
            return UPPER
        if (
            self.low_armed
            and now < self.target * self.lower_at
            and pushed_down
            and self._significant_fall(change, change_sq, kl_count)
        ):
            return LOWER
        return None

    def _significant_fall(self, change: float, change_sq: float | None, count: float) -> bool:
        """Whether the mean change per unit lies more than `low_significance` standard errors below 0."""
        if not self.low_significance or change_sq is None or count < 2:
            return True
        mean = change / count
        variance = max(change_sq / count - mean * mean, 0.0) * count / (count - 1)
        return -mean > self.low_significance * math.sqrt(variance / count)

    def metrics(self, fired: str | None) -> dict[str, float]:
        out = {}
        if self.upper_on:
            out["kl/guard_fired"] = float(fired == UPPER)
        if self.lower_on:
            out["kl/guard_low_fired"] = float(fired == LOWER)
        return out

    def describe(self, fired: str, steps: int) -> str:
        side = "passed kl_target" if fired == UPPER else f"fell below {self.lower_at:g} x kl_target"
        return (
            f"KL guard: the KL to the reference {side} after {steps} optimizer step(s); the rest of this update "
            "was skipped."
        )

    def state_dict(self) -> dict:
        return {"kl_guard_low_armed": self.low_armed}

    def load_state_dict(self, state: dict) -> None:
        self.low_armed = bool(state.get("kl_guard_low_armed", False))


def reset_momentum(optimizer) -> bool:
    """Zero the optimizer's first moments (`exp_avg` of Adam / AdamW, `momentum_buffer` of SGD): the push that
    made the guard fire does not carry into the next steps. Second moments and step counts are kept. Returns
    False when the optimizer holds state but neither tensor (nothing was reset)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's wrapper, then DeepSpeed's ZeRO optimizer
    states = [s for s in optimizer.state.values() if s]
    reset = 0
    for state in states:
        for key in ("exp_avg", "momentum_buffer"):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.zero_()
                reset += 1
    return reset > 0 or not states


register_kl_guard("default")(KLGuard)
