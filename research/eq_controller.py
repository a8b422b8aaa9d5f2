"""Prototype: the equilibrium controller (sets beta to the batch's estimate of the beta whose optimum has the target KL)."""
import math

import torch

from klppo.kl.controllers import _LogSpaceController, register_kl_controller, _check_positive


def optimum_kl(theta, r, l):
    """SNIS estimate of KL(pi_beta || ref), theta = 1/beta, from samples of pi with scores r and log-ratios l."""
    logw = theta * r - l
    w = torch.softmax(logw, 0)
    return float((w * theta * r).sum() - (torch.logsumexp(logw, 0) - math.log(len(r))))


def solve(r, l, target, lo=-12.0, hi=12.0):
    """log beta whose estimated optimum KL is target (KL rises with 1/beta)."""
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if optimum_kl(math.exp(-mid), r, l) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@register_kl_controller("equilibrium")
class EquilibriumKLController(_LogSpaceController):
    def __init__(self, kl_coef, target, smoothing: float = 0.3, coef_min: float = 1e-4, coef_max: float = 10.0,
                 per_token: bool = False, max_step: float = 1.0):
        self.target = target
        self.smoothing = smoothing
        self.coef_min, self.coef_max = coef_min, coef_max
        self.per_token = per_token
        self.max_step = max_step
        super().__init__(kl_coef)
        self.batch = None
        self.estimate = None

    def observe_sequences(self, scores, log_ratios, lengths):
        self.batch = (scores, log_ratios, lengths)

    def _step(self, kl, n_steps):
        if self.batch is None:
            return self._value
        r, l, n = self.batch
        target = self.target * float(n.mean()) if self.per_token else self.target
        lo, hi = self._log_bounds()
        est = min(max(solve(r, l, target), lo), hi)
        self.estimate = est if self.estimate is None else self.estimate + self.smoothing * (est - self.estimate)
        cur = math.log(self._value)
        new = min(max(self.estimate, cur - self.max_step), cur + self.max_step)
        return self._from_log(new)
