"""The estimators' registry: what one entry declares (:class:`KLEstimatorSpec`), registering one, and its ``X+`` twin.

An estimator is declared in one place, its ``register_kl_estimator`` call: the function, its value formula, and,
for each place the KL can act, what its expected gradient is the gradient of (:class:`KLGradient`: ``reward``,
``loss``, ``off_policy_loss``). ``klppo.kl.divergence.divergence_followed`` reads the first three parts of each
``KLGradient``, ``klppo.kl.optimum.kl_optimum_of`` its ``terms``; a place left undeclared is unknown to both (a
warning about the divergence, and no equilibrium controller). The built-in estimators are declared in
``klppo.kl.estimators``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

__all__ = [
    "KLGradient",
    "KLEstimatorSpec",
    "register_kl_estimator",
    "unregister_kl_estimator",
    "get_kl_estimator",
    "get_kl_estimator_spec",
    "kl_estimators",
    "REVERSE_KL",
    "FORWARD_KL",
    "NO_GRADIENT",
]

KLEstimatorFn = Callable[..., torch.Tensor]

# what an expected gradient can be the gradient of (`KLGradient.divergence` takes these or any other text)
REVERSE_KL = "KL(pi||ref)"
FORWARD_KL = "KL(ref||pi)"
NO_GRADIENT = "none (zero expected gradient)"
# the parts an expected gradient is made of, for `KLGradient.terms` (`klppo.kl.optimum` says what each is)
GRADIENT_TERMS = ("seq", "path", "fpath")


@dataclass(frozen=True)
class KLGradient:
    """What an estimator's expected gradient is the gradient of, in one place of the KL (in the reward, through the
    return with reward-to-go; in the loss on-policy; in the loss off-policy).

    divergence: what it follows, e.g. ``REVERSE_KL`` (``"KL(pi||ref)"``). unbiased: True only for an unbiased
    gradient of KL(pi||ref). message: one line for people, shown as a warning when ``unbiased`` is False;
    ``{name}`` in it stands for the estimator's name. terms: the expected gradient as a weighted sum of ``"seq"``
    (the sequence-level KL(pi||ref)'s gradient), ``"path"`` (its per-token part, the prefixes held) and ``"fpath"``
    (the same for KL(ref||pi)) (``klppo.kl.optimum``); ``{}`` for no gradient, None where it is no such sum. From the
    terms ``kl_optimum_of`` tells the optimum a configuration trains toward, which the equilibrium controller solves
    for.
    """

    divergence: str
    unbiased: bool
    message: str
    terms: Optional[Mapping[str, float]] = None

    def __post_init__(self):
        if self.terms is not None:
            unknown = sorted(set(self.terms) - set(GRADIENT_TERMS))
            if unknown:
                raise ValueError(f"KLGradient terms are {', '.join(GRADIENT_TERMS)}; got {', '.join(unknown)}")
            object.__setattr__(self, "terms", dict(self.terms))

    def for_estimator(self, name: str) -> str:
        """The message with the estimator's name in it."""
        return self.message.replace("{name}", name)


@dataclass(frozen=True)
class KLEstimatorSpec:
    """One registry entry.

    name: registry key. fn: the estimator. formula: value formula, for docs and the estimator table.
    uses_old_logp: whether ``old_logp`` changes the result. output_clamp: a bound the estimator
    itself applies to its output (``low_var_kl``), or None. base: for a straight-through ``X+``
    entry the name ``X``, otherwise the entry's own name. inputs: ``"logprobs"`` (the sampled
    tokens' log-probs, the shared signature) or ``"logits"`` (``fn(logits, ref_logits, chunk_size)``).
    reward, loss, off_policy_loss: what its expected gradient follows in each place (:class:`KLGradient`), or None
    where nothing is declared.
    """

    name: str
    fn: KLEstimatorFn
    formula: str
    uses_old_logp: bool = False
    output_clamp: Optional[float] = None
    base: str = ""
    inputs: str = "logprobs"
    reward: Optional[KLGradient] = field(default=None, compare=False)
    loss: Optional[KLGradient] = field(default=None, compare=False)
    off_policy_loss: Optional[KLGradient] = field(default=None, compare=False)

    @property
    def straight_through(self) -> bool:
        return self.base != self.name

    @property
    def needs_logits(self) -> bool:
        return self.inputs == "logits"

    def gradient(self, place: str, off_policy: bool = False) -> Optional[KLGradient]:
        """What the expected gradient follows in ``place`` (``"reward"`` or ``"loss"``), or None if undeclared."""
        if place == "reward":
            return self.reward
        return self.off_policy_loss if off_policy else self.loss


_KL_ESTIMATORS: dict[str, KLEstimatorSpec] = {}


def _check_gradient(value, what: str) -> Optional[KLGradient]:
    if value is not None and not isinstance(value, KLGradient):
        raise TypeError(f"{what} must be a klppo.kl.KLGradient or None, got {value!r}")
    return value


def register_kl_estimator(
    name: str,
    formula: str,
    *,
    uses_old_logp: bool = False,
    output_clamp: Optional[float] = None,
    straight_through: bool = True,
    inputs: str = "logprobs",
    reward: Optional[KLGradient] = None,
    loss: Optional[KLGradient] = None,
    off_policy_loss: Optional[KLGradient] = None,
):
    """Decorator: register ``fn`` under ``name`` (and, by default, its twin ``name + "+"``).

    ``reward``, ``loss`` and ``off_policy_loss`` declare what the estimator's expected gradient follows in each
    place (:class:`KLGradient`, with the ``terms`` that give its optimum); undeclared, klppo calls the divergence
    unknown there and knows no optimum. The twin has the value of ``fn`` and the gradient of ``k2``:
    ``k2 - k2.detach() + fn(...).detach()``; in the reward it follows what ``fn`` does (the value is what the
    return reads), in the loss what ``k2`` does. ``inputs="logits"`` registers an estimator of the whole
    distribution (no twin: it has no sampled token to take a ``k2`` gradient at).
    """
    if inputs not in ("logprobs", "logits"):
        raise ValueError(f"inputs must be 'logprobs' or 'logits', got {inputs!r}")
    straight_through = straight_through and inputs == "logprobs"
    reward, loss = _check_gradient(reward, "reward"), _check_gradient(loss, "loss")
    off_policy_loss = _check_gradient(off_policy_loss, "off_policy_loss")

    def decorator(fn: KLEstimatorFn) -> KLEstimatorFn:
        names = [name, name + "+"] if straight_through else [name]
        for key in names:
            if key in _KL_ESTIMATORS:
                raise ValueError(f"KL estimator {key!r} is already registered")
        _KL_ESTIMATORS[name] = KLEstimatorSpec(
            name, fn, formula, uses_old_logp, output_clamp, name, inputs, reward, loss, off_policy_loss
        )
        if straight_through:
            _KL_ESTIMATORS[name + "+"] = KLEstimatorSpec(
                name + "+",
                _make_straight_through(fn, name),
                f"value of {name}, gradient of k2",
                uses_old_logp,
                output_clamp,
                name,
                reward=reward,
                loss=_twin_loss(name),
                off_policy_loss=TWIN_OFF_POLICY_LOSS,
            )
        return fn

    return decorator


def unregister_kl_estimator(name: str) -> None:
    """Remove a registered estimator and its ``X+`` twin (for tests and plug-ins); ``KeyError`` if unknown."""
    spec = _KL_ESTIMATORS.pop(name)
    if not spec.straight_through:
        _KL_ESTIMATORS.pop(name + "+", None)


def _unknown_estimator_error(name) -> ValueError:
    valid = ", ".join(repr(n) for n in kl_estimators())
    return ValueError(
        f"Unknown KL estimator {name!r}. Valid estimators: {valid}. Register a new one with "
        "`klppo.kl.register_kl_estimator`."
    )


def get_kl_estimator_spec(name: str) -> KLEstimatorSpec:
    """The registry entry for ``name``; ``ValueError`` listing the valid names if unknown."""
    try:
        return _KL_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise _unknown_estimator_error(name) from None


def get_kl_estimator(name: str) -> KLEstimatorFn:
    """The estimator function registered under ``name`` (shared signature in ``klppo.kl.estimators``)."""
    return get_kl_estimator_spec(name).fn


def kl_estimators(inputs: Optional[str] = None) -> list[str]:
    """Registered names: per-token estimators in registration order, their ``X+`` twins, then the
    logits-based ones. ``inputs="logprobs"`` or ``"logits"`` lists one kind only."""
    specs = [s for s in _KL_ESTIMATORS.values() if inputs is None or s.inputs == inputs]
    per_token = [s for s in specs if not s.needs_logits]
    return (
        [s.name for s in per_token if not s.straight_through]
        + [s.name for s in per_token if s.straight_through]
        + [s.name for s in specs if s.needs_logits]
    )


# ---------------------------------------------------------------------------------------------
# the straight-through twin


def _clamp(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def _k2(d, log_ratio_clamp):
    return 0.5 * _clamp(d, log_ratio_clamp).square()


def _twin_loss(base: str) -> KLGradient:
    return KLGradient(
        REVERSE_KL,
        True,
        f"{{name}} as a loss: value of {base}, gradient of k2 (d * s), the unbiased "
        "per-token gradient of KL(pi||ref) on-policy.",
        {"path": 1.0},
    )


TWIN_OFF_POLICY_LOSS = KLGradient(
    "neither KL direction (k2 gradient without importance weight)",
    False,
    "{name} as a loss off-policy (pi != pi_old): the straight-through k2 gradient E_old[d * s] has no importance "
    "weight, so it follows neither KL; use corrected_k3.",
)


def _make_straight_through(fn: KLEstimatorFn, name: str) -> KLEstimatorFn:
    def straight_through(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
        value = fn(log_ratio, old_log_ratio, log_ratio_clamp)
        k2 = _k2(log_ratio, log_ratio_clamp)
        # Forward: exactly `value`. Backward: exactly the gradient of k2.
        return k2 - k2.detach() + value.detach()

    straight_through.__name__ = f"kl_{name}_plus".replace("+", "")
    straight_through.__qualname__ = straight_through.__name__
    straight_through.__doc__ = f"""Straight-through ``{name}+``: value of ``{name}``, gradient of ``k2``.

    Formula: ``k2 - k2.detach() + {name}.detach()``.
    Value: that of ``{name}``. Gradient (loss mode): ``d * s``, whose on-policy expectation is
    grad KL(pi_theta || pi_ref) (unbiased per token); off-policy it needs an importance weight,
    which this twin does not apply. Clamping: as ``{name}`` for the value, ``d`` clamped for the
    gradient. Source: verl's "+" estimators (fixed in verl PR 6058).
    """
    return straight_through
