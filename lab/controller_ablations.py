"""Ablations of the equilibrium and tracking controllers and of the KL guard, registered as controllers and
guards of their own for `python -m lab.controller_grid --plugin lab.controller_ablations` (or `--plugin
controller_ablations`).

- `equilibrium_full_step`: no effective-sample-size gain; log beta goes straight to the batch's estimate.
- `equilibrium_ema`: a constant gain of 0.3 (an EMA of the estimate) instead of the effective sample size.
  (These two ran before the approach and the hold existed; add `--kwargs '{"approach_power": 0, "hold_power": 0}'`
  to repeat them.)
- `tracking_no_startup`: the tracking controller armed from the first update: no start-up hold and no cap on
  beta's rise during the approach (the start-up rule with its exception).
- `tracking_no_antiwindup`: the integral is not kept inside the coefficient bounds (only beta itself is).
- `equilibrium_integral` (`approach_integral`): the approach also integrates log(KL / target) until the KL arrives.
- `equilibrium_pi` (`integral_gain`): the equilibrium estimate as the set point times exp(I), I a slow integral of
  log(KL / target) at every update. Both measured worse than the shipped controller
  (`results/controller_grid/issue_grid/README.md`, "An integral on the KL error").
- `equilibrium_window` (`window`): a step toward the mean of the last `window` estimates (weighted by their
  effective sample sizes) instead of the latest one; no better in the fast 32-sequence cells (the same README, "The
  fast 32-sequence cells").
- `equilibrium_median` (`window`): the same toward the median of the last `window` (3) estimates; no better either.
- `equilibrium_kalman` (`drift`, `groups`): log beta* followed by a Kalman filter whose measurement variance is each
  batch's grouped jackknife variance over its effective-sample-size share; holds the KL in the fast 32-sequence
  cells as a fixed beta* does (the same README), but on the default task, where the estimate moves with the policy,
  it holds the KL worse than the shipped controller (`results/default_task_kalman/`).
- `equilibrium_kalman_adaptive` (`drift`, `groups`, `window`): the same with its process variance matched to its
  innovations; it does not follow the default task either: there the estimates far from beta are backed by few
  sequences, and dividing their variance by the effective-sample-size share leaves the gain near 0
  (`results/default_task_filtered/`).
- `equilibrium_kalman_gated` (`drift`, `groups`, `window`): the step is the smaller of the shipped gain (the
  share) and the Kalman gain on the jackknife variance alone; with `window=0` (a fixed drift) it is what klppo ships
  as the equilibrium controller's `jackknife_groups` (8 by default with `k2` in the loss), except on a coefficient
  bound, where this variant takes no step and klppo takes the share's. With `window=8` it is the
  ablation of the matched process variance, which did not earn its place (the same README).
- `equilibrium_bound_proportional`: a step toward a coefficient bound of at most |log(KL / target)| instead of the
  share's; with `k3` in the loss it holds the KL worse (tracking error +0.040 ± 0.007 on 55 runs of seeds 161-162,
  the same README, "The approach's power 1.5"), so klppo keeps the share's step.

Every equilibrium variant here but `equilibrium_bound_proportional` was measured before the shipped controller had
its hold (beta times `(KL / target) ** hold_power` once the KL has arrived) and runs without it (`hold_power` 0), so
that its command repeats what it measured (`equilibrium_bound_proportional` keeps klppo's hold); the hold itself is
ablated through its constant (`--kwargs '{"hold_power": 0}'`).

The equilibrium controller's approach is ablated through its constant (`--kwargs '{"approach_power": 0}'`), the
tracking controller's lookahead through its constant (`--kwargs '{"lookahead": 0}'`). The tracking controller's EMA of
the reading and the start-up rule's exception (a raw reading near the target ends the no-rise rule before the
EMA does) were ablated the same way and removed (`results/controller_grid/README.md`); their plug-in and constant
are in the git history.

The guard is ablated through a setting, `--config '{"experimental": {"kl_guard": false}}'`, and its pieces by
the guards registered here, selected the same way:

- `no_low_side` (`{"kl_guard": "no_low_side"}`): the guard without its low side;
- `keeps_momentum` (`{"kl_guard": "keeps_momentum"}`): the optimizer's momentum is kept when it fires.

(A bound on one update's change of log beta, 1, was ablated and removed: the same cells within bounds and the same
mean tracking error on seed 3, and it never bound on the default task.)
"""

from __future__ import annotations

from klppo.kl.controllers import EquilibriumKLController, TrackingKLController, register_kl_controller
from klppo.ppo.safety.kl_guard import LOWER, KLGuard, register_kl_guard


class _ConstantGain(EquilibriumKLController):
    constant_gain = 1.0  # not `gain`: the controller sets that on the instance (the step it took, for logging)

    def equilibrium_coef(self):
        before = self.coef
        new = super().equilibrium_coef()
        if self.ess is not None and self.gain != 0.0:  # a batch that tells nothing takes no step here either
            self.ess = self.gain = self.constant_gain  # recompute the step with a constant gain
            import math

            now = math.log(before)
            return self.from_log(now + self.gain * (self.estimate - now))
        return new


@register_kl_controller("equilibrium_full_step")
class FullStep(_ConstantGain):
    constant_gain = 1.0


@register_kl_controller("equilibrium_ema")
class Ema(_ConstantGain):
    constant_gain = 0.3


@register_kl_guard("no_low_side")
class GuardWithoutLowSide(KLGuard):
    """klppo's guard with its upper side only."""

    lower = False


@register_kl_guard("low_crossing")
class GuardLowOnCrossing(KLGuard):
    """klppo's guard whose low side acts only on an update that started at or above the target (its rollout's
    reading) and has pushed the KL below it: an update that starts below the target is never cut by it."""

    def check(self, kl_sum, kl_count, kl_rollout, reading, change_sq=None):
        verdict = super().check(kl_sum, kl_count, kl_rollout, reading, change_sq)
        if verdict == LOWER and reading is not None and reading < self.target * self.lower_at:
            return None
        return verdict


@register_kl_guard("low_band")
class GuardLowBand(KLGuard):
    """klppo's guard whose low side acts at 0.8 x the target instead of the target."""

    lower_at = 0.8


@register_kl_guard("low_significant")
class GuardLowSignificant(KLGuard):
    """klppo's guard whose low side acts only on a fall of the KL larger than two standard errors of its estimate on
    the mini-batch."""

    low_significance = 2.0


@register_kl_guard("keeps_momentum")
class GuardKeepingMomentum(KLGuard):
    """klppo's guard, leaving the optimizer's momentum as it is when it fires."""

    clears_momentum = False


@register_kl_controller("tracking_no_startup")
class TrackingNoStartup(TrackingKLController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = True


@register_kl_controller("tracking_no_antiwindup")
class TrackingNoAntiWindup(TrackingKLController):
    def next_coef(self, kl, n_steps):
        bounds = self.coef_min, self.coef_max
        self.coef_min, self.coef_max = 1e-30, 1e30  # the integral's clamp follows these bounds
        try:
            beta = super().next_coef(kl, n_steps)
        finally:
            self.coef_min, self.coef_max = bounds
        return min(max(beta, self.coef_min), self.coef_max)


@register_kl_controller("tracking_no_reset_hook")
class TrackingKeepingItsStateAtResets(TrackingKLController):
    """The tracking controller, its integral and start-up hold carried across a reference reset unchanged."""

    def reference_reset(self) -> None:
        pass


@register_kl_controller("equilibrium_integral")
class EquilibriumWithApproachIntegral(EquilibriumKLController):
    """The equilibrium controller whose approach also integrates: until the KL first reaches the target, log beta
    goes down further by ``approach_integral`` times the sum, over the updates so far, of ``log(kl / target)`` (each
    term at least -2), so that a policy that stays below the target for long is held back less and less. The sum is
    dropped when the KL arrives (beta is then the equilibrium coefficient, as in the shipped controller without its
    hold) and at a reference reset."""

    def __init__(self, *args, approach_integral: float = 0.1, **kwargs):
        super().__init__(*args, **{"hold_power": 0.0, **kwargs})
        self.approach_integral = float(approach_integral)
        self.approach_sum = 0.0

    def next_coef(self, kl: float, n_steps: int) -> float:
        import math

        coef = super().next_coef(kl, n_steps)
        if self.arrived:
            self.approach_sum = 0.0
            return coef
        term = max(math.log(max(kl, 1e-12) / self.target), -2.0)
        self.approach_sum = max(
            self.approach_sum + self.approach_integral * term, math.log(self.coef_min / self.coef_max)
        )
        return self.from_log(math.log(coef) + self.approach_sum)

    def reference_reset(self) -> None:
        super().reference_reset()
        self.approach_sum = 0.0


@register_kl_controller("equilibrium_pi")
class EquilibriumWithIntegral(EquilibriumKLController):
    """The equilibrium coefficient as the set point, times ``exp(I)``, where ``I`` integrates the measured error:
    each update adds ``integral_gain`` times ``log(kl / target)`` (clipped to [-2, 2]) to ``I``, kept within the
    coefficient bounds' span. While the policy lags, ``I`` holds beta below the equilibrium; once the KL holds the
    target ``I`` stops moving, and a policy at the optimum of beta has beta = beta*."""

    def __init__(self, *args, integral_gain: float = 0.05, **kwargs):
        super().__init__(*args, **{"hold_power": 0.0, **kwargs})
        self.integral_gain = float(integral_gain)
        self.integral = 0.0

    def next_coef(self, kl: float, n_steps: int) -> float:
        import math

        coef = super().next_coef(kl, n_steps)
        term = min(max(math.log(max(kl, 1e-12) / self.target), -2.0), 2.0)
        span = math.log(self.coef_max / self.coef_min)
        self.integral = min(max(self.integral + self.integral_gain * term, -span), span)
        return self.from_log(math.log(coef) + self.integral)

    def reference_reset(self) -> None:
        super().reference_reset()
        self.integral = 0.0


@register_kl_controller("equilibrium_window")
class EquilibriumOverAWindow(EquilibriumKLController):
    """The shipped controller stepping toward the mean of the last ``window`` batches' estimates of log beta*,
    each weighted by its effective sample size, instead of toward the latest one alone: near the optimum (gain
    close to 1) beta follows a 32-sequence batch's sampling noise less. The window is emptied at a reference reset."""

    def __init__(
        self,
        kl_coef: float,
        target: float,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        approach_power: float = 0.75,
        optimum=None,
        window: int = 4,
        hold_power: float = 0.0,
    ):
        super().__init__(kl_coef, target, coef_min, coef_max, approach_power, optimum, hold_power=hold_power)
        self.window = int(window)
        self.recent: list[tuple[float, float]] = []

    def equilibrium_coef(self):
        import math

        before = self.coef
        new = super().equilibrium_coef()
        if self.estimate is None or self.gain == 0.0:  # no batch, or one that tells nothing
            return new
        self.recent = [*self.recent, (self.estimate, self.ess)][-self.window :]
        now = max(math.log(before), self.log_bounds()[0])
        return self.from_log(now + self.ess * (self.pooled() - now))

    def pooled(self) -> float:
        """The estimates' mean, weighted by their effective sample sizes."""
        weight = sum(w for _, w in self.recent)
        return sum(b * w for b, w in self.recent) / weight if weight > 0 else self.recent[-1][0]

    def reference_reset(self) -> None:
        super().reference_reset()
        self.recent = []


@register_kl_controller("equilibrium_median")
class EquilibriumOverAMedian(EquilibriumOverAWindow):
    """As `equilibrium_window`, toward the median of the last ``window`` (default 3) estimates: a single batch's
    estimate far above the rest (32 sequences at the optimum give a long right tail) moves beta no more than the
    middle one."""

    def __init__(
        self,
        kl_coef: float,
        target: float,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        approach_power: float = 0.75,
        optimum=None,
        window: int = 3,
        hold_power: float = 0.0,
    ):
        super().__init__(kl_coef, target, coef_min, coef_max, approach_power, optimum, window, hold_power)

    def pooled(self) -> float:
        import statistics

        return statistics.median(b for b, _ in self.recent)


@register_kl_controller("equilibrium_kalman")
class EquilibriumKalman(EquilibriumKLController):
    """log beta* followed by a one-dimensional Kalman filter instead of the effective-sample-size step: each batch's
    estimate ``b`` is a measurement whose variance is its grouped jackknife variance (``groups`` groups of the
    batch's sequences) divided by the effective-sample-size share ``g`` (an estimate far from the policy counts for
    less, as the shipped gain has it); the state's variance grows by ``drift ** 2`` per update (how far beta* may move
    in one). Many small noisy batches are averaged; one large clean batch moves beta at once."""

    def __init__(
        self,
        kl_coef: float,
        target: float,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        approach_power: float = 0.75,
        optimum=None,
        drift: float = 0.05,
        groups: int = 8,
        hold_power: float = 0.0,
    ):
        super().__init__(kl_coef, target, coef_min, coef_max, approach_power, optimum, hold_power=hold_power)
        self.drift, self.groups = float(drift), int(groups)
        self.variance = 1.0  # of log beta*, before any batch

    def equilibrium_coef(self):
        import math

        import torch

        batch = self._batch
        before = self.coef
        new = super().equilibrium_coef()
        if self.estimate is None or batch is None:
            return new
        scores, log_ratios, lengths, unit = batch
        r = torch.as_tensor(scores, dtype=torch.float64)
        d = torch.as_tensor(log_ratios, dtype=torch.float64)
        target = self.target * (float(torch.as_tensor(lengths, dtype=torch.float64).mean()) if unit == "token" else 1.0)
        lo, hi = self.log_bounds()
        if self.bound_side(self.estimate):  # the target lies beyond the batch's reach: no measurement
            self.variance += self.drift**2
            return before
        measurement_var = self.jackknife_variance(r, d, target, lo, hi, self.groups)
        if measurement_var is None:
            return new
        now = max(math.log(before), lo)
        gain = self.filter_gain(self.estimate - now, measurement_var, self.ess)
        self.ess = gain  # logged as the step taken
        return self.from_log(now + gain * (self.estimate - now))

    def filter_gain(self, innovation: float, jackknife_var: float, share: float) -> float:
        """The Kalman gain, the measurement's variance its jackknife variance over the effective-sample-size share;
        updates the state's variance."""
        measurement_var = jackknife_var / max(share, 1e-3)
        prior = self.variance + self.process_variance(innovation, measurement_var)
        gain = prior / (prior + measurement_var)
        self.variance = (1 - gain) * prior
        return gain

    def process_variance(self, innovation: float, measurement_var: float) -> float:
        """How far log beta* may have moved since the last update: ``drift ** 2``."""
        return self.drift**2

    def reference_reset(self) -> None:
        super().reference_reset()
        self.variance = 1.0


@register_kl_controller("equilibrium_kalman_adaptive")
class EquilibriumKalmanAdaptive(EquilibriumKalman):
    """`equilibrium_kalman` whose process variance is matched to its innovations (covariance matching, Mehra 1972):
    the median over the last ``window`` updates of the innovation's square less what the filter expects of it (its
    own variance plus the measurement's), floored at ``drift ** 2``. Noise around a still beta* leaves the median
    below the floor; an estimate that moves with the policy keeps the innovations on one side, their squares above
    what the filter expects, and the filter's variance open."""

    def __init__(
        self,
        kl_coef: float,
        target: float,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        approach_power: float = 0.75,
        optimum=None,
        drift: float = 0.05,
        groups: int = 8,
        window: int = 8,
        hold_power: float = 0.0,
    ):
        super().__init__(kl_coef, target, coef_min, coef_max, approach_power, optimum, drift, groups, hold_power)
        self.window = int(window)
        self.excess: list[float] = []

    def process_variance(self, innovation: float, measurement_var: float) -> float:
        import statistics

        self.excess = [*self.excess, innovation**2 - self.variance - measurement_var][-self.window :]
        return max(self.drift**2, statistics.median(self.excess))

    def reference_reset(self) -> None:
        super().reference_reset()
        self.excess = []


@register_kl_controller("equilibrium_kalman_gated")
class EquilibriumKalmanGated(EquilibriumKalmanAdaptive):
    """The shipped step where the batch is far from beta*, the Kalman filter's average near it: the gain is the
    smaller of the effective-sample-size share (the shipped controller's gain) and the Kalman gain whose measurement
    variance is the jackknife's alone. Far from the optimum the share is small and the shipped controller's approach
    is kept; near it the share is close to 1 and the filter averages the batches' noise. The state's variance follows
    the gain taken (Joseph's form). The process variance is `equilibrium_kalman_adaptive`'s; ``window=0`` fixes it
    at ``drift ** 2``."""

    def filter_gain(self, innovation: float, jackknife_var: float, share: float) -> float:
        prior = self.variance + self.process_variance(innovation, jackknife_var)
        gain = min(share, prior / (prior + jackknife_var))
        self.variance = (1 - gain) ** 2 * prior + gain**2 * jackknife_var
        return gain

    def process_variance(self, innovation: float, measurement_var: float) -> float:
        return super().process_variance(innovation, measurement_var) if self.window > 0 else self.drift**2


@register_kl_controller("equilibrium_bound_proportional")
class EquilibriumBoundProportional(EquilibriumKLController):
    """On a coefficient bound the batch says only that beta* lies beyond it; this variant steps log beta toward the
    bound by at most the KL measured's log error, |log(KL / target)| (the controller's `last_error`, which is at least
    -1: below target / e the cap is 1), where klppo steps by the share of the batch, which can multiply beta by 10 or
    more in one update with the KL 1.1x the target (`tests/test_lab.py`). `kl/gain` still logs the share."""

    def equilibrium_coef(self):
        import math

        before = self.coef
        new = super().equilibrium_coef()
        if self.estimate is None or not self.gain or not self.bound_side(self.estimate):
            return new
        now = max(math.log(before), self.log_bounds()[0])
        cap = abs(self.last_error)
        return self.from_log(now + max(-cap, min(cap, math.log(new) - now)))
