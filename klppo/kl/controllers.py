"""KL coefficient controllers.

Every controller has the same surface:

- ``.value``: the current coefficient beta (a Python float);
- ``.update(kl, n_steps) -> float``: feed the KL statistic of the latest rollout batch (already
  reduced over all ranks, see ``klppo.kl.reduce``) and the number of sequences in the GLOBAL batch;
  returns the new beta. Call it once per rollout batch, on every rank with the same inputs, so that
  the ranks stay identical. A NaN or infinite reading leaves beta unchanged and is counted in
  ``skipped_updates``.
- ``.state_dict()`` / ``.load_state_dict(d)``: a JSON-serialisable dict (checkpoint it: verl issue
  2653 shows what happens when beta is not saved). The state records the class, so loading it into
  another kind of controller fails. Hyperparameters are stored for the record but not restored: the
  constructor (the config of the resumed run) decides them.
- ``.name``: ``"fixed"``, ``"adaptive"``, ``"exponential"`` or ``"pid"``.

The unit of the statistic (nats per token or per sequence) is the caller's choice; the target must
be given in the same unit.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = [
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "ExponentialKLController",
    "PIDKLController",
    "build_kl_controller",
    "KL_CONTROLLERS",
]

KL_CONTROLLERS = ("fixed", "adaptive", "exponential", "pid")

# Multiplicative controllers keep beta inside [exp(-700), exp(700)] whatever the bounds say, so
# that exp() can neither overflow nor underflow to 0.
_LOG_LIMIT = 700.0


def _as_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _json_float(x: float):
    """JSON has no inf/NaN: store them as strings."""
    return x if math.isfinite(x) else str(x)


def _check_positive(value, name: str, fix: str) -> float:
    value = _as_float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}; {fix}")
    return value


def _check_nonnegative(value, name: str, fix: str) -> float:
    value = _as_float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}; {fix}")
    return value


def _check_bounds(coef_min, coef_max) -> tuple[float, float]:
    coef_min, coef_max = _as_float(coef_min), _as_float(coef_max)
    if math.isnan(coef_min) or coef_min < 0 or math.isinf(coef_min):
        raise ValueError(f"coef_min must be a finite number >= 0, got {coef_min}")
    if math.isnan(coef_max) or coef_max <= 0:
        raise ValueError(f"coef_max must be > 0 (inf for no upper bound), got {coef_max}")
    if coef_min > coef_max:
        raise ValueError(
            f"coef_min ({coef_min}) must not exceed coef_max ({coef_max}); swap them or widen the range"
        )
    return coef_min, coef_max


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


class KLController:
    """Base class: bookkeeping shared by all controllers. Subclasses implement ``_step``."""

    name = "base"

    def __init__(self, kl_coef: float):
        self._value = _as_float(kl_coef)
        self.n_updates = 0
        self.skipped_updates = 0
        self.last_kl: Optional[float] = None
        self.last_error: Optional[float] = None

    @property
    def value(self) -> float:
        return self._value

    def update(self, kl: float, n_steps: int) -> float:
        """Feed one rollout batch's KL statistic; return the new coefficient.

        kl: the KL statistic (Python float or 0-dim tensor) in the unit of the target.
        n_steps: sequences in the global batch (used by the adaptive controller; must be >= 0).
        """
        try:
            steps = int(n_steps)
        except (TypeError, ValueError, OverflowError):
            steps = None
        if isinstance(n_steps, bool) or steps is None or steps != n_steps or steps < 0:
            raise ValueError(f"n_steps must be an int >= 0 (sequences in the global batch), got {n_steps!r}")
        kl = _as_float(kl)
        if not math.isfinite(kl):
            self.skipped_updates += 1
            return self._value
        new = self._step(kl, steps)
        if math.isfinite(new) and new >= 0:  # defensive: a controller must never emit NaN
            self._value = new
        else:
            self.skipped_updates += 1
            return self._value
        self.last_kl = kl
        self.n_updates += 1
        return self._value

    def _step(self, kl: float, n_steps: int) -> float:
        raise NotImplementedError

    # -- checkpointing ------------------------------------------------------------------------

    def _hparams(self) -> dict:
        return {}

    def _dynamic_state(self) -> dict:
        return {}

    def _load_dynamic_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {
            "class": type(self).__name__,
            "name": self.name,
            "value": self._value,
            "n_updates": self.n_updates,
            "skipped_updates": self.skipped_updates,
            "last_kl": self.last_kl,
            "last_error": self.last_error,
            "hparams": {k: _json_float(v) for k, v in self._hparams().items()},
            **self._dynamic_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        cls = state.get("class") if isinstance(state, dict) else None
        if cls != type(self).__name__:
            raise ValueError(
                f"Cannot load a {cls!r} controller state into {type(self).__name__}: the checkpoint was "
                f"written with kl_controller={state.get('name') if isinstance(state, dict) else None!r}; "
                f"resume with that controller or start the coefficient afresh"
            )
        value = _as_float(state["value"])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"Controller state holds an invalid coefficient {state['value']!r}")
        self._value = value
        self.n_updates = int(state.get("n_updates", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.last_kl = state.get("last_kl")
        self.last_error = state.get("last_error")
        self._load_dynamic_state(state)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self._hparams().items())
        return f"{type(self).__name__}(value={self._value:.6g}{', ' + hp if hp else ''})"


class FixedKLController(KLController):
    """beta never changes. ``kl_coef >= 0`` (0 turns the penalty off)."""

    name = "fixed"

    def __init__(self, kl_coef: float):
        kl_coef = _check_nonnegative(kl_coef, "kl_coef", "use 0 to disable the KL penalty")
        super().__init__(kl_coef)

    def _step(self, kl: float, n_steps: int) -> float:
        return self._value


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

    name = "adaptive"
    MIN_MULTIPLIER = 0.1

    def __init__(
        self,
        kl_coef: float,
        target: float,
        horizon: float,
        error_clip: float = 0.2,
        coef_min: float = 0.0,
        coef_max: float = math.inf,
    ):
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 6 (nats/sequence) or 0.1 (nats/token)")
        self.horizon = _check_positive(horizon, "horizon", "set kl_horizon, e.g. 10000 sequences")
        self.error_clip = _check_positive(error_clip, "error_clip", "Ziegler et al. use 0.2")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))

    def _step(self, kl: float, n_steps: int) -> float:
        error = min(max(kl / self.target - 1.0, -self.error_clip), self.error_clip)
        self.last_error = error
        multiplier = max(1.0 + error * n_steps / self.horizon, self.MIN_MULTIPLIER)
        return min(max(self._value * multiplier, self.coef_min), self.coef_max)

    def _hparams(self) -> dict:
        return dict(target=self.target, horizon=self.horizon, error_clip=self.error_clip,
                    coef_min=self.coef_min, coef_max=self.coef_max)


class _LogSpaceController(KLController):
    """Shared pieces of the controllers that act on log(beta)."""

    def _log_bounds(self) -> tuple[float, float]:
        lo = max(_log(self.coef_min), -_LOG_LIMIT)
        hi = min(_log(self.coef_max), _LOG_LIMIT)
        return lo, hi

    def _from_log(self, log_beta: float) -> float:
        lo, hi = self._log_bounds()
        if log_beta <= lo:  # exactly the bound, free of exp/log round-off
            return self.coef_min if lo == _log(self.coef_min) else math.exp(lo)
        if log_beta >= hi:
            return self.coef_max if hi == _log(self.coef_max) else math.exp(hi)
        return min(max(math.exp(log_beta), self.coef_min), self.coef_max)


class ExponentialKLController(_LogSpaceController):
    """``beta <- clamp(beta * exp(rate * (kl - target)), coef_min, coef_max)``.

    Computed in log space (``log beta + rate * (kl - target)``, clamped, then exp), so a huge
    reading saturates at ``coef_max`` instead of overflowing. The error is absolute, not relative:
    the effective gain is ``rate * target`` per update, so the same ``rate`` is sluggish for a small
    per-token target and aggressive for a large per-sequence one. Defaults: rate 0.1, beta in
    [1e-4, 10]. Typical per-token targets: 0.01-0.03 conservative, 0.05-0.10 moderate,
    0.10-0.20 aggressive.
    """

    name = "exponential"

    def __init__(
        self,
        kl_coef: float,
        target: float,
        rate: float = 0.1,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
    ):
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 0.05 (nats/token)")
        self.rate = _check_positive(rate, "rate", "kl_controller_rate is a gain per nat of error, e.g. 0.1")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))

    def _step(self, kl: float, n_steps: int) -> float:
        self.last_error = kl - self.target
        step = self.rate * (kl - self.target)  # may be +-inf for absurd readings: saturates below
        return self._from_log(math.log(self._value) + step)

    def _hparams(self) -> dict:
        return dict(target=self.target, rate=self.rate, coef_min=self.coef_min, coef_max=self.coef_max)


class PIDKLController(_LogSpaceController):
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

    name = "pid"

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
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 0.05 (nats/token)")
        self.kp = _check_nonnegative(kp, "kp", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.ki = _check_nonnegative(ki, "ki", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.kd = _check_nonnegative(kd, "kd", "gains must be >= 0 (defaults: kp=0.1, ki=0.3, kd=0)")
        self.integral_limit = _check_positive(integral_limit, "integral_limit", "it bounds the integral term in units of log(beta), e.g. 20")
        self.error_clip = _check_positive(error_clip, "error_clip", "it bounds the relative error, e.g. 1.0")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))
        self.log_beta0 = math.log(self._value) if self._value > 0 else -_LOG_LIMIT
        self.integral = 0.0
        self.prev_error: Optional[float] = None

    def _integral_bounds(self) -> tuple[float, float]:
        lo, hi = self._log_bounds()
        return (max(-self.integral_limit, lo - self.log_beta0),
                min(self.integral_limit, hi - self.log_beta0))

    def _step(self, kl: float, n_steps: int) -> float:
        error = (kl - self.target) / self.target
        error = min(max(error, -self.error_clip), self.error_clip)
        self.last_error = error
        derivative = 0.0 if self.prev_error is None else error - self.prev_error
        lo, hi = self._log_bounds()
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
        return self._from_log(u)

    def _hparams(self) -> dict:
        return dict(target=self.target, kp=self.kp, ki=self.ki, kd=self.kd, coef_min=self.coef_min,
                    coef_max=self.coef_max, integral_limit=self.integral_limit, error_clip=self.error_clip)

    def _dynamic_state(self) -> dict:
        return {"log_beta0": self.log_beta0, "integral": self.integral, "prev_error": self.prev_error}

    def _load_dynamic_state(self, state: dict) -> None:
        self.log_beta0 = float(state["log_beta0"])
        self.integral = float(state["integral"])
        prev = state.get("prev_error")
        self.prev_error = None if prev is None else float(prev)


def build_kl_controller(args) -> KLController:
    """Build the controller named by ``args.kl_controller`` from a config-like object.

    Reads ``kl_controller``, ``kl_coef``, ``kl_target``, ``kl_horizon``, and optionally
    ``kl_coef_min``, ``kl_coef_max``, ``kl_controller_rate``, ``kl_error_clip`` (adaptive only),
    ``kl_pid_kp``, ``kl_pid_ki``, ``kl_pid_kd``, ``kl_pid_integral_limit``, ``kl_pid_error_clip``;
    a missing or None optional attribute takes the controller's default.
    """
    kind = getattr(args, "kl_controller", "fixed")
    kind = kind.lower() if isinstance(kind, str) else kind
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"Unknown kl_controller {kind!r}; choose one of {', '.join(KL_CONTROLLERS)}")

    def opt(**names) -> dict:
        out = {}
        for param, attr in names.items():
            value = getattr(args, attr, None)
            if value is not None:
                out[param] = value
        return out

    kl_coef = getattr(args, "kl_coef")
    if kind == "fixed":
        return FixedKLController(kl_coef)
    target = getattr(args, "kl_target", None)
    if target is None:
        raise ValueError(f"kl_controller={kind!r} needs kl_target (the KL to hold, in the unit of kl_target_unit)")
    bounds = opt(coef_min="kl_coef_min", coef_max="kl_coef_max")
    if kind == "adaptive":
        horizon = getattr(args, "kl_horizon", None)
        if horizon is None:
            raise ValueError("kl_controller='adaptive' needs kl_horizon (e.g. 10000 sequences)")
        return AdaptiveKLController(kl_coef, target, horizon, **opt(error_clip="kl_error_clip"), **bounds)
    if kind == "exponential":
        return ExponentialKLController(kl_coef, target, **opt(rate="kl_controller_rate"), **bounds)
    return PIDKLController(
        kl_coef,
        target,
        **opt(kp="kl_pid_kp", ki="kl_pid_ki", kd="kl_pid_kd", integral_limit="kl_pid_integral_limit",
              error_clip="kl_pid_error_clip"),
        **bounds,
    )
