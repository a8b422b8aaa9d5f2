"""Per-token KL estimators, their registry, and the exact full-vocabulary KL.

Notation, per sampled response token (`docs/kl.md`, "KL estimators and the gradient each one gives")::

    d = logp - ref_logp          log pi_theta(token) - log pi_ref(token)
    r = exp(-d)                  pi_ref(token) / pi_theta(token)
    s = grad log pi_theta(token) the score

"Value unbiased" means ``E_{token ~ pi_theta}[k] = KL(pi_theta || pi_ref)``. The gradient an
estimator gives depends on how it is used: backpropagated through ("loss mode") or detached into the
return ("reward mode"); ``klppo.kl.divergence.divergence_followed`` answers that question for every
estimator and mode, and each docstring below states the loss-mode answer.

Every per-token estimator is a function of the log-ratios alone, and every registered one shares one signature::

    fn(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0) -> Tensor

- ``log_ratio`` ``[...]``: ``d = logp - ref_logp`` of the sampled token, with the reference detached; in the loss
  it carries the policy's gradient.
- ``old_log_ratio`` ``[...]`` or ``None``: ``logp - old_logp``, the same token's log-ratio to the policy that
  sampled the rollout (0 at that policy); read by ``corrected_k3`` only.
- ``log_ratio_clamp``: ``C``; both log-ratios are clamped to ``[-C, C]`` before any ``exp``. ``C = 40`` keeps
  float32 finite (exp(40) ~ 2.35e17) and therefore also every gradient: a clamp on the output alone would still
  give ``0 * inf = NaN`` gradients. ``torch.clamp`` passes no gradient outside its range, so a clamped token gets a
  zero gradient from the log-ratio. ``None`` disables the clamp (then a large ``|d|`` can overflow).

The output has the broadcast shape of the inputs and their dtype. ``klppo.kl.estimate.kl_from_log_ratio`` is the entry
point that also applies the optional output clamp and reports which tokens hit a clamp; ``compute_kl`` takes log-probs
instead and forms the log-ratios first. A rollout's log-ratio is formed once and every estimate of it reads that one tensor.

Estimators that need the whole distribution rather than the sampled token's log-probs (the exact
``full`` KL) register with ``inputs="logits"`` and the signature ``fn(logits, ref_logits, chunk_size)``;
``klppo.kl.estimate.estimate_kl`` calls either kind with what it needs.

Adding an estimator is one function and one decorator, which declares the estimator whole: its value formula and
what its expected gradient follows in the reward and in the loss (``KLGradient``, with the terms that give the optimum
it trains toward; ``klppo.kl.estimator_registry``)::

    @register_kl_estimator("my_kl", formula="...", loss=KLGradient(REVERSE_KL, True, "{name} as a loss: ...",
                                                                  terms={"path": 1.0}))
    def kl_my(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0): ...

The decorator also registers the straight-through twin ``my_kl+`` (value of ``my_kl``, gradient
of ``k2``). The registry is ``klppo.kl.estimator_registry``; the full-vocabulary KL is ``klppo.kl.full``.
"""

from __future__ import annotations

import torch

from .estimator_registry import (
    FORWARD_KL,
    NO_GRADIENT,
    REVERSE_KL,
    KLEstimatorSpec,
    KLGradient,
    _clamp,
    _k2,
    get_kl_estimator,
    get_kl_estimator_spec,
    kl_estimators,
    register_kl_estimator,
    unregister_kl_estimator,
)
from .full import full_kl

__all__ = [
    "KLEstimatorSpec",
    "KLGradient",
    "register_kl_estimator",
    "get_kl_estimator",
    "get_kl_estimator_spec",
    "kl_estimators",
    "full_kl",
    "BUILTIN_KL_ESTIMATORS",
    "unregister_kl_estimator",
    "LOW_VAR_KL_CLAMP",
]

# verl's `low_var_kl` clamps its output to [-10, 10].
LOW_VAR_KL_CLAMP = 10.0


def _k3(d, log_ratio_clamp):
    d = _clamp(d, log_ratio_clamp)
    # r - 1 - log r with r = exp(-d); expm1 keeps precision for small |d|.
    return torch.expm1(-d) + d


# ---------------------------------------------------------------------------------------------
# what each estimator's gradient follows, place by place (`KLGradient`; the table of `docs/kl.md`)


def _off_policy(gradient: str) -> KLGradient:
    """The loss off-policy (pi != pi_old) of an estimator without an importance weight."""
    return KLGradient(
        "neither KL direction (no importance weight)",
        False,
        f"{{name}} as a loss off-policy (pi != pi_old): the expected gradient {gradient} has no importance "
        "weight and follows neither KL; use corrected_k3 (or k2 weighted by stopgrad(pi/pi_old)).",
    )


def _reward_mix(extra: str = "", terms=None) -> KLGradient:
    """k3's family in the reward: the value estimates KL(pi||ref), the score-function gradient adds -grad KL(ref||pi)."""
    return KLGradient(
        f"biased mix: grad {REVERSE_KL} - grad {FORWARD_KL}",
        False,
        f"{{name}} in the reward follows grad KL(pi||ref) - grad KL(ref||pi), not grad KL(pi||ref){extra}; "
        "reported to destabilise training: use k1 in the reward, or this estimator as a loss.",
        terms,
    )


def _forward_loss(extra: str = "", terms=None) -> KLGradient:
    return KLGradient(
        FORWARD_KL,
        False,
        "{name} as a loss follows KL(ref||pi), the FORWARD KL: its value estimates KL(pi||ref) but its "
        f"gradient (1 - r) * s is that of KL(ref||pi){extra}; use k3+ or k2 for the reverse KL.",
        terms,
    )


_LOW_VAR_CLAMP_NOTE = "; the [-10, 10] output clamp also removes the gradient of the most divergent tokens"


# ---------------------------------------------------------------------------------------------
# the estimators


@register_kl_estimator(
    "k1",
    formula="d",
    reward=KLGradient(
        REVERSE_KL,
        True,
        "{name} in the reward: with reward-to-go (gamma = 1) the policy gradient "
        "E[k1 * s] is the unbiased gradient of the sequence-level KL(pi||ref).",
        {"seq": 1.0},
    ),
    loss=KLGradient(
        NO_GRADIENT,
        False,
        "{name} as a loss: its gradient is the score s, whose expectation is 0: noise, "
        "no regularisation; use k1 in the reward or k2 / k3+ as a loss.",
        {},
    ),
    off_policy_loss=_off_policy("E_old[s] = grad E_old[log pi] (pushes pi away from pi_old)"),
)
def kl_k1(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k1 = d = logp - ref_logp.  Shapes: ``[...] -> [...]``.

    Value: unbiased for KL(pi_theta || pi_ref), high variance, can be negative.
    Gradient as a loss: ``s``, expectation 0 (no regularisation, only noise). In the reward (with
    reward-to-go) it gives the unbiased gradient of the sequence-level KL(pi_theta || pi_ref).
    Clamping: ``d`` to ``[-C, C]``. Source: Schulman 2020 ("Approximating KL Divergence");
    Ziegler et al. 2019 use it in the reward.
    """
    return _clamp(log_ratio, log_ratio_clamp)


@register_kl_estimator(
    "k2",
    formula="d^2 / 2",
    reward=KLGradient(
        f"biased mix: grad E_pi[k2] - grad {REVERSE_KL}",
        False,
        "{name} in the reward follows grad "
        "E_pi[d^2/2] - grad KL(pi||ref), not a KL: use k1 in the reward (k2 belongs in the loss).",
    ),
    loss=KLGradient(
        REVERSE_KL,
        True,
        "{name} as a loss: gradient d * s, the unbiased per-token gradient of KL(pi||ref) "
        "on-policy (k2 loss == k1 reward, token-wise).",
        {"path": 1.0},
    ),
    off_policy_loss=_off_policy("E_old[d * s]"),
)
def kl_k2(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k2 = d**2 / 2.  Shapes: ``[...] -> [...]``.

    Value: biased (an f-divergence that matches KL to second order), always >= 0.
    Gradient as a loss: ``d * s``, whose on-policy expectation is grad KL(pi_theta || pi_ref)
    (unbiased per token; k2 as loss == k1 in the reward, token-wise). Off-policy without an
    importance weight it follows neither KL direction.
    Clamping: ``d`` to ``[-C, C]``. Source: Schulman 2020; verl calls it ``mse``; OpenRLHF.
    """
    return _k2(log_ratio, log_ratio_clamp)


@register_kl_estimator(
    "k3",
    formula="exp(-d) - 1 + d",
    reward=_reward_mix(terms={"seq": 1.0, "fpath": -1.0}),
    loss=_forward_loss(terms={"fpath": 1.0}),
    off_policy_loss=_off_policy("E_old[(1 - r) * s]"),
)
def kl_k3(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k3 = r - 1 - log r = expm1(-d) + d.  Shapes: ``[...] -> [...]``.

    Value: unbiased for KL(pi_theta || pi_ref), low variance, always >= 0.
    Gradient as a loss: ``(1 - r) * s``, whose on-policy expectation is grad KL(pi_ref || pi_theta):
    the FORWARD KL, not the reverse KL that the value estimates. In the reward it gives
    grad KL(pi||ref) - grad KL(ref||pi).
    Clamping: ``d`` to ``[-C, C]`` before the exp. Source: Schulman 2020; the GRPO loss.
    """
    return _k3(log_ratio, log_ratio_clamp)


@register_kl_estimator(
    "low_var_kl",
    formula="clamp(k3, -10, 10)",
    output_clamp=LOW_VAR_KL_CLAMP,
    reward=_reward_mix(" (and the [-10, 10] output clamp biases the value further)"),
    loss=_forward_loss(_LOW_VAR_CLAMP_NOTE),
    off_policy_loss=_off_policy("E_old[(1 - r) * s]"),
)
def kl_low_var_kl(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """low_var_kl = clamp(k3, -10, 10).  Shapes: ``[...] -> [...]``.

    Value: k3 with the output clamped, so biased (downwards) where k3 > 10.
    Gradient as a loss: that of k3 (grad KL(pi_ref || pi_theta)) except that the output clamp
    zeroes the gradient of the most divergent tokens: ``d < -2.611`` (``log(ref/pi) > 2.611``) or
    ``d > 11.0``.
    Clamping: ``d`` to ``[-C, C]``, then the output to ``[-10, 10]``. Source: verl ``low_var_kl``.
    """
    return _k3(log_ratio, log_ratio_clamp).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


@register_kl_estimator(
    "abs",
    formula="abs(d)",
    reward=KLGradient(
        "biased mix: grad E_pi|d| - grad sum_x |pi(x) - ref(x)|",
        False,
        "{name} in the reward follows grad E_pi|d| - grad sum|pi - ref|, not a KL: use k1 in the reward.",
    ),
    loss=KLGradient(
        "total variation: sum_x |pi(x) - ref(x)|",
        False,
        "{name} as a loss: gradient sign(d) * s, whose "
        "expectation is the gradient of sum|pi - ref| (twice the total variation), not of a KL.",
    ),
    off_policy_loss=_off_policy("E_old[sign(d) * s]"),
)
def kl_abs(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """abs = |d|.  Shapes: ``[...] -> [...]``.

    Value: biased (E|d| >= KL), >= 0.
    Gradient as a loss: ``sign(d) * s``, whose on-policy expectation is the gradient of
    ``sum_x |pi_theta(x) - pi_ref(x)|`` (twice the total-variation distance), not of a KL.
    Clamping: ``d`` to ``[-C, C]``. Source: verl ``abs``; old TRL ``kl_penalty="abs"``.
    """
    return _clamp(log_ratio, log_ratio_clamp).abs()


_CORRECTED_K3_LOSS = KLGradient(
    REVERSE_KL,
    True,
    "{name} as a loss: grad(w * k3) = w * d * s, the unbiased per-token gradient of KL(pi||ref) on- "
    "and off-policy (DeepSeek-V3.2 Eq. 7); without old_logp it falls back to k3 (forward KL).",
    {"path": 1.0},
)


@register_kl_estimator(
    "corrected_k3",
    formula="w * k3, w = pi / pi_old",
    uses_old_logp=True,
    reward=_reward_mix(
        " (rewards are computed at rollout time where pi = pi_old, so w = 1)", {"seq": 1.0, "fpath": -1.0}
    ),
    loss=_CORRECTED_K3_LOSS,
    off_policy_loss=_CORRECTED_K3_LOSS,
)
def kl_corrected_k3(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """corrected_k3 = w * k3 with w = exp(clamp(logp - old_logp)) = pi_theta / pi_old.

    Shapes: ``[...] -> [...]``. The gradient flows through both ``w`` and ``k3``:
    ``grad(w * k3) = w * (k3 + 1 - r) * s = w * d * s``, so under tokens sampled from pi_old the
    expected gradient is grad KL(pi_theta || pi_ref), on- and off-policy (DeepSeek-V3.2 Eq. 7).
    Value: ``w * k3`` is an unbiased importance-weighted estimate of KL(pi_theta || pi_ref) under
    pi_old sampling; at theta = old it equals k3. Without ``old_log_ratio`` it is plain k3.
    Clamping: both log-ratios to ``[-C, C]`` before their exp. Source: DeepSeek-V3.2 Eq. 7;
    Trinity; TRL GRPO ``use_bias_correction_kl``.
    """
    k3 = _k3(log_ratio, log_ratio_clamp)
    if old_log_ratio is None:
        return k3
    return torch.exp(_clamp(old_log_ratio, log_ratio_clamp)) * k3


# ---------------------------------------------------------------------------------------------
# full-vocabulary KL (`klppo.kl.full`)


def _full_loss(where: str = "") -> KLGradient:
    return KLGradient(
        REVERSE_KL,
        True,
        f"full as a loss: the exact gradient of the per-position KL(pi||ref){where}; "
        "the effect of a token on later positions is not included (use k1 in the reward for that).",
        {"path": 1.0},
    )


@register_kl_estimator(
    "full",
    formula="sum_v pi_v * (log pi_v - log ref_v)",
    inputs="logits",
    reward=KLGradient(
        f"partial: score-function part of grad {REVERSE_KL}",
        False,
        "full in the reward: the per-position "
        "KL depends on theta directly too, and only the loss path sees that part; the gradient of the "
        "sequence KL(pi||ref) is exact only with full also in the loss (same coefficient).",
        {"seq": 1.0, "path": -1.0},
    ),
    loss=_full_loss(),
    off_policy_loss=_full_loss(" (positions are those sampled by pi_old)"),
)
def kl_full(logits, ref_logits, chunk_size=1024):
    """Exact per-position KL(pi || ref) over the vocabulary (``full_kl``)."""
    return full_kl(logits, ref_logits, chunk_size=chunk_size)


# the estimators klppo ships (anything registered later is a plug-in)
BUILTIN_KL_ESTIMATORS: tuple[str, ...] = tuple(kl_estimators())
