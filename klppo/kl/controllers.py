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
- ``.name``: the registry name (``"fixed"``, ``"adaptive"``, ``"exponential"``, ``"pid"``,
  ``"tracking"``, ``"equilibrium"``, or one registered with :func:`register_kl_controller`).
- ``.observe_sequences(scores, log_ratios, lengths, unit)``: only controllers that read the batch itself
  (``"equilibrium"``) have it; the trainer calls it before each ``update`` with every rank's sequences. Such a
  controller learns which optimum the configured KL trains toward from its constructor's ``optimum``
  (``klppo.kl.optimum.KLOptimum``), which the config passes.

Controllers live in a registry: a class decorated with ``@register_kl_controller(name)`` is buildable
by name from a config. Its constants (gains, bounds, windows) are its constructor's keyword
parameters; a config sets them through one mapping, ``kl_controller_kwargs``, checked against the
constructor, so each controller declares its own settings, once.

The unit of the statistic (nats per token or per sequence) is the caller's choice; the target must
be given in the same unit.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Optional

from .optimum import KLOptimum, equilibrium_log_coef, optimum_kl

__all__ = [
    "register_kl_controller",
    "unregister_kl_controller",
    "get_kl_controller",
    "kl_controllers",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "ExponentialKLController",
    "PIDKLController",
    "TrackingKLController",
    "EquilibriumKLController",
    "optimum_kl",
    "equilibrium_log_coef",
    "build_kl_controller",
]

_KL_CONTROLLERS: dict[str, type] = {}
# constructor parameters that the config passes (not constants): the target, and the optimum the configured KL
# trains toward (`KLControlConfig.kl_optimum`)
CONFIG_ARGUMENTS = ("target", "optimum")


def register_kl_controller(name: str, needs_target: bool = True):
    """Class decorator: register a :class:`KLController` subclass under ``name``.

    Args:
        name: the value of ``kl_controller`` that selects it.
        needs_target: whether the controller needs ``kl_target`` (every adaptive one does); the config
            rejects such a controller without a target, and with ``kl_mode='none'``. The target reaches the
            constructor as its ``target`` argument.

    The controller's constants are its constructor's keyword parameters after ``kl_coef`` (and those the config
    passes, ``CONFIG_ARGUMENTS``: ``target``, and ``optimum``, the config's ``kl_optimum()``, for a controller that
    takes it): ``cls.constants`` maps each to its default, and ``kl_controller_kwargs`` may set exactly those.
    """

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, KLController)):
            raise TypeError(f"register_kl_controller decorates KLController subclasses, got {cls!r}")
        if name in _KL_CONTROLLERS:
            raise ValueError(f"A KL controller named {name!r} is already registered; unregister it first")
        params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # after self, kl_coef
        cls.name = name
        cls.needs_target = bool(needs_target)
        cls.constants = {p.name: p.default for p in params
                         if p.name not in CONFIG_ARGUMENTS and p.default is not p.empty}  # fmt: skip
        _KL_CONTROLLERS[name] = cls
        return cls

    return decorate


def unregister_kl_controller(name: str) -> None:
    """Remove a registered controller (for tests and plug-ins); unknown names raise ``KeyError``."""
    del _KL_CONTROLLERS[name]


def kl_controllers() -> tuple[str, ...]:
    """Names of the registered controllers, in registration order."""
    return tuple(_KL_CONTROLLERS)


def get_kl_controller(name: str) -> type:
    """The controller class registered as ``name``; a ``ValueError`` lists the valid names."""
    try:
        return _KL_CONTROLLERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown kl_controller {name!r}; choose one of {', '.join(_KL_CONTROLLERS)} "
            "(or register one with klppo.kl.register_kl_controller)"
        ) from None

# Multiplicative controllers keep beta inside [exp(-700), exp(700)] whatever the bounds say, so
# that exp() can neither overflow nor underflow to 0.
_LOG_LIMIT = 700.0


def _as_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _json_float(x):
    """JSON has no inf/NaN: store them as strings (and strings as they are)."""
    return x if isinstance(x, str) or math.isfinite(x) else str(x)


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


def safe_log(x: float) -> float:
    """`log x`, and `-inf` for `x <= 0` (a coefficient or a reading of 0), for controllers that act on log beta."""
    return math.log(x) if x > 0 else -math.inf


class KLController:
    """Base class: bookkeeping shared by all controllers. A controller implements :meth:`next_coef`, the extension
    hook: the new coefficient from one update's statistic (:meth:`update` calls it, skips NaN readings and
    results, and counts the updates). A variant of a controller subclasses it and overrides ``next_coef``, calling
    ``super().next_coef`` for the original's step.

    What a controller reads besides the KL statistic, it declares: ``reads_sequences = True`` for one that reads
    the batch itself (each sequence's score, log-ratio and length, given to :meth:`observe_sequences` before each
    :meth:`update`); :meth:`metrics` returns what it logs after an update (none by default).
    """

    name = "base"
    reads_sequences = False

    # the hooks' names before they were public: (old, new)
    _RENAMED_HOOKS = (("_step", "next_coef"), ("_from_log", "from_log"), ("_log_bounds", "log_bounds"),
                      ("_equilibrium_step", "equilibrium_coef"))  # fmt: skip

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Controllers written against the hooks' old names keep working: a class that defines a hook under its old
        # name has it under the new one too (with a warning naming it), and every class answers to the old names, so
        # `super()._step(...)` in such a subclass reaches its parent's `next_coef`. Defining `observe_sequences`
        # without saying `reads_sequences` declared, before, that the controller reads the batch.
        for old, new in cls._RENAMED_HOOKS:
            if old in cls.__dict__ and new not in cls.__dict__:
                warnings.warn(f"{cls.__name__} defines `{old}`: rename it `{new}` (the controllers' hook).",
                              DeprecationWarning, stacklevel=2)  # fmt: skip
                setattr(cls, new, cls.__dict__[old])
            elif new in cls.__dict__ and old not in cls.__dict__:
                setattr(cls, old, cls.__dict__[new])
        if "observe_sequences" in cls.__dict__ and "reads_sequences" not in cls.__dict__ and not cls.reads_sequences:
            warnings.warn(f"{cls.__name__} defines `observe_sequences`: set `reads_sequences = True` on the class, "
                          "which is how a controller declares that it reads the batch.", DeprecationWarning, stacklevel=2)  # fmt: skip
            cls.reads_sequences = True

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
        new = self.next_coef(kl, steps)
        if math.isfinite(new) and new >= 0:  # defensive: a controller must never emit NaN
            self._value = new
        else:
            self.skipped_updates += 1
            return self._value
        self.last_kl = kl
        self.n_updates += 1
        return self._value

    def next_coef(self, kl: float, n_steps: int) -> float:
        """The coefficient after one update whose global KL statistic is `kl` (a finite float, in the target's
        unit), over `n_steps` sequences of all ranks. Subclasses implement it."""
        raise NotImplementedError

    def observe_sequences(self, scores, log_ratios, lengths, unit: str = "sequence") -> None:
        """The batch the next :meth:`update` reads (controllers with ``reads_sequences``): each sequence's score,
        ``log pi(y) - log ref(y)`` and length, from every rank."""
        raise TypeError(f"{type(self).__name__} does not read the batch's sequences (reads_sequences is False)")

    def metrics(self) -> dict:
        """What the trainer logs after an update, beside the coefficient: none by default."""
        return {}

    # -- checkpointing ------------------------------------------------------------------------

    def _hparams(self) -> dict:
        return {}

    def reference_reset(self) -> None:
        """The reference has become the current policy (`ref_reset_steps`): the KL starts again from 0. A controller
        whose state integrates past readings restarts it here; beta itself carries over."""

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


@register_kl_controller("fixed", needs_target=False)
class FixedKLController(KLController):
    """beta never changes. ``kl_coef >= 0`` (0 turns the penalty off)."""

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
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 6 (nats/sequence) or 0.1 (nats/token)")
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
        return dict(target=self.target, horizon=self.horizon, error_clip=self.error_clip,
                    coef_min=self.coef_min, coef_max=self.coef_max)


class LogSpaceController(KLController):
    """Shared pieces of the controllers that act on log(beta): `log_bounds` (the coefficient's bounds, as logs) and
    `from_log` (a coefficient from its log, held within the bounds), for subclasses and their variants."""

    def log_bounds(self) -> tuple[float, float]:
        lo = max(safe_log(self.coef_min), -_LOG_LIMIT)
        hi = min(safe_log(self.coef_max), _LOG_LIMIT)
        return lo, hi

    def from_log(self, log_beta: float) -> float:
        lo, hi = self.log_bounds()
        if log_beta <= lo:  # exactly the bound, free of exp/log round-off
            return self.coef_min if lo == safe_log(self.coef_min) else math.exp(lo)
        if log_beta >= hi:
            return self.coef_max if hi == safe_log(self.coef_max) else math.exp(hi)
        return min(max(math.exp(log_beta), self.coef_min), self.coef_max)


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
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
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
        lo, hi = self.log_bounds()
        return (max(-self.integral_limit, lo - self.log_beta0),
                min(self.integral_limit, hi - self.log_beta0))

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
        return dict(target=self.target, kp=self.kp, ki=self.ki, kd=self.kd, coef_min=self.coef_min,
                    coef_max=self.coef_max, integral_limit=self.integral_limit, error_clip=self.error_clip)

    def reference_reset(self) -> None:
        self.log_beta0, self.integral, self.prev_error = safe_log(self._value), 0.0, None

    def _dynamic_state(self) -> dict:
        return {"log_beta0": self.log_beta0, "integral": self.integral, "prev_error": self.prev_error}

    def _load_dynamic_state(self, state: dict) -> None:
        self.log_beta0 = float(state["log_beta0"])
        self.integral = float(state["integral"])
        prev = state.get("prev_error")
        self.prev_error = None if prev is None else float(prev)


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
      full gain both ways. The runs behind both rules are in `docs/results.md`.
    - The error is taken on the predicted KL: beta rises while the KL is still climbing toward an
      overshoot, before it happens. Only a rise counts (derivative on rising KL only, as Stooke et
      al.): a falling KL does not cut beta early.
    - The error is ``log(KL / target)``: the KL of the regularised optimum falls roughly as a power
      of beta, so the loop is about linear in log space, symmetric for KL too high and too low, and
      independent of the unit and size of the target. It is clipped to +-1 (a 10x spike moves beta
      by at most ``exp(kp + ki)``).
    - The proportional term damps; the integral removes the steady-state error.

    An ablation on the one-token bandit's speed grid (``k2`` in the loss) removed what did not beat noise: an EMA
    of the reading, and an exception that let a raw reading near the target end the no-rise rule before the EMA
    did. The start-up hold, the lookahead and the anti-windup stayed (`docs/results.md`, ``results/controller_grid/``).

    Beta acts on the KL two readings after the one that set it, and each update moves the KL by an amount
    beta does not decide, so no setting of these gains holds the KL much tighter than a fixed beta near the
    equilibrium would. ``KLPPOTrainer`` therefore pairs this controller, by default, with a guard inside the
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
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 4 (nats/sequence)")
        self.arm_fraction = _check_positive(arm_fraction, "arm_fraction", "the start-up hold ends at this fraction of the target, e.g. 0.8")
        self.startup_rate = _check_nonnegative(startup_rate, "startup_rate", "the share of ki used to lower beta before the KL first nears the target, e.g. 0.75")
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
        return dict(target=self.target, kp=self.kp, ki=self.ki, lookahead=self.lookahead, window=self.window,
                    arm_fraction=self.arm_fraction, startup_rate=self.startup_rate, coef_min=self.coef_min,
                    coef_max=self.coef_max)

    def reference_reset(self) -> None:
        """The climb from 0 again: the start-up hold re-arms, the window and the integral start from the current
        beta."""
        self.log_beta0, self.integral = safe_log(self._value), 0.0
        self.readings, self.slope, self.armed, self.holding, self.predicted = [], 0.0, False, True, None

    def _dynamic_state(self) -> dict:
        return {"log_beta0": self.log_beta0, "integral": self.integral, "readings": list(self.readings),
                "slope": self.slope, "armed": self.armed, "holding": self.holding, "predicted": self.predicted}

    def _load_dynamic_state(self, state: dict) -> None:
        self.log_beta0 = float(state["log_beta0"])
        self.integral = float(state["integral"])
        self.readings = [float(x) for x in state.get("readings", [])][-self.window :]
        self.slope = float(state.get("slope", 0.0))
        self.armed = bool(state.get("armed", False))
        self.holding = bool(state.get("holding", True))
        self.predicted = None if state.get("predicted") is None else float(state["predicted"])


@register_kl_controller("equilibrium")
class EquilibriumKLController(LogSpaceController):
    """Moves log beta toward the batch's estimate of beta*, the coefficient whose KL-regularised optimum has the
    target KL, by the share of the batch that backs the estimate (its effective sample size); until the KL first
    reaches the target, beta is that times ``(kl / target) ** approach_power``. With ``jackknife_groups`` (8 by
    default in klppo's trainer with a KL in the loss whose optimum is the tilt) the step is at most the gain of a
    Kalman filter on log beta*, which averages the noisy estimates of small batches near beta*. klppo's default with a
    ``kl_target`` wherever the configured KL's optimum is known (``k1`` in the reward; ``k2``, any ``X+``,
    ``corrected_k3``, ``full`` or ``k3`` in the loss; the table in `docs/kl.md`).

    Per update, from the batch's scores ``r`` and log-ratios ``d = log pi(y) - log ref(y)`` (one per sequence,
    gathered over all ranks; see :class:`klppo.kl.optimum.KLOptimum`)::

        b = log beta such that KL_hat(pi_beta || ref) = target         (bisection within the bounds)
        g = ESS / n of the importance weights pi_beta / pi at b        (in (0, 1])
        log beta <- log beta + g * (b - log beta)

    The filter (``jackknife_groups = K > 0``): the batch's estimate is a measurement of log beta* whose variance
    ``V`` is its grouped jackknife variance (sequence ``i`` in group ``i mod K``, each group left out in turn and the
    rest solved again), and the filter's variance ``P`` grows by ``drift ** 2`` per update::

        P <- P + drift ** 2
        g <- min(g, P / (P + V))
        P <- (1 - g) ** 2 * P + g ** 2 * V

    Far from beta* few sequences back the estimate, ``g`` (the share) is the smaller and the step is the one above;
    near it the share is close to 1 and a batch of 32 sequences estimates log beta* within a spread of about 0.5
    (with a long right tail), so the unfiltered step follows each batch's noise and the KL settles away from the
    target. The filter then averages the batches. An estimate on a coefficient bound says only that beta* lies beyond
    it: its step is the share, as without the filter, and it is no measurement (``P`` grows by ``drift ** 2``). It
    takes that step only when the KL measured now agrees (above the target for the upper bound, below it for the
    lower); otherwise the batch's weights cannot represent the optimum at the target at all (with ``pi_beta`` near
    ``ref``, the self-normalised estimate of ``KL(ref || ref)`` is ``-log mean exp(-d)``, which a batch of a policy at
    the target can put above it), and the batch tells nothing: beta and ``P`` stay, with or without the filter
    (`docs/results.md`, "A batch on a bound"). ``P`` starts at 1 and again at a reference reset. The left-out solves
    keep the whole batch's target (a per-token target times the whole batch's mean length). The measurements are in
    `docs/results.md` ("A KL in the loss").

    ``pi_beta`` is the optimum the configured KL trains toward at beta, given as ``optimum`` by the config
    (``KLControlConfig.kl_optimum``): the reverse-KL tilt ``ref * exp(r / (s * beta)) / Z`` (``s`` = 1, or 2 for
    ``k1+`` in both places), or the forward-KL optimum ``s * beta * ref / (lam - r)`` of ``k3`` in the loss; by
    default the tilt at beta.

    Why: the optimum of the regularised objective does not depend on the learning rate, batch or number of
    optimizer steps, so its KL, estimated from the batch by importance sampling, tells beta* without waiting for
    the policy to get there: the coefficient does not depend on how fast the policy moves, and a KL still on its
    way to the target does not wind it up. The estimate is exact when the policy is at the optimum of the current
    beta (the weights are then all equal). Far from it, a few sequences carry the weights and the estimate leans
    toward the policy it was drawn from; the gain ``g`` then takes a small step, and a full one when every sequence
    backs the estimate. A batch whose scores are all equal leaves beta where it is (no coefficient tilts it).

    The optimum is per prompt: with one response per prompt, the prompts' sequences are weighted together, an
    approximation measured in `docs/results.md`. A KL in the loss gives only the per-token part of the sequence
    KL's gradient, so on responses longer than one token its optimum is the sequence-level one only approximately.
    A target in nats per token is turned into one per sequence by the batch's mean length.

    The approach: until the KL statistic first reaches the target, the coefficient in force is the one above
    times ``(kl / target) ** approach_power`` (``kl`` the update's statistic; a statistic at or below 0 gives
    ``coef_min``). A policy still far from the target is held back less, so the KL arrives sooner than at beta*
    itself; the factor is 1 at the target, and from the first reading at or above it on the hold (below) takes its
    place, so the fixed point is untouched. ``approach_power=0`` turns it off. It helps where the
    policy is slow, where beta* itself would bring the KL to the target only near the end of a run; a higher power
    brings the KL sooner and keeps beta's second-half mean further below beta*. It can cost where the policy is
    fast: the KL arrives no sooner, and overshoots while beta sits near ``coef_min``. The measurements, on the
    one-token bandit's speed grid and on the default task, are in `docs/results.md` ("The equilibrium
    controller").

    The hold: once the KL has arrived, the coefficient in force is the equilibrium one times ``(kl / target) **
    hold_power`` (1), the ratio within [1/e, e]. beta* is the coefficient whose *optimum* has the target KL; a policy
    that lags behind that optimum (a slow learning rate, an update cut short by the guard) holds a KL below the target
    at beta*, and one that runs ahead of it a KL above. The factor answers the KL measured now, without a sum, so
    nothing winds up while the policy lags; it is 1 at the target, so a policy at the optimum of beta* keeps beta*.
    ``hold_power=0`` turns it off. The equilibrium coefficient itself (``kl/coef_equilibrium``) does not see the
    factor. Measured on the bandit's grid and the default task in `docs/results.md` ("The hold").
    """

    reads_sequences = True

    def __init__(self, kl_coef: float, target: float, coef_min: float = 1e-4, coef_max: float = 10.0,
                 approach_power: float = 0.75, optimum: Optional[KLOptimum] = None, jackknife_groups: int = 0,
                 drift: float = 0.05, hold_power: float = 1.0):  # fmt: skip
        kl_coef = _check_positive(kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)")
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 4 (nats/sequence)")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        self.approach_power = _check_nonnegative(approach_power, "approach_power", "e.g. 0.75 (0 turns the approach off)")
        self.hold_power = _check_nonnegative(hold_power, "hold_power", "e.g. 1 (0: beta is the equilibrium coefficient "
                                             "once the KL has arrived)")  # fmt: skip
        groups = _as_float(jackknife_groups)
        if not (math.isfinite(groups) and groups == int(groups) and (groups == 0 or groups >= 2)):
            raise ValueError(f"jackknife_groups must be 0 (no filter) or a whole number >= 2, got {jackknife_groups}; "
                             "e.g. 8")
        self.jackknife_groups = int(groups)
        self.drift = _check_positive(drift, "drift", "e.g. 0.05 (how far log beta* may move in one update)")
        self.variance = 1.0  # of the filtered log beta*, before any batch
        self.gain: Optional[float] = None
        if optimum is not None and not isinstance(optimum, KLOptimum):
            raise TypeError(f"optimum must be a klppo.kl.optimum.KLOptimum, got {optimum!r}")
        self.optimum = KLOptimum() if optimum is None else optimum
        super().__init__(min(max(kl_coef, self.coef_min), self.coef_max))
        self.coef = self._value  # the equilibrium coefficient; `value` is it times the approach's or the hold's factor
        self.arrived = False  # has a reading reached the target yet
        self.estimate: Optional[float] = None  # the latest batch's, for logging only
        self.ess: Optional[float] = None
        self._batch = None

    def reference_reset(self) -> None:
        """The KL to the new reference starts again from 0, as at the start of a run: the approach re-arms and the
        filter's variance starts again (the equilibrium coefficient itself carries over)."""
        self.arrived = False
        self.variance = 1.0

    def observe_sequences(self, scores, log_ratios, lengths, unit: str = "sequence") -> None:
        """The batch the next :meth:`update` reads: each sequence's score, ``log pi(y) - log ref(y)`` and length
        (the trainer calls it with every rank's sequences)."""
        self._batch = (scores, log_ratios, lengths, unit)

    def next_coef(self, kl: float, n_steps: int) -> float:
        self.last_error = math.log(max(kl, self.target / math.e) / self.target)
        self.coef = self.equilibrium_coef()
        self.arrived = self.arrived or kl >= self.target
        if not self.arrived:
            if not self.approach_power:
                return self.coef
            return self.from_log(safe_log(self.coef) + self.approach_power * safe_log(max(kl, 0.0) / self.target))
        if not self.hold_power:
            return self.coef
        return self.from_log(safe_log(self.coef) + self.hold_power * min(self.last_error, 1.0))

    def equilibrium_coef(self) -> float:
        """The equilibrium coefficient after this update's batch (unchanged by a batch that tells nothing)."""
        import torch

        self.estimate = self.ess = self.gain = None  # this batch's, for logging
        if self._batch is None:  # no sequences observed: nothing to estimate from
            return self.coef
        scores, log_ratios, lengths, unit = self._batch
        self._batch = None
        r = torch.as_tensor(scores, dtype=torch.float64)
        d = torch.as_tensor(log_ratios, dtype=torch.float64)
        if r.numel() == 0 or not (torch.isfinite(r).all() and torch.isfinite(d).all()):
            return self.coef
        if not r.max() > r.min():  # every score equal: no coefficient tilts this batch, so it tells nothing
            return self.coef
        target = self.target
        if unit == "token":
            target *= float(torch.as_tensor(lengths, dtype=torch.float64).mean())
        lo, hi = self.log_bounds()
        self.estimate = self.optimum.solve(r, d, target, lo, hi)
        self.ess = self.optimum.ess(self.estimate + math.log(self.optimum.scale), r, d)
        now = max(safe_log(self.coef), lo)
        self.gain = self.ess
        side = self.bound_side(self.estimate)  # on a bound, the estimate says only "beyond the bound"
        on_bound = side != 0
        agrees = self.last_error is None or (self.last_error > 0 if side > 0 else self.last_error < 0)
        if on_bound and not agrees:
            # beyond the bound, but the KL measured now is not on that side of the target: the batch's weights
            # cannot represent the optimum at the target (importance-sampling noise), so it tells nothing
            self.gain = 0.0
            return self.coef
        if self.jackknife_groups and on_bound:  # the share's step; no measurement for the filter
            self.variance += self.drift**2
        elif self.jackknife_groups and (spread := self.jackknife_variance(r, d, target, lo, hi)) is not None:
            prior = self.variance + self.drift**2
            self.gain = min(self.ess, prior / (prior + spread))
            self.variance = (1 - self.gain) ** 2 * prior + self.gain**2 * spread
        return self.from_log(now + self.gain * (self.estimate - now))

    def bound_side(self, log_beta: float) -> int:
        """1 where ``log_beta`` lies on the upper coefficient bound, -1 on the lower, 0 between them."""
        lo, hi = self.log_bounds()
        return 1 if hi - log_beta < 1e-6 else -1 if log_beta - lo < 1e-6 else 0

    def jackknife_variance(self, r, d, target: float, lo: float, hi: float, groups: Optional[int] = None):
        """The grouped jackknife variance of the batch's estimate of log beta*: sequence ``i`` in group ``i mod
        K`` (``K = groups``, by default ``jackknife_groups``), each group left out in turn and the rest solved again;
        ``(m - 1) / m`` times the sum of the ``m`` left-out estimates' squared deviations from their mean (at least
        1e-6). None when fewer than two groups leave a batch whose scores differ."""
        import torch

        groups = torch.arange(r.numel()) % min(groups or self.jackknife_groups, r.numel())
        left_out = []
        for k in range(int(groups.max()) + 1):
            keep = groups != k
            if r[keep].max() > r[keep].min():
                left_out.append(self.optimum.solve(r[keep], d[keep], target, lo, hi))
        if len(left_out) < 2:
            return None
        m = len(left_out)
        mean = sum(left_out) / m
        return max((m - 1) / m * sum((b - mean) ** 2 for b in left_out), 1e-6)

    def metrics(self) -> dict:
        """What the trainer logs after each update: the equilibrium coefficient before the approach's or the hold's
        factor (`kl/coef_equilibrium`; `kl/coef` is the coefficient in force), the batch's estimate of
        beta* (`kl/coef_estimate`), the share of the batch backing it (`kl/ess`) and the step taken toward it
        (`kl/gain`: the share, or less with ``jackknife_groups``)."""
        out = {"kl/coef_equilibrium": self.coef}
        if self.estimate is not None:
            out.update({"kl/coef_estimate": math.exp(self.estimate), "kl/ess": self.ess, "kl/gain": self.gain})
        return out

    def _hparams(self) -> dict:
        return dict(target=self.target, coef_min=self.coef_min, coef_max=self.coef_max,
                    approach_power=self.approach_power, hold_power=self.hold_power, optimum=self.optimum.describe(),
                    jackknife_groups=self.jackknife_groups, drift=self.drift)

    def _dynamic_state(self) -> dict:
        return {"coef": self.coef, "arrived": self.arrived, "variance": self.variance}

    def _load_dynamic_state(self, state: dict) -> None:
        # a state written before the approach existed holds beta alone, the equilibrium coefficient
        self.coef = float(state.get("coef", self._value))
        self.arrived = bool(state.get("arrived", True))
        self.variance = float(state.get("variance", 1.0))


def controller_table_markdown() -> str:
    """The controller table of `docs/kl.md` (markdown), generated from the registry: each controller's name, the
    first paragraph of its docstring, its constants (the keys of ``kl_controller_kwargs``) with their defaults,
    and whether it needs ``kl_target``."""
    lines = [
        "Generated from the controller registry by `python -m klppo.kl.divergence --write-readme docs/kl.md`.",
        "",
        "| `kl_controller` | what it does | `kl_controller_kwargs` (defaults) | needs `kl_target` |",
        "| --- | --- | --- | --- |",
    ]
    for name, cls in _KL_CONTROLLERS.items():
        first = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "`")
        constants = ", ".join(f"`{k}={v!r}`" for k, v in cls.constants.items()) or "none"
        cells = [f"`{name}`", first.replace("|", "\\|"), constants, "yes" if cls.needs_target else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _controller_kwargs_error(cls: type, kwargs) -> Optional[str]:
    """Why ``kwargs`` cannot set ``cls``'s constants (not a mapping, or a key it does not declare), or None."""
    if not isinstance(kwargs, dict):
        return f"kl_controller_kwargs must be a mapping of constant names to values, got {kwargs!r}"
    unknown = sorted(set(kwargs) - set(cls.constants))
    if unknown:
        valid = ", ".join(f"{k} (default {v!r})" for k, v in cls.constants.items()) or "none"
        return (f"kl_controller={cls.name!r} has no constant {', '.join(map(repr, unknown))}; its constants are: "
                f"{valid}. Remove the others from kl_controller_kwargs (on a command line that switches controller, "
                f"--kl_controller_kwargs '{{}}' clears those of a YAML file)")
    return None


def build_kl_controller(args) -> KLController:
    """Build the controller named by ``args.kl_controller`` from a config-like object: the class comes from the
    registry; its constructor gets ``args.kl_coef``, ``args.kl_target`` when it needs a target, ``args.kl_optimum()``
    when it takes an ``optimum`` (and the config knows one), and ``args.kl_controller_kwargs`` (checked against the
    constants it declares)."""
    kind = getattr(args, "kl_controller", "fixed")
    cls = get_kl_controller(kind.lower() if isinstance(kind, str) else kind)
    kwargs = getattr(args, "kl_controller_kwargs", None) or {}
    problem = _controller_kwargs_error(cls, kwargs)
    if problem:
        raise ValueError(problem)
    kwargs = dict(kwargs)
    if "optimum" in inspect.signature(cls.__init__).parameters and callable(getattr(args, "kl_optimum", None)):
        optimum = args.kl_optimum()
        if optimum is not None:
            kwargs["optimum"] = optimum
    if cls.needs_target:
        if getattr(args, "kl_target", None) is None:
            raise ValueError(
                f"kl_controller={cls.name!r} needs kl_target (the KL to hold, in the unit of kl_target_unit)"
            )
        kwargs["target"] = args.kl_target
    return cls(getattr(args, "kl_coef"), **kwargs)
