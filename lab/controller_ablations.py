"""Ablations of the equilibrium and tracking controllers, registered as controllers of their own for
`controller_grid.py --plugin`.

- `equilibrium_full_step`: no effective-sample-size gain; log beta goes straight to the batch's estimate.
- `equilibrium_ema`: a constant gain of 0.3 (an EMA of the estimate) instead of the effective sample size.
  (These two ran before the approach existed; with it, add `--kwargs '{"approach_power": 0}'` to repeat them.)
- `tracking_no_startup`: the tracking controller armed from the first update: no start-up hold and no cap on
  beta's rise during the approach (the start-up rule with its exception).
- `tracking_no_antiwindup`: the integral is not kept inside the coefficient bounds (only beta itself is).

The equilibrium controller's approach is ablated through its constant (`--kwargs '{"approach_power": 0}'`), the
tracking controller's lookahead through its constant (`--kwargs '{"lookahead": 0}'`). The tracking controller's EMA of
the reading and the start-up rule's exception (a raw reading near the target ends the no-rise rule before the
EMA does) were ablated the same way and removed (`results/controller_grid/README.md`); their plug-in and constant
are in the git history.

The guard is ablated through a setting, `--config '{"kl_guard": false}'`, and its pieces by the plug-ins
`ablate_guard_low_side` and `ablate_guard_momentum_reset`. (A bound on one update's change of log beta, 1, was
ablated and removed: the same cells within bounds and the same mean tracking error on seed 3, and it never bound on
the default task.)
"""

from __future__ import annotations

from klppo.kl.controllers import EquilibriumKLController, TrackingKLController, register_kl_controller


class _ConstantGain(EquilibriumKLController):
    gain = 1.0

    def _equilibrium_step(self):
        before = self.coef
        new = super()._equilibrium_step()
        if self.ess is not None:
            self.ess = self.gain  # recompute the step with a constant gain
            import math

            now = math.log(before)
            return self._from_log(now + self.gain * (self.estimate - now))
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


@register_kl_controller("tracking_no_startup")
class TrackingNoStartup(TrackingKLController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = True


@register_kl_controller("tracking_no_antiwindup")
class TrackingNoAntiWindup(TrackingKLController):
    def _step(self, kl, n_steps):
        bounds = self.coef_min, self.coef_max
        self.coef_min, self.coef_max = 1e-30, 1e30  # the integral's clamp follows these bounds
        try:
            beta = super()._step(kl, n_steps)
        finally:
            self.coef_min, self.coef_max = bounds
        return min(max(beta, self.coef_min), self.coef_max)
