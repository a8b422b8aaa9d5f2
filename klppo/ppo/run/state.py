"""What one update leaves for the next ones, beside the weights and the optimizer: `RunState`, saved in every
checkpoint (`kl_controller.json`) and restored as one.

- the KL controller (its coefficient and whatever it integrates);
- the KL guard (whether its low side is armed);
- the drift monitor and the PPO health monitor (their streaks);
- the non-finite path (`UpdateSafety`: skipped updates, the update no rollout has checked yet);
- the reference resets made so far, and the reference's tensors before the first (`kl/initial`; saved beside the
  reference's own, `klppo.ppo.run.checkpoint.save_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kl import KLDriftMonitor, build_kl_controller
from ..plan import KLPlan
from ..safety.health import PPOHealthMonitor
from ..safety.kl_guard import KLGuard, build_kl_guard
from ..safety.nonfinite import NonfiniteSkips, UpdateSafety


@dataclass
class RunState:
    """The state that lives across updates (module docstring)."""

    controller: object  # a `klppo.kl.KLController`
    guard: KLGuard
    drift: KLDriftMonitor | None
    health: PPOHealthMonitor
    safety: UpdateSafety
    plan: KLPlan  # the run's settings, not saved: the target and patience of a drift monitor built again
    reference_resets: int = 0
    initial_reference: dict[str, torch.Tensor] | None = None  # the reference's tensors before the first reset

    @classmethod
    def build(cls, args, plan: KLPlan, accelerator, log: bool) -> "RunState":
        """A run's state before its first update, from its `KLPPOConfig` (the controller's fields, the health
        monitor's patience, `max_nonfinite_updates`) and its `KLPlan` (the guard, the drift monitor)."""
        drift = KLDriftMonitor(plan.target, patience=plan.drift_patience) if plan.target else None
        return cls(
            build_kl_controller(args),
            build_kl_guard(plan.guard, plan.target),
            drift,
            PPOHealthMonitor(patience=args.experimental.health_patience),
            UpdateSafety(NonfiniteSkips(args.experimental.max_nonfinite_updates), accelerator, log),
            plan,
        )

    def reference_reset(self, reference: dict[str, torch.Tensor]) -> None:
        """The reference (its trainable tensors, `reference`) becomes the policy: they are kept for `kl/initial` if
        this is the first reset, and the KL starts again from 0 for the controller, the guard's low side and the drift
        monitor."""
        if self.initial_reference is None:
            self.initial_reference = {name: t.detach().clone() for name, t in reference.items()}
        self.reference_resets += 1
        self.controller.reference_reset()
        self.guard.low_armed = False
        if self.drift is not None:
            self.drift = KLDriftMonitor(self.plan.target, patience=self.plan.drift_patience)

    def state_dict(self) -> dict:
        return {
            "kl_controller": self.controller.state_dict(),
            "drift_monitor": self.drift.state_dict() if self.drift is not None else None,
            "health_monitor": self.health.state_dict(),
            **self.guard.state_dict(),
            **self.safety.state_dict(),
            "reference_resets": self.reference_resets,
        }

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["kl_controller"])
        saved = state.get("drift_monitor")
        same = saved and (saved.get("target"), saved.get("patience")) == (self.plan.target, self.plan.drift_patience)
        if self.drift is not None and same:  # a new target or patience: a new band
            self.drift.load_state_dict(saved)
        self.health.load_state_dict(state.get("health_monitor") or {})
        self.guard.load_state_dict(state)
        self.safety.load_state_dict(state)
        self.reference_resets = int(state.get("reference_resets", 0))
