"""The equilibrium controller: log(beta) moved toward the batch's estimate of beta*, the coefficient whose
KL-regularised optimum has the target KL."""

from __future__ import annotations

import math
from typing import Optional

from ..optimum import KLOptimum
from .base import (
    LogSpaceController,
    _as_float,
    _check_bounds,
    _check_nonnegative,
    _check_positive,
    register_kl_controller,
    safe_log,
)

__all__ = ["EquilibriumKLController"]


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
    near it the share is close to 1 while a small batch's estimate of log beta* is noisy (`docs/results.md`, "The
    controllers in brief"), so the unfiltered step follows each batch's noise and the KL settles away from the
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
    approximation (measured on the default task: `docs/results.md`, "The default job"). A KL in the loss gives only the per-token part of the sequence
    KL's gradient, so on responses longer than one token its optimum is the sequence-level one only approximately.
    A target in nats per token is turned into one per sequence by the batch's mean length.

    The approach: until the KL statistic first reaches the target, the coefficient in force is the one above
    times ``(kl / target) ** approach_power`` (``kl`` the update's statistic; a statistic at or below 0 gives
    ``coef_min``). A policy still far from the target is held back less, so the KL arrives sooner than at beta*
    itself; the factor is 1 at the target, and from the first reading at or above it on the hold (below) takes its
    place, so the fixed point is untouched. ``approach_power=0`` turns it off. Where it helps (a slow policy) and
    where it costs (a fast one): `docs/results.md`, "The controllers in brief" and "The equilibrium controller".

    The hold: once the KL has arrived, the coefficient in force is the equilibrium one times ``(kl / target) **
    hold_power`` (1), the ratio within [1/e, e]. beta* is the coefficient whose *optimum* has the target KL; a policy
    that lags behind that optimum (a slow learning rate, an update cut short by the guard) holds a KL below the target
    at beta*, and one that runs ahead of it a KL above. The factor answers the KL measured now, without a sum, so
    nothing winds up while the policy lags; it is 1 at the target, so a policy at the optimum of beta* keeps beta*.
    ``hold_power=0`` turns it off. The equilibrium coefficient itself (``kl/coef_equilibrium``) does not see the
    factor. Measured on the bandit's grid and the default task in `docs/results.md` ("The hold").
    """

    reads_sequences = True

    def __init__(
        self,
        kl_coef: float,
        target: float,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        approach_power: float = 0.75,
        optimum: Optional[KLOptimum] = None,
        jackknife_groups: int = 0,
        drift: float = 0.05,
        hold_power: float = 1.0,
    ):
        kl_coef = _check_positive(
            kl_coef, "kl_coef", "an adaptive controller needs an initial coefficient > 0 (e.g. 0.05)"
        )
        self.target = _check_positive(target, "target", "set kl_target to the KL you want, e.g. 4 (nats/sequence)")
        self.coef_min, self.coef_max = _check_bounds(coef_min, coef_max)
        self.approach_power = _check_nonnegative(
            approach_power, "approach_power", "e.g. 0.75 (0 turns the approach off)"
        )
        self.hold_power = _check_nonnegative(
            hold_power, "hold_power", "e.g. 1 (0: beta is the equilibrium coefficient once the KL has arrived)"
        )
        groups = _as_float(jackknife_groups)
        if not (math.isfinite(groups) and groups == int(groups) and (groups == 0 or groups >= 2)):
            raise ValueError(
                f"jackknife_groups must be 0 (no filter) or a whole number >= 2, got {jackknife_groups}; e.g. 8"
            )
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
        return dict(
            target=self.target,
            coef_min=self.coef_min,
            coef_max=self.coef_max,
            approach_power=self.approach_power,
            hold_power=self.hold_power,
            optimum=self.optimum.describe(),
            jackknife_groups=self.jackknife_groups,
            drift=self.drift,
        )

    def _dynamic_state(self) -> dict:
        return {"coef": self.coef, "arrived": self.arrived, "variance": self.variance}

    def _load_dynamic_state(self, state: dict) -> None:
        # a state written before the approach existed holds beta alone, the equilibrium coefficient
        self.coef = float(state.get("coef", self._value))
        self.arrived = bool(state.get("arrived", True))
        self.variance = float(state.get("variance", 1.0))
