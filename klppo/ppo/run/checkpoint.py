"""Checkpoint files: what klppo writes beside Trainer's, and what resuming reads back.

A klppo checkpoint is Trainer's (optimizer, scheduler, RNG, `trainer_state.json`) plus the policy in Hugging Face
format, a separate critic in `value_model/` (`CriticModel.from_pretrained`), every trainable weight of the
actor-critic (`klppo_trainable.safetensors`) and the state of the KL controller and the monitors with the run's KL
settings (`kl_controller.json`). `staged` writes it into a staging folder and renames it into place when complete,
so a crash never leaves a partial `checkpoint-N`.

Every function takes what it reads as arguments; the trainer's `_save`, `_save_checkpoint` and `_resume` call them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ...utils import write_json

logger = logging.getLogger(__name__)

CONTROLLER_STATE_NAME = "kl_controller.json"
TRAINABLE_STATE_NAME = "klppo_trainable.safetensors"
REFERENCE_NAME = "klppo_reference.safetensors"  # after a reference reset: the reference's tensors now and at first
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


def latest_checkpoint(output_dir: str, required: tuple[str, ...] = CHECKPOINT_FILES) -> str | None:
    """The newest complete checkpoint in `output_dir` (None if there is none): the highest-numbered
    `checkpoint-N` folder holding every file of `required` (klppo's own checkpoint files by default; a TRL trainer's
    checkpoints, which `add_kl_control` reads, need none of them). Incomplete folders, such as one an older version
    left behind when it crashed while saving, are skipped with a warning (transformers' `get_last_checkpoint` takes
    the highest number whatever the folder holds)."""
    if not os.path.isdir(output_dir):
        return None
    found = sorted(
        (int(m.group(1)), entry)
        for entry in os.listdir(output_dir)
        if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", entry))
        and os.path.isdir(os.path.join(output_dir, entry))
    )
    for _, entry in reversed(found):
        folder = os.path.join(output_dir, entry)
        missing = [f for f in required if not os.path.isfile(os.path.join(folder, f))]
        if not missing:
            return folder
        logger.warning("Skipping incomplete checkpoint %s (missing %s).", folder, ", ".join(missing))
    return None


def resolve_resume_target(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The folder `resume_from_checkpoint` names: a path, or the latest complete checkpoint of `output_dir` for True
    (or "true", from a command line); None to start afresh."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
        resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
    if resume_from_checkpoint is True:
        resume_from_checkpoint = latest_checkpoint(output_dir)
        if resume_from_checkpoint is None:
            raise ValueError(
                f"No complete checkpoint found in {output_dir} to resume from. Start without "
                "--resume_from_checkpoint, or pass the path of a checkpoint folder."
            )
    return resume_from_checkpoint or None


def save_model_files(output_dir: str, actor_critic, state_dict: dict, tokenizer, args, merged: bool = False) -> None:
    """The policy in Hugging Face format (the full model, or a PEFT policy's trained adapter only: not the frozen
    copy that serves as the reference; with `merged`, a PEFT policy with its adapter merged, whole), a separate
    critic in `value_model/`, every trainable weight of the actor-critic for resuming, the tokenizer and
    `training_args.bin`."""
    import copy

    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    if merged:
        copy.deepcopy(actor_critic.policy).merge_and_unload().save_pretrained(output_dir)
    else:
        policy_sd = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")}
        peft = hasattr(actor_critic.policy, "peft_config")
        adapters = {"selected_adapters": [actor_critic.policy.active_adapter]} if peft else {}
        actor_critic.policy.save_pretrained(output_dir, state_dict=policy_sd, **adapters)
    if actor_critic.critic is not None:  # loadable on its own (`value_model=<folder>`)
        critic_sd = {k[len("critic.") :]: v for k, v in state_dict.items() if k.startswith("critic.")}
        actor_critic.critic.save_pretrained(os.path.join(output_dir, VALUE_MODEL_DIR), state_dict=critic_sd)
    trainable = {n for n, p in actor_critic.named_parameters() if p.requires_grad}
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k in trainable},
        os.path.join(output_dir, TRAINABLE_STATE_NAME),
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, "training_args.bin"))


def _setting(args, name: str):
    """A field of the config, or one of its experimental settings (checkpoints record both under their own names)."""
    experimental = getattr(args, "experimental", None)
    return getattr(experimental, name) if hasattr(experimental, name) else getattr(args, name)


def resume_settings(args) -> dict:
    """The settings a checkpoint records, to compare with a resuming run's."""
    return {name: _setting(args, name) for name in RESUME_REFUSED + RESUME_COMBINED + RESUME_IGNORED}


def write_controller_state(folder: str, state: dict) -> None:
    write_json(os.path.join(folder, CONTROLLER_STATE_NAME), state)


def read_controller_state(checkpoint: str) -> dict:
    if not os.path.isfile(os.path.join(checkpoint, TRAINABLE_STATE_NAME)):
        raise ValueError(f"{checkpoint} is not a klppo checkpoint ({TRAINABLE_STATE_NAME} is missing).")
    with open(os.path.join(checkpoint, CONTROLLER_STATE_NAME)) as f:
        return json.load(f)


def check_resume_settings(saved: dict | None, args, log: bool = True) -> None:
    """Compare the checkpoint's KL and optimisation settings with `args`: refuse what cannot be combined, warn
    (naming each field and both values) about what is combined or ignored."""
    if not saved:
        return
    if "kl_statistic" not in saved and "kl_estimator" in saved:  # written before kl_statistic: it read the estimator
        saved = {**saved, "kl_statistic": saved["kl_estimator"]}
    now = resume_settings(args)
    changed = {k: (v, now[k]) for k, v in saved.items() if k in now and v != now[k]}
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
        if log:
            logger.warning("Resuming with %s changed from %r to %r: %s.", key, old, new, how)


def load_trainable_weights(checkpoint: str, actor_critic) -> dict:
    """Every trainable weight of `actor_critic` from the checkpoint (whole tensors, on the CPU); a missing one is an
    error that names it."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(checkpoint, TRAINABLE_STATE_NAME), device="cpu")
    missing = {n for n, p in actor_critic.named_parameters() if p.requires_grad} - set(weights)
    if missing:
        raise ValueError(f"Checkpoint {checkpoint} lacks trainable weights: {sorted(missing)[:5]}...")
    return weights


def save_reference(folder: str, current: dict, initial: dict) -> None:
    """After a reference reset: the reference's tensors (`klppo.ppo.run.reference_resets.reference_tensors`) as they are and as
    they were before the first reset, in one file."""
    from safetensors.torch import save_file

    tensors = {f"current.{k}": v.detach().cpu().contiguous() for k, v in current.items()}
    tensors.update({f"initial.{k}": v.detach().cpu().contiguous() for k, v in initial.items()})
    save_file(tensors, os.path.join(folder, REFERENCE_NAME))


def load_reference(checkpoint: str) -> tuple[dict, dict]:
    """`(current, initial)` reference tensors that `save_reference` wrote."""
    from safetensors.torch import load_file

    path = os.path.join(checkpoint, REFERENCE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{checkpoint} records reference resets but has no {REFERENCE_NAME}.")
    tensors = load_file(path, device="cpu")
    split = {"current": {}, "initial": {}}
    for key, value in tensors.items():
        which, name = key.split(".", 1)
        split[which][name] = value
    return split["current"], split["initial"]


@contextmanager
def staged(run_dir: str, name: str, args, accelerator, best_model_checkpoint=None):
    """Write checkpoint `name` of `run_dir` atomically: the block writes into the staging folder it is given
    (`(staging_root, staged)`: the root Trainer writes and rotates in, and the checkpoint's own folder there); once
    every rank's files are in place the folder is renamed into place and older checkpoints rotated, so a crash
    mid-save never leaves a partial checkpoint."""
    staging_root = os.path.join(run_dir, STAGING_DIR)
    folder = os.path.join(staging_root, name)
    if args.should_save and os.path.isdir(folder):
        shutil.rmtree(folder)  # left by a save that was interrupted
    yield staging_root, folder
    accelerator.wait_for_everyone()  # every rank's files (RNG states) are in place
    if args.should_save:
        final = os.path.join(run_dir, name)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(folder, final)
        shutil.rmtree(staging_root, ignore_errors=True)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=best_model_checkpoint,
            use_mtime=True,
        )
    accelerator.wait_for_everyone()


def load_weights(checkpoint: str, model_wrapped, model, deepspeed: bool) -> None:
    """Put a checkpoint's trainable weights back: under DeepSpeed from the engine's own checkpoint (sharded weights
    and optimizer state, exactly), else into `model` (under FSDP2 into the shards, where the optimizer's state
    maps: a forward before now may leave them whole)."""
    from ..distributed import load_full_weights

    weights = load_trainable_weights(checkpoint, model)
    if deepspeed:
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        deepspeed_load_checkpoint(model_wrapped, checkpoint, load_module_strict=False)
    else:
        load_full_weights(model, weights)
