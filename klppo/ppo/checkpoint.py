"""Checkpoints: atomic saves with the KL controller's state, and resuming that says what it does.

A klppo checkpoint is Trainer's (optimizer, scheduler, RNG, `trainer_state.json`) plus the policy in Hugging
Face format, a separate critic in `value_model/` (`CriticModel.from_pretrained`), every trainable weight of the
actor-critic (`klppo_trainable.safetensors`) and the controller and monitors' state with the run's KL settings
(`kl_controller.json`). It is written into a staging folder and
renamed into place when complete, so a crash never leaves a partial `checkpoint-N`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .engines import load_full_weights

logger = logging.getLogger(__name__)

CONTROLLER_STATE_NAME = "kl_controller.json"
TRAINABLE_STATE_NAME = "klppo_trainable.safetensors"
VALUE_MODEL_DIR = "value_model"  # a separate critic, saved beside the policy
STAGING_DIR = ".checkpoint-staging"
# settings compared on resume: refused if changed / combined with the saved state / ignored for it
RESUME_REFUSED = ("kl_controller", "kl_target_unit", "kl_mode", "advantage_estimator")
RESUME_COMBINED = ("kl_target", "kl_estimator", "kl_statistic", "kl_controller_kwargs", "kl_loss_scale", "kl_guard")
RESUME_IGNORED = ("kl_coef", "learning_rate")
# what a complete klppo checkpoint holds (checked before resuming from "the latest")
CHECKPOINT_FILES = (TRAINABLE_STATE_NAME, CONTROLLER_STATE_NAME, "trainer_state.json")


class ResumeMismatch(ValueError):
    """A checkpoint's settings cannot be combined with the resuming run's."""


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete klppo checkpoint in `output_dir` (None if there is none). Incomplete folders,
    such as one an older version left behind when it crashed while saving, are skipped with a warning."""
    if not os.path.isdir(output_dir):
        return None
    found = sorted(
        (int(m.group(1)), entry)
        for entry in os.listdir(output_dir)
        if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", entry)) and os.path.isdir(os.path.join(output_dir, entry))
    )
    for _, entry in reversed(found):
        folder = os.path.join(output_dir, entry)
        missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(folder, f))]
        if not missing:
            return folder
        logger.warning("Skipping incomplete checkpoint %s (missing %s).", folder, ", ".join(missing))
    return None


class CheckpointMixin:
    """Saving and resuming for `KLPPOTrainer` (a transformers `Trainer`)."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the policy (HF format: full model or PEFT adapter), the tokenizer, and every trainable
        weight of the actor-critic (value head / critic included) for resuming."""
        output_dir = output_dir or self.args.output_dir
        self._settle_last_update()
        if not self._weights_finite():
            if self.is_world_process_zero():
                logger.warning("Not saving to %s: the trainable weights are not finite, or training stopped on a "
                               "diverged policy.", output_dir)  # fmt: skip
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        if state_dict is None:
            state_dict = unwrapped.state_dict()
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        prefix = "policy."
        policy_sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        # a PEFT policy saves its trained adapter only (not the frozen copy that serves as the reference)
        adapters = {"selected_adapters": [unwrapped.policy.active_adapter]} if hasattr(unwrapped.policy, "peft_config") else {}
        unwrapped.policy.save_pretrained(output_dir, state_dict=policy_sd, **adapters)
        if unwrapped.critic is not None:  # a separate critic, loadable on its own (`value_model=<folder>`)
            critic_sd = {k[len("critic.") :]: v for k, v in state_dict.items() if k.startswith("critic.")}
            unwrapped.critic.save_pretrained(os.path.join(output_dir, VALUE_MODEL_DIR), state_dict=critic_sd)
        trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k in trainable},
            os.path.join(output_dir, TRAINABLE_STATE_NAME),
        )
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """Write `checkpoint-N` atomically: every file (Trainer's and klppo's) goes into a staging folder that
        is renamed into place only when complete, so a crash mid-save never leaves a partial `checkpoint-N`."""
        self._settle_last_update()
        if not self._weights_finite():
            if self.is_world_process_zero():
                logger.warning(
                    "Not writing checkpoint %d: the trainable weights are not finite, or training stopped on a "
                    "diverged policy; the last checkpoint is kept.",
                    self.state.global_step,
                )
            return
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR)
        staged = os.path.join(staging_root, name)
        if self.args.should_save and os.path.isdir(staged):
            shutil.rmtree(staged)  # left by a save that was interrupted
        self._get_output_dir = lambda trial=None: staging_root  # Trainer writes (and rotates) inside staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        if self.args.should_save:
            with open(os.path.join(staged, CONTROLLER_STATE_NAME), "w") as f:
                json.dump(self._klppo_state(), f, indent=2)
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are in place
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            shutil.rmtree(staging_root, ignore_errors=True)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _weights_finite(self) -> bool:
        """Whether every trainable weight is finite and training was not stopped on a diverged policy (whose
        weights can be finite while its logits are not), on every rank (ZeRO-3 holds each weight's shard,
        `ds_tensor`, on one rank only: the verdict is reduced over ranks, so that every rank decides alike)."""
        from ..kl.reduce import all_reduce_sum

        if self.nonfinite_guard.stopped:
            return False
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        # this rank's shard: ZeRO-3's `ds_tensor`, FSDP2's local tensor, else the whole weight
        shards = [p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
                  for p in unwrapped.parameters() if p.requires_grad]  # fmt: skip
        bad = torch.tensor(float(not all(bool(torch.isfinite(t).all()) for t in shards)), device=self.accelerator.device)
        return all_reduce_sum(bad, self.accelerator).item() == 0

    def _klppo_state(self) -> dict:
        return {
            "kl_controller": self.kl_controller.state_dict(),
            "drift_monitor": self.drift_monitor.state_dict() if self.drift_monitor is not None else None,
            "health_monitor": self.health_monitor.state_dict(),
            **self.kl_guard.state_dict(),
            **self.nonfinite_guard.state_dict(),
            "settings": {name: getattr(self.args, name) for name in RESUME_REFUSED + RESUME_COMBINED + RESUME_IGNORED},
        }

    def _check_resume_settings(self, saved: dict | None) -> None:
        """Compare the checkpoint's KL and optimisation settings with this run's: refuse what cannot be combined,
        warn (naming each field and both values) about what is combined or ignored."""
        if not saved:
            return
        if "kl_statistic" not in saved and "kl_estimator" in saved:  # written before kl_statistic: it read the estimator
            saved = {**saved, "kl_statistic": saved["kl_estimator"]}
        changed = {
            k: (v, getattr(self.args, k)) for k, v in saved.items() if hasattr(self.args, k) and v != getattr(self.args, k)
        }
        refused = {k: v for k, v in changed.items() if k in RESUME_REFUSED}
        if refused:
            listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in refused.items())
            raise ResumeMismatch(
                f"Cannot resume with changed settings ({listed}): the checkpoint's controller state and KL statistic "
                "were built for the old ones. Resume with the checkpoint's values, or start a new run."
            )
        for key, (old, new) in changed.items():
            if key in RESUME_COMBINED:
                how = "the new value is used with the checkpoint's coefficient and controller state"
            else:
                how = "ignored: the checkpoint's saved state (coefficient, optimizer, scheduler) decides"
            if self.is_world_process_zero():
                logger.warning("Resuming with %s changed from %r to %r: %s.", key, old, new, how)

    def _checkpoint_to_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The folder `resume_from_checkpoint` names: a path, or the latest complete checkpoint for True (or
        "true", from a command line); None to start afresh."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self.latest_checkpoint()
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No complete checkpoint found in {self.args.output_dir} to resume from. Start without "
                    "--resume_from_checkpoint, or pass the path of a checkpoint folder."
                )
        return resume_from_checkpoint or None

    def latest_checkpoint(self) -> str | None:
        """The newest complete klppo checkpoint in `output_dir`, or None (see `latest_checkpoint`)."""
        return latest_checkpoint(self.args.output_dir)

    def _resume(self, checkpoint: str) -> None:
        """Restore weights, optimizer, scheduler, trainer state, RNG and the KL controller."""
        from safetensors.torch import load_file
        from transformers.trainer_callback import TrainerState

        path = os.path.join(checkpoint, TRAINABLE_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"{checkpoint} is not a klppo checkpoint ({TRAINABLE_STATE_NAME} is missing).")
        with open(os.path.join(checkpoint, CONTROLLER_STATE_NAME)) as f:
            state = json.load(f)
        self._check_resume_settings(state.get("settings"))  # before anything is loaded
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        missing = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
        weights = load_file(path, device="cpu")
        missing -= set(weights)
        if missing:
            raise ValueError(f"Checkpoint {checkpoint} lacks trainable weights: {sorted(missing)[:5]}...")
        if self.is_deepspeed_enabled:  # the engine's own checkpoint: sharded weights and optimizer state, exactly
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, checkpoint, load_module_strict=False)
        else:
            load_full_weights(unwrapped, weights)
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_rng_state(checkpoint)
        max_steps = self.state.max_steps
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max_steps)
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.drift_monitor is not None and state.get("drift_monitor"):
            self.drift_monitor.load_state_dict(state["drift_monitor"])
        self.health_monitor.load_state_dict(state.get("health_monitor") or {})
        self.kl_guard.load_state_dict(state)
        self.nonfinite_guard.load_state_dict(state)
        logger.info(
            "Resumed from %s at update %d with KL coefficient %.6g",
            checkpoint,
            self.state.global_step,
            self.kl_controller.value,
        )
