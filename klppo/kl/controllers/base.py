"""The controllers' base class, their registry and how a config builds one.

A controller subclasses :class:`KLController` and implements :meth:`KLController.next_coef`; decorated with
``@register_kl_controller(name)``, it is buildable by name from a config (:func:`build_kl_controller`). Its constants
(gains, bounds, windows) are its constructor's keyword parameters; a config sets them through one mapping,
``kl_controller_kwargs``, checked against the constructor, so each controller declares its own settings, once.
:class:`LogSpaceController` holds what the controllers that act on log(beta) share.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

__all__ = [
    "register_kl_controller",
    "unregister_kl_controller",
    "get_kl_controller",
    "kl_controllers",
    "KLController",
    "LogSpaceController",
    "safe_log",
    "build_kl_controller",
    "controller_table_markdown",
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
        cls.constants = {
            p.name: p.default for p in params if p.name not in CONFIG_ARGUMENTS and p.default is not p.empty
        }
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
        raise ValueError(f"coef_min ({coef_min}) must not exceed coef_max ({coef_max}); swap them or widen the range")
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
        return (
            f"kl_controller={cls.name!r} has no constant {', '.join(map(repr, unknown))}; its constants are: "
            f"{valid}. Remove the others from kl_controller_kwargs (on a command line that switches controller, "
            f"--kl_controller_kwargs '{{}}' clears those of a YAML file)"
        )
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
