"""The optimum a KL configuration trains toward, as a function of beta, and what a batch of sequences tells about it.

Two families of KL-regularised optima have a closed form (reward r, coefficient b, reference ref):

- ``reverse``: ``max E_pi[r] - b * KL(pi || ref)`` gives ``pi_b = ref * exp(r / b) / Z``;
- ``forward``: ``max E_pi[r] - b * KL(ref || pi)`` gives ``pi_b = b * ref / (lam - r)``, ``lam > max r`` fixed by
  ``sum pi_b = 1``.

:func:`kl_optimum_of` says which family a KL configuration trains toward, and at which multiple of beta, from the
gradient that each place of the KL gives (``docs/kl.md``, "Which optimum each KL trains toward"). :class:`KLOptimum`
estimates, from sequences drawn by the policy pi (scores ``r``, log-ratios ``d = log pi(y) - log ref(y)``), the KL to
the reference of the family's member at ``b``, and solves for the coefficient whose optimum has a target KL: what the
equilibrium controller reads (``klppo.kl.EquilibriumKLController``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["KLOptimum", "REVERSE", "FORWARD", "kl_optimum_of", "optimum_kl", "equilibrium_log_coef"]

REVERSE = "reverse"
FORWARD = "forward"

# b stays within [exp(-30), exp(30)], where r / b is finite
_LOG_B_LIMIT = 30.0
_BISECTIONS = 100

# The expected gradient of the KL term in one place, as a sum of three terms (one sequence y = y_1..y_T, h_t its
# prefix before token t, s_t = grad log pi(y_t | h_t)):
#   "seq":   grad KL(pi || ref) of whole sequences;
#   "path":  sum_t E[grad_theta KL(pi(.|h_t) || ref(.|h_t))], the prefixes held where they were sampled: what a
#            per-token loss term gives (Tang & Munos 2025); on a one-token response, the same as "seq";
#   "fpath": the same for the forward KL(ref(.|h_t) || pi(.|h_t)).
# In the reward, an estimator's detached value X_t enters the return, and with reward-to-go the policy gradient is
# E[(sum_s s_s)(sum_t X_t)] = grad E[sum_t X_t] - E[sum_t grad X_t]. In the loss (on-policy) it is E[sum_t grad Y_t],
# Y the estimator whose gradient is taken (k2 for a straight-through `X+`). Each estimator declares its terms when it
# is registered (`KLGradient.terms` of its `reward` and `loss`; the built-in ones in `klppo.kl.estimators`).


@dataclass(frozen=True)
class KLOptimum:
    """The optimum a KL term trains toward at coefficient beta: the member of the ``divergence`` family (``reverse``:
    ``ref * exp(r / b) / Z``; ``forward``: ``b * ref / (lam - r)``) at ``b = scale * beta``. ``per_token``: the KL's
    gradient is only the per-token part (a KL in the loss): the optimum is exact for one-token responses and an
    approximation on longer ones, where the prefixes' share of the sequence-level gradient is missing."""

    divergence: str = REVERSE
    scale: float = 1.0
    per_token: bool = False

    def __post_init__(self):
        if self.divergence not in (REVERSE, FORWARD):
            raise ValueError(f"divergence must be {REVERSE!r} or {FORWARD!r}, got {self.divergence!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")

    def describe(self) -> str:
        form = "ref * exp(r / b) / Z" if self.divergence == REVERSE else "b * ref / (lam - r)"
        b = "beta" if self.scale == 1 else f"{self.scale:g} * beta"
        return f"{self.divergence}: {form}, b = {b}" + (" (per token)" if self.per_token else "")

    def exact(self, ref_logp, reward, beta: float):
        """``log pi`` of the optimum at coefficient ``beta`` over an enumerated set of outcomes (float64): ``ref_logp``
        the reference's log-probabilities (``-inf`` outside its support), ``reward`` each outcome's reward. For the
        forward family, ``lam`` is found by bisection (``sum_y b * ref(y) / (lam - r(y))`` falls as ``lam`` rises)."""
        import torch

        ref = torch.as_tensor(ref_logp, dtype=torch.float64)
        r = torch.as_tensor(reward, dtype=torch.float64)
        b = self.scale * beta
        if self.divergence == REVERSE:
            return torch.log_softmax(ref + r / b, dim=-1)
        keep = torch.isfinite(ref)
        top = float(r[keep].max())
        gap = (top - r).clamp(min=0).log()

        def log_mass(s):  # log sum_y b * ref(y) / (lam - r(y)), lam = top + exp(s)
            return math.log(b) + float(
                torch.logsumexp(ref[keep] - torch.logaddexp(torch.full_like(gap[keep], s), gap[keep]), dim=0)
            )

        lo, hi = math.log(b) + float(torch.logsumexp(ref[keep & (r == top)], dim=0)), math.log(b)  # mass >= 1, <= 1
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if log_mass(mid) > 0 else (lo, mid)
        s = torch.full_like(gap, 0.5 * (lo + hi))
        out = math.log(b) + ref - torch.logaddexp(s, gap)
        return torch.where(keep, out, torch.full_like(out, -math.inf))

    # -- the family at b, from a batch drawn by pi ------------------------------------------------------------------
    def log_weights(self, log_b: float, scores, log_ratios):
        """Unnormalised log importance weights ``log(pi_b / pi)`` of the batch's sequences at ``b = exp(log_b)``
        (float64), up to a constant."""
        r, d = _tensors(scores, log_ratios)
        if self.divergence == REVERSE:
            return math.exp(-log_b) * r - d
        return _forward_log_terms(_forward_s(log_b, r, d), r, d)

    def kl(self, log_b: float, scores, log_ratios) -> float:
        """Self-normalised importance-sampling estimate of ``KL(pi_b || ref)`` from the batch (see
        :func:`optimum_kl`): ``KL(w || uniform) + E_w[d]`` with ``w`` the normalised weights ``pi_b / pi``."""
        return _kl_of_weights(self.log_weights(log_b, scores, log_ratios), _tensors(scores, log_ratios)[1])

    def ess(self, log_b: float, scores, log_ratios) -> float:
        """The effective sample size of the weights at ``b``, over the batch's size (in (0, 1])."""
        import torch

        w = torch.softmax(self.log_weights(log_b, scores, log_ratios), dim=0)
        return float(1.0 / (w * w).sum()) / w.numel()

    def solve(self, scores, log_ratios, target: float, lo: float, hi: float) -> float:
        """``log beta`` in ``[lo, hi]`` whose optimum has the estimated KL ``target`` (bisection: the estimate falls as
        beta grows); the bound on the side the batch cannot reach when the target lies outside its range."""
        shift = math.log(self.scale)
        lo_b, hi_b = max(lo + shift, -_LOG_B_LIMIT), min(hi + shift, _LOG_B_LIMIT)
        r, d = _tensors(scores, log_ratios)
        if self.divergence == REVERSE:
            return _bisect(lambda log_b: _kl_of_weights(math.exp(-log_b) * r - d, d), target, lo_b, hi_b) - shift
        # forward: bisect over s = log(lam - max r), where b follows in closed form (b rises with s), then clamp b
        s_lo, s_hi = _forward_s_bracket(lo_b, hi_b, r, d)
        s = _bisect(lambda s: _kl_of_weights(_forward_log_terms(s, r, d), d), target, s_lo, s_hi)
        log_b = min(max(_forward_log_b(s, r, d), lo_b), hi_b)
        return log_b - shift


def _tensors(scores, log_ratios):
    import torch

    return torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(log_ratios, dtype=torch.float64)


def _kl_of_weights(log_w, d) -> float:
    """``KL(w || uniform) + E_w[d]``, ``w = softmax(log_w)``: the estimate of ``E_{pi_b}[log pi_b / ref]`` with
    ``pi_b / pi`` estimated as ``n * w`` (no large terms cancel)."""
    import torch

    w = torch.softmax(log_w, dim=0)
    return float(torch.special.xlogy(w, w).sum() + math.log(w.numel()) + (w * d).sum())


def _bisect(estimate, target: float, lo: float, hi: float) -> float:
    """The point of ``[lo, hi]`` where a decreasing ``estimate`` crosses ``target`` (a bound when it does not)."""
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if estimate(mid) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# The forward family on a batch: with lam = max r + exp(s), sum pi_b = 1 estimated by importance sampling,
# mean_i(exp(-d_i) * b / (lam - r_i)) = 1, gives b in closed form, b = n / sum_i exp(-d_i) / (lam - r_i), rising with
# lam; the weights pi_b / pi are proportional to exp(-d_i) / (lam - r_i). So one search over s replaces the search for
# lam at each b.
def _forward_log_terms(s: float, r, d):
    import torch

    gap = (r.max() - r).log()  # -inf at the batch's best score
    return -d - torch.logaddexp(torch.full_like(gap, s), gap)


def _forward_log_b(s: float, r, d) -> float:
    import torch

    return math.log(r.numel()) - float(torch.logsumexp(_forward_log_terms(s, r, d), dim=0))


def _forward_s_bracket(lo_b: float, hi_b: float, r, d) -> tuple[float, float]:
    """An interval of s whose b spans ``[exp(lo_b), exp(hi_b)]``: ``s + log n - LSE(-d) <= log b(s) <= s + log n -
    LSE_best(-d)``, LSE_best over the sequences with the best score."""
    import torch

    log_n = math.log(r.numel())
    best = r == r.max()
    return (lo_b - log_n + float(torch.logsumexp(-d[best], dim=0)), hi_b - log_n + float(torch.logsumexp(-d, dim=0)))


def _forward_s(log_b: float, r, d) -> float:
    """The s (``lam = max r + exp(s)``) of the forward optimum at ``b = exp(log_b)`` on the batch: the root of the
    estimated normalisation, by bisection (``log b(s)`` rises with s)."""
    lo, hi = _forward_s_bracket(log_b, log_b, r, d)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if _forward_log_b(mid, r, d) < log_b:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def optimum_kl(inv_beta: float, scores, log_ratios) -> float:
    """Estimate, from sequences sampled by a policy pi, the KL to the reference of the KL-regularised optimum
    ``pi_beta = ref * exp(r / beta) / Z`` at ``1 / beta = inv_beta``.

    ``scores`` are the sequences' rewards r, ``log_ratios`` their ``log pi(y) - log ref(y)`` (summed over tokens).
    Self-normalised importance sampling with weights ``w = exp(r / beta - log_ratio) ∝ pi_beta / pi``::

        KL(pi_beta || ref) = E_pi_beta[r] / beta - log Z,   Z = E_pi[exp(r / beta) * ref / pi]

    Exact when the sample is the distribution itself (every sequence in proportion to its probability). It rises
    with ``inv_beta``. When ``pi`` is the optimum ``pi_beta`` the weights are all equal and the estimate is the
    batch's mean log-ratio, the k1 estimate of pi's own KL.
    """
    r, d = _tensors(scores, log_ratios)
    # = E_w[r] / beta - log mean(exp(r / beta - d)), written as KL(w || uniform) + E_w[d]: no large terms cancel
    return _kl_of_weights(inv_beta * r - d, d)


def equilibrium_log_coef(scores, log_ratios, target: float, lo: float, hi: float) -> float:
    """``log beta`` in ``[lo, hi]`` whose reverse-KL optimum has ``optimum_kl == target`` (bisection: the estimate
    falls as beta grows); the bound on the side the batch cannot reach when the target lies outside its range. The
    search stays within ``[-30, 30]`` (beta from 1e-13 to 1e13), where ``r / beta`` is finite."""
    return KLOptimum().solve(scores, log_ratios, target, lo, hi)


def kl_optimum_of(mode: str, estimator: str, loss_weight: Optional[float] = 1.0) -> Optional[KLOptimum]:
    """The optimum that the estimator ``estimator`` in ``kl_mode=mode`` trains toward, or None where it has no
    closed form klppo knows.

    ``loss_weight``: the weight of the loss-mode KL term against the policy gradient, per unit of beta (1 when
    ``beta`` names ``E[r] - beta * KL`` in the loss; None where it changes with the policy, which leaves a
    configuration with a KL gradient in the loss without a known optimum). The expected gradient of each place is a
    sum of the sequence-level KL's gradient (``seq``), the per-token part of the reverse KL's (``path``) and of the
    forward KL's (``fpath``); a sum ``a * seq + c * path`` (``a, c >= 0``) trains toward the reverse family at
    ``(a + c) * beta`` (per token when ``c > 0``), ``c * fpath`` toward the forward family at ``c * beta`` (per
    token), anything else toward no closed form.
    """
    from .estimators import get_kl_estimator_spec
    from .penalty import KL_MODES

    places = KL_MODES.get(mode, ())
    try:
        spec = get_kl_estimator_spec(estimator)
    except (KeyError, ValueError):
        return None
    terms: dict[str, float] = {}
    if "reward" in places:
        if spec.reward is None or spec.reward.terms is None:
            return None
        for k, v in spec.reward.terms.items():
            terms[k] = terms.get(k, 0.0) + v
    if "loss" in places:
        if spec.loss is None or spec.loss.terms is None:
            return None
        if spec.loss.terms:
            if loss_weight is None:
                return None
            for k, v in spec.loss.terms.items():
                terms[k] = terms.get(k, 0.0) + loss_weight * v
    terms = {k: v for k, v in terms.items() if abs(v) > 1e-12}
    if set(terms) == {"fpath"} and terms["fpath"] > 0:
        return KLOptimum(FORWARD, terms["fpath"], per_token=True)
    if terms and set(terms) <= {"seq", "path"} and all(v > 0 for v in terms.values()):
        return KLOptimum(REVERSE, sum(terms.values()), per_token="path" in terms)
    return None
