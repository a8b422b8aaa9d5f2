"""Ablations of the equilibrium controller, registered as controllers of their own for `controller_grid.py --plugin`.

- `equilibrium_full_step`: no effective-sample-size gain; log beta goes straight to the batch's estimate (still
  within `max_step`).
- `equilibrium_ema`: a constant gain of 0.3 (an EMA of the estimate) instead of the effective sample size.

The other pieces are ablated through settings: `--kwargs '{"max_step": 100}'` (no bound on one update's change),
`--config '{"kl_guard": false}'` (no guard).
"""

from __future__ import annotations

from klppo.kl.controllers import EquilibriumKLController, register_kl_controller


class _ConstantGain(EquilibriumKLController):
    gain = 1.0

    def _step(self, kl, n_steps):
        new = super()._step(kl, n_steps)
        if self.ess is not None:
            self.ess = self.gain  # recompute the step with a constant gain
            import math

            now = math.log(self._value)
            step = min(max(self.gain * (self.estimate - now), -self.max_step), self.max_step)
            return self._from_log(now + step)
        return new


@register_kl_controller("equilibrium_full_step")
class FullStep(_ConstantGain):
    gain = 1.0


@register_kl_controller("equilibrium_ema")
class Ema(_ConstantGain):
    gain = 0.3


def guard_without(**change):
    """Build the trainer's KL guard with one piece changed (`low_margin=inf`: no low side; `reset_momentum=False`:
    the optimizer's momentum kept when it fires)."""
    import functools

    import klppo.ppo.trainer as trainer_module
    from klppo.ppo.guard import KLGuard

    trainer_module.KLGuard = functools.partial(KLGuard, **change)
