"""The tracking controller: PI control of log(beta) on the KL reading, with a start-up hold."""

from __future__ import annotations

import math
from typing import Optional

from .base import (
    _LOG_LIMIT,
    LogSpaceController,
    _check_bounds,
    _check_nonnegative,
    _check_positive,
    register_kl_controller,
    safe_log,
)

__all__ = ["TrackingKLController"]


@register_kl_controller("tracking")
class TrackingKLController(LogSpaceController):
    """PI control of log(beta) on the KL reading, with a start-up hold: holds a target where integral control
    winds up while the policy is still on its way. klppo's default with a ``kl_target`` for a KL whose optimum is not
    known (``equilibrium`` is elsewhere).

    Per update, with reading ``kl``::

        s, se = least-squares slope of the last ``window`` readings per update, and its standard error
        p  =  kl + lookahead * max(s, 0)               where the KL is heading
        e  =  clip(log(max(p, target / e) / target), -1, 1)
        I  <- I + ki * e; I never takes the output past a bound (anti-windup). Start-up hold: until a reading
              first reaches arm_fraction * target, a negative e is not integrated while the KL is on course
              (the window's slope s exceeds twice its standard error se and would carry the reading to
              arm_fraction * target within ``window`` updates), or the window's mean is not above zero by
              twice its standard error and by target / 100 (the policy has not moved yet), or there are fewer
              than 3 readings; otherwise it is integrated at startup_rate * ki.
              Until then, too, beta never rises: I <- min(I, log beta_prev - log beta0 - kp * e)
        log beta = log beta0 + kp * e + I,             clamped to [log coef_min, log coef_max]

    Why each piece (Stooke, Achiam & Abbeel, ICML 2020, "Responsive Safety in RL by PID Lagrangian
    Methods", control the Lagrange multiplier of a constraint the same way):

    - The policy needs many updates to move, so early on the KL reads below the target whatever beta
      is. Integral control on that reading cuts beta while nothing has happened yet (start-up
      windup), and the KL then overshoots. The distinction that matters is whether the KL is still
      on its way: until the KL first comes near the target, the integral does not fall while the
      last ``window`` readings rise significantly (a least-squares slope above twice its standard
      error: a noise-aware test) and fast enough to get there within ``window`` updates, nor while
      their mean is indistinguishable from zero (the policy has not started to move). The only cut
      meanwhile is the proportional term, which undoes itself as the KL rises. A KL that levels off
      below the target, or creeps toward it too slowly to arrive within the window, is held back too
      hard: the integral then falls at ``startup_rate`` times its gain, and stops falling again as
      soon as the KL is on course (a test of "rising" alone can hold beta for a whole run on a KL that
      creeps up far below the target). Nor does a KL still short of the target raise beta before it first
      arrives: the proportional term's cut shrinks as the KL rises, and the integral takes over what it gives
      back (else, where the KL answers beta steeply, the fading cut raises beta while the KL climbs, and the
      KL falls back and arrives later). After the KL has first come near the target, the integral acts at
      full gain both ways. The runs behind both rules: `docs/results.md`, "The controllers in brief".
    - The error is taken on the predicted KL: beta rises while the KL is still climbing toward an
      overshoot, before it happens. Only a rise counts (derivative on rising KL only, as Stooke et
      al.): a falling KL does not cut beta early.
    - The error is ``log(KL / target)``: the KL of the regularised optimum falls roughly as a power
      of beta, so the loop is about linear in log space, symmetric for KL too high and too low, and
      independent of the unit and size of the target. It is clipped to +-1 (a 10x spike moves beta
      by at most ``exp(kp + ki)``).
    - The proportional term damps; the integral removes the steady-state error.

    Each piece stayed because an ablation on the one-token bandit's speed grid kept it (`docs/results.md`, "The
    controllers in brief").

    Beta acts on the KL two readings after the one that set it, and each update moves the KL by an amount
    beta does not decide, so the gains alone cannot hold the KL tighter than a fixed beta near the equilibrium
    would. ``KLPPOTrainer`` therefore pairs this controller, by default, with a guard inside the
    update on both sides of the target (``kl_guard``): an update that has pushed the KL past the target takes no
    more steps, and once the KL has reached the target, neither does one that has pulled it back below.
    """

    def __init__(
        self,
        kl_coef: float,
        target: float,
        kp: float = 0.3,
        ki: float = 0.1,
        lookahead: float = 2.0,
        window: int = 10,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        arm_fraction: float = 0.8,
        startup_rate: float = 0.75,
    ):
        kl_coef = _check_positive(
            kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)"
        )
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 4 (nats/sequence)")
        self.arm_fraction = _check_positive(
            arm_fraction, "arm_fraction", "the start-up hold ends at this fraction of the target, e.g. 0.8"
        )
        self.startup_rate = _check_nonnegative(
            startup_rate,
            "startup_rate",
            "the share of ki used to lower beta before the KL first nears the target, e.g. 0.75",
        )
        self.kp = _check_nonnegative(kp, "kp", "gains must be >= 0 (defaults: kp=0.3, ki=0.1)")
        self.ki = _check_nonnegative(ki, "ki", "gains must be >= 0 (defaults: kp=0.3, ki=0.1)")
        self.lookahead = _check_nonnegative(lookahead, "lookahead", "it is a number of updates, e.g. 2 (0 disables)")
        if isinstance(window, bool) or int(window) != window or window < 3:
            raise ValueError(f"window must be an int >= 3 (updates), got {window!r}; e.g. 20")
        self.window = int(window)
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))
        self.log_beta0 = math.log(self._value) if self._value > 0 else -_LOG_LIMIT
        self.integral = 0.0
        self.readings: list[float] = []
        self.slope = 0.0
        self.armed = False
        self.holding = True
        self.predicted: Optional[float] = None

    def _trend(self) -> tuple[float, float]:
        """Least-squares slope per update of the readings in the window, and its standard error
        (inf with fewer than 3 readings)."""
        n = len(self.readings)
        if n < 3:
            return 0.0, math.inf
        mean_x = (n - 1) / 2
        mean_y = sum(self.readings) / n
        sxx = sum((i - mean_x) ** 2 for i in range(n))
        slope = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(self.readings)) / sxx
        residual = sum((y - mean_y - slope * (i - mean_x)) ** 2 for i, y in enumerate(self.readings))
        return slope, math.sqrt(residual / (n - 2) / sxx)

    def _on_course(self, stderr: float) -> bool:
        """The readings in the window rise significantly (slope above twice its standard error) and fast
        enough to carry the KL to ``arm_fraction * target`` within ``window`` updates."""
        if len(self.readings) < 3:
            return True
        gap = self.arm_fraction * self.target - self.readings[-1]
        return self.slope > 2.0 * stderr and self.slope * self.window >= gap

    def _moved(self) -> bool:
        """The mean reading of the window is significantly above zero (by twice its standard error) and above
        a hundredth of the target: a statistic that is never negative (``full``) reads a tiny steady floor with
        little noise, which is not a policy on its way."""
        n = len(self.readings)
        if n < 3:
            return False
        mean = sum(self.readings) / n
        std = math.sqrt(sum((y - mean) ** 2 for y in self.readings) / (n - 1))
        return mean > max(2.0 * std / math.sqrt(n), self.target / 100)

    def next_coef(self, kl: float, n_steps: int) -> float:
        self.readings = (self.readings + [kl])[-self.window :]
        self.slope, stderr = self._trend()
        if kl >= self.arm_fraction * self.target:
            self.armed = True
        # start-up hold: until the KL first comes near the target, the integral does not fall while the
        # KL is on course to get there, or while the policy has not measurably moved from the reference
        self.holding = not self.armed and (self._on_course(stderr) or not self._moved())
        self.predicted = kl + self.lookahead * max(self.slope, 0.0)
        error = math.log(max(self.predicted, self.target / math.e) / self.target)
        error = min(max(error, -1.0), 1.0)
        self.last_error = error
        integrate = error
        if error < 0 and not self.armed:
            # start-up: the KL cannot yet tell "not moved yet" from "held back too hard"
            integrate = 0.0 if self.holding else self.startup_rate * error
        lo, hi = self.log_bounds()
        rest = self.log_beta0 + self.kp * error
        # anti-windup: the integral never takes the output past a bound
        self.integral = min(max(self.integral + self.ki * integrate, lo - rest), hi - rest)
        if error < 0 and not self.armed:
            # start-up: a KL still short of the target never raises beta. The proportional term's cut fades as
            # the KL rises; the integral keeps it instead (bumpless), so beta does not climb back before the KL
            # arrives.
            self.integral = min(self.integral, max(safe_log(self._value), lo) - rest)
        return self.from_log(rest + self.integral)

    def _hparams(self) -> dict:
        return dict(
            target=self.target,
            kp=self.kp,
            ki=self.ki,
            lookahead=self.lookahead,
            window=self.window,
            arm_fraction=self.arm_fraction,
            startup_rate=self.startup_rate,
            coef_min=self.coef_min,
            coef_max=self.coef_max,
        )

    def reference_reset(self) -> None:
        """The climb from 0 again: the start-up hold re-arms, the window and the integral start from the current
        beta."""
        self.log_beta0, self.integral = safe_log(self._value), 0.0
        self.readings, self.slope, self.armed, self.holding, self.predicted = [], 0.0, False, True, None

    def _dynamic_state(self) -> dict:
        return {
            "log_beta0": self.log_beta0,
            "integral": self.integral,
            "readings": list(self.readings),
            "slope": self.slope,
            "armed": self.armed,
            "holding": self.holding,
            "predicted": self.predicted,
        }

    def _load_dynamic_state(self, state: dict) -> None:
        self.log_beta0 = float(state["log_beta0"])
        self.integral = float(state["integral"])
        self.readings = [float(x) for x in state.get("readings", [])][-self.window :]
        self.slope = float(state.get("slope", 0.0))
        self.armed = bool(state.get("armed", False))
        self.holding = bool(state.get("holding", True))
        self.predicted = None if state.get("predicted") is None else float(state["predicted"])
