"""klppo's KL controllers inside TRL's own `GRPOTrainer` and `RLOOTrainer`.

```python
from trl import GRPOConfig, GRPOTrainer
from klppo.integrations.trl import add_kl_control

trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(beta=0.5, ...), train_dataset=...)
add_kl_control(trainer, kl_target=0.03, kl_target_unit="token")  # beta set to hold the KL near 0.03 nats/token
trainer.train()                                 # or trainer.train(resume_from_checkpoint=True)
```

`add_kl_control` registers one `TrainerCallback` (`KLControlCallback`) and returns the trainer. beta starts from
the trainer's own `beta`. After each optimizer step the callback reads the KL that TRL has just computed (the
values TRL logs as `kl`), feeds it to the controller and sets `trainer.beta` to the controller's new value; it logs
`kl/coef` (the beta in force during the step), and `kl/value` and `kl/target` on the steps that brought a reading,
through TRL's own metric buffer, so they are averaged and logged with TRL's metrics. Its state goes into every
checkpoint (`checkpoint-N/kl_controller.json`) and comes back with `trainer.train(resume_from_checkpoint=...)`.

With a `kl_target`, the default controller is the equilibrium one, as in `KLPPOConfig`: from each generation batch
(`SequenceReader`: every completion's score, log-ratio to the reference and length) it estimates the beta whose
optimum has the target KL. RLOO puts `k1` in the reward, so that optimum is the tilt `ref * exp(r / beta) / Z`.
GRPO puts `k3` in the loss, whose optimum is the forward-KL one `beta * ref / (lam - r)`, and divides each group's
rewards by their spread: its loss follows the policy gradient of `E[Delta * r]`, `Delta` the advantage's mean rise
per unit of reward (`advantage_slope`), so the reader hands the controller `Delta * r` as the score. The measured
fixed points are in `docs/kl.md` ("TRL's trainers").

What the statistic is (TRL 1.16):

- `GRPOTrainer` puts the KL in the loss: per token, `k3 = exp(ref - logp) - (ref - logp) - 1` at the policy being
  trained, times `pi / pi_old` with `use_bias_correction_kl`. TRL logs its token mean over each micro-batch, with
  the sum and the count reduced over all processes (`accelerator.reduce`, a global token mean); the statistic is
  the mean of those micro-batch values over the optimizer step. Its expectation is KL(pi || ref) per token
  (on-policy), though its gradient is that of the forward KL (see klppo's estimator table). The controller is
  updated after every optimizer step.
- `RLOOTrainer` puts `k1 = logp_old - ref` in the reward, summed over each completion, when it generates. TRL logs
  its global token mean over the generation batch (sum and count reduced over all processes); the controller is
  updated once per generation batch, after the optimizer step that generated it, and the new beta enters the next
  generation's rewards (with `steps_per_generation * num_iterations > 1`, the steps in between keep theirs).

Units (`kl_target_unit`, as in `KLPPOConfig`): `"token"` is the statistic above, nats per token. `"sequence"`
multiplies it by TRL's global mean completion length of the same generation batch (`completions/mean_length`):
for RLOO this is exactly the mean summed k1 per completion that the reward is charged; for GRPO it is exact when
the step's micro-batches hold the whole generation batch with equal token counts, and close otherwise. Every
process reads the same global value, so every process sets the same beta.

This relies on TRL's internals in two places: the metric buffer (`trainer._metrics["train"]`), where TRL keeps the KL
it logs, which `add_kl_control` checks is there; and, for the equilibrium controller, three methods of the trainer
that `SequenceReader` wraps (they compute the log-probs and rewards TRL scores a batch with; TRL's subclasses
override the same methods). If a TRL version computes them elsewhere, the reader warns once and the equilibrium
controller keeps beta where it is.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.models.utils import disable_gradient_checkpointing

from ..kl import build_kl_controller
from ..kl.config import KLControlConfig
from ..ppo.advantages import advantage_slope
from ..ppo.config import warn_once
from ..ppo.run.checkpoint import CONTROLLER_STATE_NAME, latest_checkpoint  # the same file as klppo's own checkpoints

logger = logging.getLogger(__name__)

TRAINER_KINDS = {"GRPOTrainer": ("loss", "k3"), "RLOOTrainer": ("reward", "k1")}  # where TRL puts the KL, and how
# KLPPOConfig fields that are not the controller's: set by the TRL trainer itself, or about klppo's own trainer
_NOT_CONTROLLER_FIELDS = {
    "kl_coef": "beta starts from the trainer's own `beta` (set it in GRPOConfig / RLOOConfig)",
    "kl_mode": "TRL decides where the KL acts (GRPO: the loss; RLOO: the reward)",
    "kl_estimator": "TRL decides the estimator (GRPO: k3; RLOO: k1)",
    "kl_statistic": "the statistic is the KL that TRL computes and logs",
    "kl_value_clamp": "TRL computes the KL itself",
    "kl_loss_agg_mode": "TRL aggregates its own loss",
}


def controller_fields() -> tuple[str, ...]:
    """The `KLControlConfig` fields `add_kl_control` accepts: the controller's name, its constants
    (`kl_controller_kwargs`), the target and its unit."""
    return ("kl_controller", "kl_controller_kwargs", "kl_target", "kl_target_unit")


def _kind(trainer) -> str:
    for cls in type(trainer).__mro__:
        if cls.__name__ in TRAINER_KINDS and cls.__module__.startswith("trl."):
            return cls.__name__
    raise TypeError(
        f"add_kl_control works with TRL's GRPOTrainer and RLOOTrainer (or subclasses of them), got "
        f"{type(trainer).__name__}. klppo's own KLPPOTrainer takes the same fields in its KLPPOConfig."
    )


@dataclass
class TRLKLControl(KLControlConfig):
    """The KL settings of a TRL trainer under `add_kl_control`: TRL decides where the KL acts and how it is
    estimated; the callback reads TRL's logged KL and each generation batch's sequences (`SequenceReader`).
    `objective_unknown`: why the trainer's settings leave the optimum of its KL term unknown ("" where it is known)."""

    objective_unknown: str = field(default="", repr=False)

    def _loss_weight(self) -> tuple[float | None, str]:
        # TRL adds beta * KL to the per-token policy loss before aggregating, so both weigh alike whatever its loss_type
        return (None, self.objective_unknown) if self.objective_unknown else (1.0, "")


def _objective_unknown(trainer, kind: str) -> str:
    """Why a GRPO trainer's settings make the optimum the equilibrium controller solves for unknown, or ""."""
    if kind != "GRPOTrainer":
        return ""
    args, why = trainer.args, []
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        why.append(
            f"top_entropy_quantile={args.top_entropy_quantile} masks the policy term, not the KL, on some tokens"
        )
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        why.append("off_policy_mask_threshold masks the policy term, not the KL, on some sequences")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        why.append("an entropy bonus (entropy_coef) adds a term to the objective")
    if (
        getattr(trainer, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize"
        and len(trainer.reward_funcs) > 1
    ):
        why.append("multi_objective_aggregation='normalize_then_sum' normalises each reward function by its own spread")
    return "; ".join(why)


class SequenceReader:
    """Each generation batch's completions as TRL scored them, for a controller that reads the batch
    (`observe_sequences`): per completion, the score the policy gradient follows, `log pi(y) - log ref(y)` summed over
    its tokens, and its length, gathered over all processes.

    It wraps three of the trainer's methods on the instance, without changing what they return:
    `_generate_and_score_completions` (to know a batch is being scored), `_get_per_token_logps_and_entropies` (the
    sampling policy's and the reference's log-probs TRL computes there; TRL computes the reference's last) and
    `_calculate_rewards` (the rewards of all processes). The score is the reward (weighted, clipped as TRL does):
    RLOO's objective is the tilt for it; for GRPO it is multiplied by the batch's advantage slope
    (`klppo.ppo.advantages.advantage_slope`), as GRPO's loss follows the reward `Delta * r` (`docs/kl.md`, "GRPO's
    group normalisation"). GRPO computes the policy's log-probs there only off-policy; on-policy, the reader runs the
    reference's forward again on the policy (one extra forward pass per generation batch, no gradient). Several
    generation batches in one optimizer step are read together."""

    def __init__(self, trainer, kind: str):
        self.trainer, self.kind = trainer, kind
        self.batch = None  # (scores, log_ratios, lengths) of the last generation batch, until the controller reads it
        self._calls = None  # per-token log-probs computed while a batch is scored: [(args, kwargs, logps)]
        self._rewards = None
        self._logps = self._wrap("_get_per_token_logps_and_entropies", self._record_logps)
        self._wrap("_generate_and_score_completions", self._score)
        self._wrap("_calculate_rewards", self._record_rewards)

    def _wrap(self, name: str, wrapper):
        original = getattr(self.trainer, name)

        @functools.wraps(original)
        def method(*args, **kwargs):
            return wrapper(original, *args, **kwargs)

        setattr(self.trainer, name, method)
        return original

    def _record_logps(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        if self._calls is not None:
            self._calls.append((args, kwargs, out[0].detach()))
        return out

    def _record_rewards(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        if self._calls is not None:
            self._rewards = out.detach()
        return out

    def _score(self, original, *args, **kwargs):
        if not self.trainer.model.training:  # an evaluation batch: TRL scores it, the controller does not read it
            return original(*args, **kwargs)
        self._calls, self._rewards = [], None
        try:
            output = original(*args, **kwargs)
            calls = self._calls
        finally:
            self._calls = None
        table = self._table(output, calls)
        if table is not None and self.batch is not None:  # several generation batches before the controller reads
            table = tuple(torch.cat([a, b]) for a, b in zip(self.batch, table))
        self.batch = table
        return output

    @torch.no_grad()
    def _table(self, output: dict, calls: list):
        mask = output["completion_mask"]
        ref = calls[-1][2] if calls else None
        if self.kind == "RLOOTrainer":
            policy = calls[0][2] if len(calls) >= 2 else None
        else:
            policy = output.get("old_per_token_logps")
            if policy is None and ref is not None:  # on-policy: the reference's forward again, on the policy
                args, kwargs, _ = calls[-1]
                model = self.trainer.model
                with disable_gradient_checkpointing(model, self.trainer.args.gradient_checkpointing_kwargs):
                    policy = self._logps(model, *args[1:], **kwargs)[0]
        rewards = self._rewards
        if ref is None or policy is None or rewards is None or policy.shape != mask.shape or ref.shape != mask.shape:
            warn_once(
                "add_kl_control reader",
                f"add_kl_control found no rewards or no sampling and reference log-probs in {self.kind}'s scoring of "
                "a batch (this TRL version computes them elsewhere): the controller is fed the KL alone, so the "
                "equilibrium controller keeps beta where it is. Use kl_controller='tracking'.",
            )
            return None
        if "tool_mask" in output:  # tool results are not the policy's tokens: TRL leaves them out of its loss
            mask = mask * output["tool_mask"]
        mask = mask.to(torch.float64)
        local = torch.stack([((policy.double() - ref.double()) * mask).sum(1), mask.sum(1)], dim=1)
        scores = (rewards * self.trainer.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        clip = getattr(self.trainer, "reward_clip_range", None)
        if clip:
            scores = scores.clamp(min=clip[0], max=clip[1])
        scores[torch.isnan(rewards).all(dim=1)] = torch.nan  # no reward function scored it: left out
        if self.kind == "GRPOTrainer":
            advantages = self.trainer.accelerator.gather(output["advantages"].detach())
            scores = scores * advantage_slope(advantages, scores, self.trainer.num_generations)
        table = self.trainer.accelerator.gather(local).cpu()
        scores = scores.to(torch.float64).cpu()
        keep = torch.isfinite(scores)
        return scores[keep], table[keep, 0], table[keep, 1]


def resolve_kl_fields(trainer, kl_fields: dict) -> TRLKLControl:
    """The controller settings, checked by `KLControlConfig` (the same choices, bounds and messages as in
    `KLPPOConfig`), with `kl_coef` the trainer's `beta` and TRL's own place and estimator of the KL."""
    kind = _kind(trainer)
    allowed = controller_fields()
    for name in kl_fields:
        if name in _NOT_CONTROLLER_FIELDS:
            raise ValueError(f"add_kl_control does not take `{name}`: {_NOT_CONTROLLER_FIELDS[name]}.")
        if name not in allowed:
            raise ValueError(f"add_kl_control does not take `{name}`; its fields are: {', '.join(allowed)}.")
    mode, estimator = TRAINER_KINDS[kind]
    if kind == "GRPOTrainer" and getattr(trainer.args, "use_bias_correction_kl", False):
        estimator = "corrected_k3"
    unknown = _objective_unknown(trainer, kind)
    settings = TRLKLControl(
        kl_mode=mode, kl_estimator=estimator, kl_coef=float(trainer.beta), objective_unknown=unknown, **kl_fields
    )
    if unknown and "kl_controller" not in kl_fields and settings.kl_target is not None:
        logger.warning(
            "add_kl_control: the tracking controller holds kl_target, as the equilibrium controller does "
            "not apply here: %s.",
            unknown,
        )
    return settings


class KLControlCallback(TrainerCallback):
    """Sets `trainer.beta` after each optimizer step from a klppo controller fed with TRL's own KL (see
    `klppo.integrations.trl`); saves and restores the controller with the trainer's checkpoints."""

    def __init__(self, trainer, settings):
        self.trainer = trainer
        self.settings = settings
        self.kind = _kind(trainer)
        self.controller = build_kl_controller(settings)
        self.reader = SequenceReader(trainer, self.kind) if self.controller.reads_sequences else None
        self.resume_from: str | None = None
        self._buffer, self._seen = None, 0  # TRL's "kl" list and how many of its values have been read
        self._mean_length: float | None = None

    # -- reading TRL's KL ---------------------------------------------------------------------
    def _new_readings(self) -> list[float]:
        """The `kl` values TRL has appended since the last call. TRL clears its metric dict after each log, and a
        fresh list then takes the old one's place."""
        metrics = self.trainer._metrics["train"]
        buffer = metrics.get("kl", [])
        start = self._seen if buffer is self._buffer and len(buffer) >= self._seen else 0
        self._buffer, self._seen = buffer, len(buffer)
        lengths = metrics.get("completions/mean_length")
        if lengths:
            self._mean_length = float(lengths[-1])
        return [float(v) for v in buffer[start:] if v is not None and math.isfinite(v)]

    def _sequences_read(self, args, state) -> int:
        """Completions (all processes) behind one reading: an optimizer step's (GRPO), a generation batch (RLOO)."""
        world = max(1, getattr(args, "world_size", 1))
        if self.kind == "RLOOTrainer" and getattr(args, "generation_batch_size", None):
            return int(args.generation_batch_size)
        return int(args.per_device_train_batch_size * args.gradient_accumulation_steps * world)

    def on_step_end(self, args, state, control, **kwargs):
        coef = self.controller.value
        metrics = self.trainer._metrics["train"]
        readings = self._new_readings()
        if readings:
            value = sum(readings) / len(readings)
            if self.settings.kl_target_unit == "sequence":
                value = value * self._mean_length if self._mean_length is not None else math.nan
            if self.reader is not None and self.reader.batch is not None:  # once per generation batch
                self.controller.observe_sequences(*self.reader.batch, unit=self.settings.kl_target_unit)
                self.reader.batch = None
            self.controller.update(value, n_steps=self._sequences_read(args, state))
            self.trainer.beta = self.controller.value
            metrics["kl/value"].append(value)
            for name, number in getattr(self.controller, "metrics", dict)().items():
                metrics[name].append(number)
            if self.settings.kl_target is not None:
                metrics["kl/target"].append(float(self.settings.kl_target))
        metrics["kl/coef"].append(coef)
        return control

    # -- checkpoints ----------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            payload = {
                "kl_controller": self.controller.state_dict(),
                "trainer": self.kind,
                "kl_target_unit": self.settings.kl_target_unit,
                "mean_length": self._mean_length,
            }
            with open(os.path.join(folder, CONTROLLER_STATE_NAME), "w") as f:
                json.dump(payload, f, indent=1)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        folder = self.resume_from
        if folder is None and state.global_step > 0:  # resumed without going through the wrapped `train`
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if folder is not None:
            self.load(folder)
        self.trainer.beta = self.controller.value
        return control

    def load(self, folder: str) -> None:
        path = os.path.join(folder, CONTROLLER_STATE_NAME)
        if not os.path.isfile(path):
            logger.warning(
                "Resuming from %s, which holds no %s (written by add_kl_control): the KL controller starts afresh "
                "from beta=%g.",
                folder,
                CONTROLLER_STATE_NAME,
                self.controller.value,
            )
            return
        with open(path) as f:
            payload = json.load(f)
        if payload.get("kl_target_unit", self.settings.kl_target_unit) != self.settings.kl_target_unit:
            raise ValueError(
                f"The checkpoint's KL controller read the KL per {payload['kl_target_unit']}, this run per "
                f"{self.settings.kl_target_unit}: its state does not carry over. Resume with kl_target_unit="
                f"{payload['kl_target_unit']!r}, or start a new run."
            )
        self.controller.load_state_dict(payload["kl_controller"])
        self._mean_length = payload.get("mean_length")
        logger.info(
            "KL controller restored from %s: beta=%g after %d updates.",
            path,
            self.controller.value,
            self.controller.n_updates,
        )


def add_kl_control(trainer, **kl_fields):
    """Let a klppo controller set the KL coefficient beta of TRL's `GRPOTrainer` or `RLOOTrainer`.

    Args:
        trainer: a `trl.GRPOTrainer` or `trl.RLOOTrainer` (or a subclass) whose `beta` is > 0.
        **kl_fields: `KLControlConfig`'s controller fields (`KLPPOConfig` has them too), with the same meaning and
            checks: `kl_controller`
            (`None`: `"equilibrium"` with a `kl_target`, else `"fixed"`), `kl_target`, `kl_target_unit` (`"sequence"`,
            the default, or `"token"`: TRL's own `kl`) and `kl_controller_kwargs` (the controller's constants)
            (`klppo.integrations.trl.controller_fields()`). beta starts from `trainer.beta`.

    Returns:
        The trainer, with a `KLControlCallback` registered (`trainer.kl_control`); its `train` records the
        checkpoint it resumes from, so that the controller continues from the state saved there.

    The statistic the controller reads, for each trainer, is described in this module's docstring.
    """
    kind = _kind(trainer)
    if not getattr(trainer, "beta", 0.0):
        raise ValueError(
            f"{kind} was built with beta={getattr(trainer, 'beta', None)!r}. With beta 0, TRL loads no reference "
            "model and computes no KL, so there is nothing to control and no coefficient to adapt. Set a positive "
            f"beta in the {kind[:-7]}Config (e.g. beta=0.04): it is where the controller starts, and the "
            "reference model is then loaded."
        )
    if not hasattr(trainer, "_metrics") or "train" not in trainer._metrics:
        raise TypeError(
            f"This {kind} keeps no metric buffer (`_metrics['train']`) to read its KL from: add_kl_control was "
            "written against TRL 1.16's GRPOTrainer and RLOOTrainer."
        )
    if getattr(trainer, "kl_control", None) is not None:
        raise ValueError("add_kl_control was already applied to this trainer.")
    settings = resolve_kl_fields(trainer, kl_fields)
    callback = KLControlCallback(trainer, settings)
    trainer.add_callback(callback)
    trainer.kl_control = callback
    train = trainer.train

    def train_with_kl_control(resume_from_checkpoint=None, *args, **kwargs):
        folder = resume_from_checkpoint
        if isinstance(folder, str) and folder.lower() in ("true", "false"):
            folder = folder.lower() == "true"
        if folder is True:
            folder = latest_checkpoint(trainer.args.output_dir, required=())
        callback.resume_from = folder or None
        return train(resume_from_checkpoint, *args, **kwargs)

    train_with_kl_control.__doc__ = train.__doc__
    trainer.train = train_with_kl_control
    logger.info(
        "KL control on %s: controller %s, beta from %g, target %s per %s (TRL's %s in the %s).",
        kind,
        settings.kl_controller,
        trainer.beta,
        settings.kl_target,
        settings.kl_target_unit,
        settings.kl_estimator,
        settings.kl_mode,
    )
    return trainer
