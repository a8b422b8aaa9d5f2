"""The classic controllers: a fixed coefficient, Ziegler et al.'s proportional rule (``adaptive``), the exponential
rule, and PID control of log(beta)."""

from __future__ import annotations

import math
from typing import Optional

from .base import (
    _LOG_LIMIT,
    KLController,
    LogSpaceController,
    _check_bounds,
    _check_nonnegative,
    _check_positive,
    register_kl_controller,
    safe_log,
)

__all__ = ["FixedKLController", "AdaptiveKLController", "ExponentialKLController", "PIDKLController"]


@register_kl_controller("fixed", needs_target=False)
class FixedKLController(KLController):
    """beta never changes. ``kl_coef >= 0`` (0 turns the penalty off).

    ``beta <- beta``. Why: the objective ``E[r] - beta * KL`` with beta chosen in advance, as most published PPO
    recipes run it; the reference every adaptive controller is measured against.
    """

    def __init__(self, kl_coef: float):
        kl_coef = _check_nonnegative(kl_coef, "kl_coef", "use 0 to disable the KL penalty")
        super().__init__(kl_coef)

    def next_coef(self, kl: float, n_steps: int) -> float:
        return self._value


@register_kl_controller("adaptive")
class AdaptiveKLController(KLController):
    """Proportional control of beta (Ziegler et al. 2019, Sec. 2.2; trlx, old TRL, verl, OpenRLHF).

    ``e = clip(kl / target - 1, -error_clip, error_clip)``
    ``beta <- clamp(beta * max(1 + e * n_steps / horizon, min_multiplier), coef_min, coef_max)``

    ``n_steps`` is the number of sequences in the GLOBAL batch. With the defaults
    (``error_clip=0.2``, no bounds) this is exactly Ziegler's rule as long as
    ``n_steps / horizon < 1 / error_clip``; beyond that the pure rule's multiplier would reach zero
    or turn negative (and flip beta's sign), so it is floored at ``min_multiplier`` (0.1: beta can
    shrink at most tenfold in one update). Typical settings: target 6 nats per sequence with
    horizon 10000 (trlx), or 0.1 nats per token (verl).
    """

    MIN_MULTIPLIER = 0.1

    def __init__(
        self,
        kl_coef: float,
        target: float,
        horizon: float = 10000,
        error_clip: float = 0.2,
        coef_min: float = 0.0,
        coef_max: float = math.inf,
    ):
        kl_coef = _check_positive(
            kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)"
        )
        self.target = _check_positive(
            target, "target", "set kl_target to the KL you want, e.g. 6 (nats/sequence) or 0.1 (nats/token)"
        )
        self.horizon = _check_positive(horizon, "horizon", "set kl_controller_kwargs horizon, e.g. 10000 sequences")
        self.error_clip = _check_positive(error_clip, "error_clip", "Ziegler et al. use 0.2")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))

    def next_coef(self, kl: float, n_steps: int) -> float:
        error = min(max(kl / self.target - 1.0, -self.error_clip), self.error_clip)
        self.last_error = error
        multiplier = max(1.0 + error * n_steps / self.horizon, self.MIN_MULTIPLIER)
        return min(max(self._value * multiplier, self.coef_min), self.coef_max)

    def _hparams(self) -> dict:
        return dict(
            target=self.target,
            horizon=self.horizon,
            error_clip=self.error_clip,
            coef_min=self.coef_min,
            coef_max=self.coef_max,
        )


@register_kl_controller("exponential")
class ExponentialKLController(LogSpaceController):
    """``beta <- clamp(beta * exp(rate * (kl - target)), coef_min, coef_max)``.

    Computed in log space (``log beta + rate * (kl - target)``, clamped, then exp), so a huge
    reading saturates at ``coef_max`` instead of overflowing. The error is absolute, not relative:
    the effective gain is ``rate * target`` per update, so the same ``rate`` is sluggish for a small
    per-token target and aggressive for a large per-sequence one. Defaults: rate 0.1, beta in
    [1e-4, 10]. Typical per-token targets: 0.01-0.03 conservative, 0.05-0.10 moderate,
    0.10-0.20 aggressive.
    """

    def __init__(
        self,
        kl_coef: float,
        target: float,
        rate: float = 0.1,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
    ):
        kl_coef = _check_positive(
            kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)"
        )
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 0.05 (nats/token)")
        self.rate = _check_positive(rate, "rate", "rate is a gain per nat of error, e.g. 0.1")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))

    def next_coef(self, kl: float, n_steps: int) -> float:
        self.last_error = kl - self.target
        step = self.rate * (kl - self.target)  # may be +-inf for absurd readings: saturates below
        return self.from_log(math.log(self._value) + step)

    def _hparams(self) -> dict:
        return dict(target=self.target, rate=self.rate, coef_min=self.coef_min, coef_max=self.coef_max)


@register_kl_controller("pid")
class PIDKLController(LogSpaceController):
    """PID control of log(beta) on the relative error, with anti-windup and bounds.

    ``e = clip((kl - target) / target, -error_clip, error_clip)``
    ``I <- clamp(I + ki * e, I_lo, I_hi)``, and while the output is saturated in the direction
    ``e`` pushes, ``I`` is held where it puts the output exactly on the bound (anti-windup)
    ``log beta = log beta0 + kp * e + I + kd * (e - e_prev)``, clamped to ``[log coef_min,
    log coef_max]``.

    ``I`` is kept in units of log(beta) (it accumulates ``ki * e``), bounded by ``integral_limit``
    and by the range that can still move the output: ``[log(coef_min/beta0), log(coef_max/beta0)]``.

    Why these defaults (``kp=0.1, ki=0.3, kd=0, error_clip=1``): the relative error makes the gains
    independent of the unit and size of the target. The plant seen by the controller is roughly
    ``kl ~ c / beta`` (a larger penalty, a smaller drift), so near the target ``e ~ -(log beta -
    log beta*)``: the integral term alone contracts the log-error by ``1 - ki`` per update (0.7),
    fast (from a tenfold error, ~20 updates, each step being capped by ``error_clip``) yet
    averaging measurement noise over several updates; a small
    proportional term adds damping when the KL lags behind beta (the policy takes several updates
    to move); the derivative term stays off because a batch's KL reading is noisy. ``error_clip=1``
    caps a step at ``exp(kp + ki) ~ 1.5x`` however far off a reading is (a 10x KL spike moves beta
    by at most 50%). See ``tests/test_kl_controllers.py`` for the simulated plants.
    """

    def __init__(
        self,
        kl_coef: float,
        target: float,
        kp: float = 0.1,
        ki: float = 0.3,
        kd: float = 0.0,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        integral_limit: float = 20.0,
        error_clip: float = 1.0,
    ):
        kl_coef = _check_positive(
            kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)"
        )
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 0.05 (nats/token)")
        self.kp = _check_nonnegative(kp, "kp", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.ki = _check_nonnegative(ki, "ki", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.kd = _check_nonnegative(kd, "kd", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.integral_limit = _check_positive(
            integral_limit, "integral_limit", "it bounds the integral term in units of log(beta), e.g. 20"
        )
        self.error_clip = _check_positive(error_clip, "error_clip", "it bounds the relative error, e.g. 1.0")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))
        self.log_beta0 = math.log(self._value) if self._value > 0 else -_LOG_LIMIT
        self.integral = 0.0
        self.prev_error: Optional[float] = None

    def _integral_bounds(self) -> tuple[float, float]:
        lo, hi = self.log_bounds()
        return (max(-self.integral_limit, lo - self.log_beta0), min(self.integral_limit, hi - self.log_beta0))

    def next_coef(self, kl: float, n_steps: int) -> float:
        error = (kl - self.target) / self.target
        error = min(max(error, -self.error_clip), self.error_clip)
        self.last_error = error
        derivative = 0.0 if self.prev_error is None else error - self.prev_error
        lo, hi = self.log_bounds()
        i_lo, i_hi = self._integral_bounds()

        rest = self.log_beta0 + self.kp * error + self.kd * derivative
        integral = min(max(self.integral + self.ki * error, i_lo), i_hi)
        # anti-windup: while the output is saturated in the direction the error pushes, hold the
        # integral where it puts the output exactly on the bound (and never move it against e)
        if error > 0 and rest + integral > hi:
            integral = min(integral, max(self.integral, hi - rest))
        elif error < 0 and rest + integral < lo:
            integral = max(integral, min(self.integral, lo - rest))
        u = rest + integral
        self.integral = integral
        self.prev_error = error
        return self.from_log(u)

    def _hparams(self) -> dict:
        return dict(
            target=self.target,
            kp=self.kp,
            ki=self.ki,
            kd=self.kd,
            coef_min=self.coef_min,
            coef_max=self.coef_max,
            integral_limit=self.integral_limit,
            error_clip=self.error_clip,
        )

    def reference_reset(self) -> None:
        self.log_beta0, self.integral, self.prev_error = safe_log(self._value), 0.0, None

    def _dynamic_state(self) -> dict:
        return {"log_beta0": self.log_beta0, "integral": self.integral, "prev_error": self.prev_error}

    def _load_dynamic_state(self, state: dict) -> None:
        self.log_beta0 = float(state["log_beta0"])
        self.integral = float(state["integral"])
        prev = state.get("prev_error")
        self.prev_error = None if prev is None else float(prev)
