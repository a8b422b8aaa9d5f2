"""The step checks: what decides, once per optimizer step, whether the step goes ahead.

A mini-batch's loss is accumulated over micro-batches; at the accumulation boundary, before the last backward pass
(under DeepSpeed that pass is the one that reduces the gradients and lets its engine step), `StepChecks` decides,
the same on every rank with one collective, whether the step is taken:

- `"nonfinite"`: some rank saw a non-finite loss;
- `"guard"` / `"guard_low"`: the KL guard (`klppo.ppo.safety.kl_guard.KLGuard`) found the KL to the reference pushed past its
  bounds by this update;
- None: the step goes ahead.

Each micro-batch hands it its loss and a `GuardSample`: the KL at the current policy of the micro-batch's units
(sequences or tokens, the controller statistic's unit) and the same units' KL at the rollout, as sums, so that the
guard judges how far this update has moved the KL and how noisy that estimate is.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from ...kl.reduce import all_reduce_sum, unit_count

APPLIED, NONFINITE = "applied", "nonfinite"  # a step's verdicts, beside the guard's (`kl_guard.py`)


@dataclass
class GuardSample:
    """One micro-batch's reading for the KL guard, as sums over its units.

    Attributes:
        kl_now: the units' KL at the current policy (`k1` importance-weighted by `pi / pi_old`, per token, summed).
        kl_rollout: the same units' KL at the rollout (`log pi_old - log ref`, summed).
        change_sq: the sum over units of the squared change (`kl_now - kl_rollout` per unit), for its noise.
        count: the number of units.
    """

    kl_now: torch.Tensor
    kl_rollout: torch.Tensor
    change_sq: torch.Tensor
    count: torch.Tensor


@torch.no_grad()
def guard_sample(
    log_ratio: torch.Tensor,
    old_log_ratio: torch.Tensor,
    rollout_log_ratio: torch.Tensor,
    mask: torch.Tensor,
    unit: str,
    is_weight: torch.Tensor | None = None,
) -> GuardSample:
    """The guard's reading of a micro-batch from its per-token log-ratios `[B, R]` at the current policy: to the
    reference (`log_ratio`) and to the sampling policy (`old_log_ratio`), and the rollout's `log pi_old - log ref`.
    A unit is a sequence (`unit="sequence"`: its tokens summed) or a token. `is_weight`: an inexact engine sampled
    the tokens; each token's terms are weighted by its truncated `pi_old / mu` (`generation/correction.py`), as the
    rollout's statistic is."""
    mask = mask.double()
    weight = mask if is_weight is None else mask * is_weight.double()
    now = torch.exp(old_log_ratio.double()) * log_ratio.double() * weight  # the tokens were sampled by pi_old
    before = rollout_log_ratio.double() * weight
    if unit == "sequence":
        now_units, before_units = now.sum(dim=1), before.sum(dim=1)
    else:  # the masked positions are 0 in both, and add nothing to any sum (no indexing: no host sync)
        now_units, before_units = now, before
    change = now_units - before_units
    return GuardSample(now_units.sum(), before_units.sum(), (change * change).sum(), unit_count(mask, unit))


class StepChecks:
    """The checks of one optimizer step, accumulated over its micro-batches (`add`) and decided at the boundary
    (`verdict`) with one all-reduce and one host sync per step."""

    def __init__(self, device):
        # non-finite losses; the guard's sums: KL now, KL at the rollout, squared change, units
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, sample: GuardSample) -> None:
        self.sums[0] += (~torch.isfinite(loss.detach())).double()
        self.sums[1:] += torch.stack([sample.kl_now, sample.kl_rollout, sample.change_sq, sample.count.double()])

    def verdict(self, accelerator, guard, reading: float | None, applied: int) -> str | None:
        """`"nonfinite"`, the guard's verdict (`"guard"` / `"guard_low"`), or None to take the step. The update's first
        step always goes ahead as far as the guard is concerned (`applied` steps taken so far)."""
        bad, kl_now, kl_rollout, change_sq, count = all_reduce_sum(self.sums, accelerator).tolist()
        if bad:
            return NONFINITE
        if applied == 0:
            return None
        if not guard_reads_change_sq(type(guard)):  # a guard written before `change_sq` existed
            return guard.check(kl_now, count, kl_rollout, reading)
        return guard.check(kl_now, count, kl_rollout, reading, change_sq=change_sq)


@functools.cache
def guard_reads_change_sq(guard_class: type) -> bool:
    """Whether `guard_class.check` takes `change_sq` (the squared change's sum, added for `low_significance`)."""
    parameters = inspect.signature(guard_class.check).parameters
    return "change_sq" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
