"""Non-finite values (NaN, inf) across updates.

- `NonfiniteSkips` counts the updates skipped for them and ends training (`TrainingDiverged`) after too many in a row;
- `UpdateSafety` undoes a skipped update from its copy (`rollback.py`) where updates are rolled back, and keeps an
  update whose steps went through unsettled until forward passes that run anyway find its policy finite
  (`rollout_outputs_finite`, `policy_outputs_finite`): finite weights can still give logits that overflow.

Inside an update, a non-finite loss stops the optimizer step (`step_checks.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...kl.reduce import all_reduce_sum
from .rollback import restore_optimisation

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Training stopped on non-finite values; the message says what diverged and how to fix the run."""


@torch.no_grad()
def policy_outputs_finite(model, sequences, accelerator, chunk: int, logits_block_mb: float = 64.0) -> bool:
    """Whether the actor-critic `model` gives finite logits and values on `sequences` (a `Sequences` of this rank,
    in forward passes of `chunk` rows, the LM head read in blocks of `logits_block_mb`), on every rank. An optimizer step can leave finite weights whose logits
    overflow on some inputs (a learning rate far too high): the weights alone do not tell. Every rank runs the
    forward passes (sharded models need all of them) and the verdicts are summed, so all ranks answer the same."""
    from ..scoring.logprobs import position_ids_from_mask, read_response

    bad = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    for start in range(0, sequences.batch_size, chunk):
        part = sequences.select(slice(start, start + chunk))
        reads, values = model(
            part.query_responses,
            attention_mask=part.attention_mask,
            position_ids=position_ids_from_mask(part.attention_mask),
            response_length=part.responses.shape[1],
            read=lambda source: read_response(source, part.responses, 1.0, None, logits_block_mb, finite=True),
        )
        bad += (~reads["finite"]).sum()
        if values is not None:
            bad += (~torch.isfinite(values)).sum()
    return all_reduce_sum(bad, accelerator).item() == 0


@torch.no_grad()
def rollout_outputs_finite(rollout, accelerator) -> bool:
    """Whether the policy gave finite outputs while a rollout was sampled and scored: its sampling logits
    (`rollout.sampled_finite`), the response tokens' log-probs and the critic's values, on every rank."""
    mask = rollout.response_mask.bool()
    bad = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    bad += float(not rollout.sampled_finite)
    for x in (rollout.logp, rollout.values):
        bad += (~torch.isfinite(x[mask])).sum()
    return all_reduce_sum(bad, accelerator).item() == 0


class NonfiniteSkips:
    """Counts updates skipped for NaN/inf and stops training after `max_in_a_row` of them in a row.

    `record(step, what, outcome)` logs one skipped update (`what` held non-finite values, `outcome` says what
    happened to the weights) and raises `TrainingDiverged` once too many follow each other; `reset()` after a
    clean update; `stop(message)` ends training at once. `stopped` tells that it ended training: the
    weights are then not to be saved.
    """

    def __init__(self, max_in_a_row: int = 3):
        self.max_in_a_row = int(max_in_a_row)
        self.skips = 0
        self.consecutive = 0
        self.stopped = False

    def record(self, step: int, what: str, outcome: str, log: bool = True) -> dict[str, float]:
        self.skips += 1
        self.consecutive += 1
        if log:
            logger.warning(
                "Skipped PPO update %d: non-finite values in %s (%d skipped so far); %s.",
                step,
                what,
                self.skips,
                outcome,
            )
        if self.consecutive >= self.max_in_a_row:
            self.stop(
                f"{self.consecutive} PPO updates in a row had non-finite values in {what}; training "
                "stopped (checkpoints already written are intact). Lower the learning rate, set "
                "`kl_value_clamp`, check the reward functions for NaN/inf, or use bf16/fp32 instead of fp16."
            )
        return {"train/skipped_update": 1.0}

    def stop(self, message: str) -> None:
        """End training with `message` (raises `TrainingDiverged`)."""
        self.stopped = True
        raise TrainingDiverged(message)

    def policy_diverged(self, step: int, applied_steps: int, args) -> None:
        """End training: update `step`'s `applied_steps` optimizer steps left a policy with non-finite logits
        (or critic values) and no copy to undo them; the message names the fixes in `args` (a `KLPPOConfig`)."""
        self.stop(
            f"The policy diverged at PPO update {step}: after {applied_steps} optimizer step(s) its logits (or the "
            "critic's values) are not finite. Training stopped; no checkpoint holds these weights (those written "
            f"before are intact). Lower learning_rate (now {args.learning_rate:g}) or max_grad_norm (now "
            f"{args.max_grad_norm}), or set nonfinite_rollback: true to undo such an update and go on."
        )

    def reset(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"nonfinite_skips": self.skips, "consecutive_nonfinite": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skips = state.get("nonfinite_skips", 0)
        self.consecutive = state.get("consecutive_nonfinite", 0)


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
        return {
            "step": self.step,
            "applied": self.applied,
            "clean": self.clean,
            "forward_checked": self.forward_checked,
        }

    @classmethod
    def from_state(cls, state: dict) -> "Unsettled":
        return cls(
            int(state["step"]), int(state["applied"]), None, bool(state["clean"]), bool(state["forward_checked"])
        )


class UpdateSafety:
    """Non-finite values across updates: a skipped update is counted (`NonfiniteSkips`), undone from its copy when
    updates are rolled back (`rollback`), and an update whose steps went through stays unsettled until forward
    passes that run anyway (the next rollout's, or one over the last rollout before a save) find its policy finite.

    Args:
        nonfinite: the run's `NonfiniteSkips` (`max_nonfinite_updates`).
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
            finite = policy_outputs_finite(
                model_wrapped,
                self.checked_rows,
                self.accelerator,
                args.rollout_forward_batch_size,
                args.experimental.logits_block_mb,
            )
            unsettled.forward_checked = finite
        if finite:
            return None
        self.unsettled = None
        if unsettled.snapshot is None:
            self.nonfinite.policy_diverged(unsettled.step, unsettled.applied, args)  # raises
            return None
        restore_optimisation(unsettled.snapshot, model, optimizer, scheduler)
        return self.record(
            unsettled.step,
            f"the policy's logits or values after update {unsettled.step}",
            "the weights and optimizer state were restored to the start of that update",
            optimizer,
        )

    def weights_finite(self, model) -> bool:
        """Whether every trainable weight of `model` is finite and training was not stopped on a diverged policy
        (whose weights can be finite while its logits are not), on every rank (ZeRO-3 holds each weight's shard,
        `ds_tensor`, on one rank only: the verdict is reduced over ranks, so that every rank decides alike)."""
        if self.nonfinite.stopped:
            return False
        # this rank's shard: ZeRO-3's `ds_tensor`, FSDP2's local tensor, else the whole weight
        shards = [
            p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
            for p in model.parameters()
            if p.requires_grad
        ]
        bad = torch.tensor(
            float(not all(bool(torch.isfinite(t).all()) for t in shards)), device=self.accelerator.device
        )
        return all_reduce_sum(bad, self.accelerator).item() == 0

    def state_dict(self) -> dict:
        # the last update, if no rollout has checked it yet: a resumed run checks it at its first rollout too
        return {
            **self.nonfinite.state_dict(),
            "unsettled": None if self.unsettled is None else self.unsettled.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.nonfinite.load_state_dict(state)
        if state.get("unsettled"):  # checked at the first rollout; its undo copy was not saved
            self.unsettled = Unsettled.from_state(state["unsettled"])
