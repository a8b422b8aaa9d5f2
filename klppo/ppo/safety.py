"""Safety beside the loss: what decides, once per optimizer step, whether the step goes ahead.

A mini-batch's loss is accumulated over micro-batches; at the accumulation boundary, before the last backward pass
(under DeepSpeed that pass is the one that reduces the gradients and lets its engine step), `StepChecks` decides,
the same on every rank with one collective, whether the step is taken:

- `"nonfinite"`: some rank saw a non-finite loss;
- `"guard"` / `"guard_low"`: the KL guard (`klppo.ppo.guard.KLGuard`) found the KL to the reference pushed past its
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

from ..kl.reduce import all_reduce_sum, unit_count
from .health import policy_outputs_finite, rollout_outputs_finite
from .rollback import restore_optimisation

APPLIED, NONFINITE = "applied", "nonfinite"  # a step's verdicts, beside the guard's (`klppo.ppo.guard`)


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
def guard_sample(log_ratio: torch.Tensor, old_log_ratio: torch.Tensor, rollout_log_ratio: torch.Tensor,
                 mask: torch.Tensor, unit: str) -> GuardSample:  # fmt: skip
    """The guard's reading of a micro-batch from its per-token log-ratios `[B, R]` at the current policy: to the
    reference (`log_ratio`) and to the sampling policy (`old_log_ratio`), and the rollout's `log pi_old - log ref`.
    A unit is a sequence (`unit="sequence"`: its tokens summed) or a token."""
    mask = mask.double()
    now = torch.exp(old_log_ratio.double()) * log_ratio.double() * mask  # the tokens were sampled by pi_old
    before = rollout_log_ratio.double() * mask
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


@dataclass
class Unsettled:
    """An update whose policy no rollout has checked yet: its number, its optimizer steps, the copy that can undo it
    (None: none), whether it went through without a skipped step, and whether a forward pass over the last rollout
    has found its outputs finite already."""

    step: int
    applied: int
    snapshot: dict | None
    clean: bool
    forward_checked: bool = False

    def state_dict(self) -> dict:
        return {"step": self.step, "applied": self.applied, "clean": self.clean, "forward_checked": self.forward_checked}

    @classmethod
    def from_state(cls, state: dict) -> "Unsettled":
        return cls(int(state["step"]), int(state["applied"]), None, bool(state["clean"]), bool(state["forward_checked"]))


class UpdateSafety:
    """Non-finite values across updates: a skipped update is counted (`NonfiniteGuard`), undone from its copy when
    updates are rolled back (`rollback`), and an update whose steps went through stays unsettled until forward
    passes that run anyway (the next rollout's, or one over the last rollout before a save) find its policy finite.

    Args:
        nonfinite: the run's `NonfiniteGuard` (`max_nonfinite_updates`).
        accelerator: the trainer's accelerator.
        log: whether this process logs (the first one).
    """

    def __init__(self, nonfinite, accelerator, log: bool):
        self.nonfinite, self.accelerator, self.log = nonfinite, accelerator, log
        self.rollback: bool | None = None  # decided once, when the trainer is built (`decide_rollback`)
        self.unsettled: Unsettled | None = None
        self.checked_rows = None  # the last rollout's sequences, which the check before a save reads

    def decide_rollback(self, setting: bool | None, model, engine: str | None) -> bool:
        """Whether a non-finite step undoes its whole update: `setting` (`nonfinite_rollback`), or when that is None,
        whether the trainable weights of `model` (policy and critic) are at most 10% of all weights, as with LoRA and
        the shared critic, so that the copy it takes is small. Counted over all ranks (FSDP shards the weights), so
        every rank decides the same. Never under DeepSpeed, whose optimizer state is sharded."""
        if self.rollback is None:
            if engine == "deepspeed":
                self.rollback = False
            elif setting is not None:
                self.rollback = bool(setting)
            else:
                trainable = total = 0
                for p in model.parameters():
                    n = p.numel()  # the full size, also of an FSDP2 DTensor shard
                    trainable, total = trainable + (n if p.requires_grad else 0), total + n
                counts = torch.tensor([trainable, total], dtype=torch.float64, device=self.accelerator.device)
                trainable, total = all_reduce_sum(counts, self.accelerator).tolist()
                self.rollback = 10 * trainable <= total
        return self.rollback

    def record(self, step: int, what: str, outcome: str, optimizer) -> dict[str, float]:
        """Count update `step` as skipped (`what` held non-finite values; `outcome` says what became of the weights)."""
        optimizer.zero_grad(set_to_none=True)
        return self.nonfinite.record(step, what, outcome, log=self.log)

    def after_optimise(self, step: int, result, snapshot: dict | None, model, optimizer, scheduler) -> dict[str, float]:
        """Roll back (or report) update `step` when a non-finite loss or gradient stopped it. An update whose steps
        went through is checked later (`settle`): its `snapshot` is kept until then."""
        if not result.skipped:
            self.unsettled = Unsettled(step, result.applied_steps, snapshot, clean=True)
            return {}
        if snapshot is not None:
            restore_optimisation(snapshot, model, optimizer, scheduler)
            outcome = "the weights and optimizer state were restored to the start of the update"
        else:
            if result.applied_steps:  # partly applied: its policy is checked like any other
                self.unsettled = Unsettled(step, result.applied_steps, None, clean=False)
            outcome = f"{result.applied_steps} optimizer step(s) of this update had already been applied"
        return self.record(step, "the loss or its gradient", outcome, optimizer)

    def settle(self, rollout, model_wrapped, model, optimizer, scheduler, args) -> dict[str, float] | None:
        """Check the policy that the last update left, with forward passes that run anyway: the next rollout's
        (`rollout`: its sampling logits, log-probs and values), or without one (before an evaluation, a save, a
        reference reset and at the end of training) one forward pass over the last rollout's sequences, once. An
        optimizer step can leave finite weights whose logits overflow on some inputs (a learning rate far too high):
        the weights alone do not tell. Finite: nothing to do (None), and a clean update ends a streak of skipped ones.
        Not finite: the update is undone from its copy, and the skip's metrics returned; without a copy training stops
        (`TrainingDiverged`, nothing saved from then on). Decided alike on every rank."""
        unsettled = self.unsettled
        if unsettled is None:
            return None
        if rollout is not None:
            finite = rollout_outputs_finite(rollout, self.accelerator)
            self.unsettled = None
            if finite and unsettled.clean:
                self.nonfinite.reset()
        else:
            if unsettled.forward_checked or self.checked_rows is None:  # checked, or resumed: the rollout will
                return None
            finite = policy_outputs_finite(model_wrapped, self.checked_rows, self.accelerator,
                                           args.rollout_forward_batch_size, args.experimental.logits_block_mb)  # fmt: skip
            unsettled.forward_checked = finite
        if finite:
            return None
        self.unsettled = None
        if unsettled.snapshot is None:
            self.nonfinite.policy_diverged(unsettled.step, unsettled.applied, args)  # raises
            return None
        restore_optimisation(unsettled.snapshot, model, optimizer, scheduler)
        return self.record(unsettled.step, f"the policy's logits or values after update {unsettled.step}",
                           "the weights and optimizer state were restored to the start of that update", optimizer)

    def weights_finite(self, model) -> bool:
        """Whether every trainable weight of `model` is finite and training was not stopped on a diverged policy
        (whose weights can be finite while its logits are not), on every rank (ZeRO-3 holds each weight's shard,
        `ds_tensor`, on one rank only: the verdict is reduced over ranks, so that every rank decides alike)."""
        if self.nonfinite.stopped:
            return False
        # this rank's shard: ZeRO-3's `ds_tensor`, FSDP2's local tensor, else the whole weight
        shards = [p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
                  for p in model.parameters() if p.requires_grad]  # fmt: skip
        bad = torch.tensor(float(not all(bool(torch.isfinite(t).all()) for t in shards)), device=self.accelerator.device)
        return all_reduce_sum(bad, self.accelerator).item() == 0

    def state_dict(self) -> dict:
        # the last update, if no rollout has checked it yet: a resumed run checks it at its first rollout too
        return {**self.nonfinite.state_dict(),
                "unsettled": None if self.unsettled is None else self.unsettled.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.nonfinite.load_state_dict(state)
        if state.get("unsettled"):  # checked at the first rollout; its undo copy was not saved
            self.unsettled = Unsettled.from_state(state["unsettled"])
