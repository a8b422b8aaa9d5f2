"""`KLPPOConfig`: training arguments for `KLPPOTrainer`."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..kl import (
    KL_MODES,
    KL_STATISTIC_UNITS,
    LOSS_AGG_MODES,
    divergence_followed,
    follows_sequence_tilt,
    get_kl_controller,
    kl_controllers,
    kl_estimators,
)

logger = logging.getLogger(__name__)

KL_LOSS_SCALES = ("advantage_std", "none")
# `kl_loss_scale="advantage_std"` divides beta by max(s, this): collapsed advantages leave s at the whitening's
# epsilon (1e-4), which would multiply beta by 1e4
KL_LOSS_MIN_ADVANTAGE_STD = 0.01
# Learning-rate defaults when `learning_rate` is not set. LoRA: measured on the default job (SmolLM2-135M,
# 32 sequences per update, one epoch): 5e-4 kept policy/approxkl <= 0.007 and learned within 15 updates.
# Full fine-tuning (the same job with use_peft false): 3e-5 learned on 3 seeds with approxkl <= 0.0025;
# 3e-6 and 1e-5 barely moved the policy in 36 updates, 1e-4 gave back its early gains.
DEFAULT_LORA_LEARNING_RATE = 5e-4
DEFAULT_FULL_LEARNING_RATE = 3e-5
CRITIC_KINDS = ("separate", "shared")
ADVANTAGE_ESTIMATORS = ("gae", "rloo", "grpo")
CRITIC_FREE_DEFAULT_GENERATIONS = 4


def _choice_error(field_name: str, value, choices) -> ValueError:
    listed = ", ".join(repr(c) for c in choices)
    return ValueError(f"`{field_name}`={value!r} is not valid. Choose one of: {listed}.")


KLPPO_CONFIG_DOC = r"""
    Configuration for [`KLPPOTrainer`].

    Batch sizes follow TRL's former PPO convention:

    - per-device mini-batch = `per_device_train_batch_size * gradient_accumulation_steps`;
    - per-device rollout batch = mini-batch * `num_mini_batches`;
    - global rollout batch = per-device rollout batch * number of processes.

    `max_steps` counts PPO updates (one rollout batch each). When `max_steps <= 0`, the number of
    updates is `ceil(num_train_epochs * len(train_dataset) / global rollout batch)`.

    Parameters:
        > KL control

        kl_mode (`str`, *optional*, defaults to `"reward"`):
            Where the KL estimate acts. `"reward"`: per-token rewards `-kl_coef * kl_t` on response tokens
            (Ziegler et al. 2019; with `k1` this is an unbiased gradient of the sequence KL). `"loss"`:
            `kl_coef * aggregated kl` added to the policy loss (GRPO style). `"both"`: both, with the same
            coefficient. `"none"`: no KL term (KL is still measured and logged).
        kl_estimator (`str`, *optional*, defaults to `"k1"`):
            Per-token estimator: `k1`, `k2`, `k3`, `low_var_kl`, `abs`, `corrected_k3`, each also with a `+`
            suffix (value of the estimator, gradient of `k2`), or `"full"` (exact KL over the whole vocabulary,
            computed in chunks). Combinations whose gradient is not that of KL(pi||ref) log one warning
            naming the divergence they follow (see the estimator table in `docs/kl.md`).
        kl_statistic (`str` or `None`, *optional*, defaults to `None`):
            Estimator of the controller statistic `kl/value`, the KL that `kl_target` names and the controller
            reads; any `kl_estimator` name. It only measures: the KL in the reward or the loss stays
            `kl_estimator`. `"full"` sums the exact KL over the vocabulary at each sampled position: the same
            expectation as `k1`'s sum (the chain rule of KL), without `k1`'s per-token sampling noise (1.6-3x less
            noise in a reading of 32 sequences of 12 tokens; `docs/kl.md`, "The KL statistic"). It costs one policy forward
            pass per update when the generation's logits exceed `generation_logits_max_mb`. `None`: `"full"` when a
            `kl_target` is set, else `kl_estimator`.
        kl_coef (`float`, *optional*, defaults to `0.05`):
            Initial KL coefficient beta.
        kl_controller (`str` or `None`, *optional*, defaults to `None`):
            How beta changes between updates: `"fixed"`, `"equilibrium"` (beta moves toward the batch's estimate
            of the coefficient whose KL-regularised optimum has the target KL; needs `k1` in the reward, see
            `EquilibriumKLController`), `"tracking"` (PI control of log beta on the KL and where it is heading, with a
            start-up hold, for any KL configuration), `"adaptive"` (Ziegler et al. 2019, Sec. 2.2),
            `"exponential"` (`beta <- beta * exp(rate * (kl - target))`), `"pid"` (PID on log beta), or a name
            registered with `klppo.kl.register_kl_controller`. `None`: with a `kl_target`, `"equilibrium"` for
            `k1` in the reward (the default KL) and `"tracking"` for any other KL; without one, `"fixed"`.
        kl_target (`float` or `None`, *optional*, defaults to `None`):
            Target of the controller statistic, in the unit given by `kl_target_unit`. Required by every
            controller but `"fixed"`. Typical: 6 nats per sequence (trlx) or 0.1 per token (verl).
        kl_target_unit (`str`, *optional*, defaults to `"sequence"`):
            Unit of the controller statistic: `"sequence"` (mean over sequences of the per-sequence sum, the
            trlx / old TRL convention) or `"token"` (token-weighted mean, verl's convention). Both are reduced
            across all processes as (sum, count).
        kl_controller_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            The controller's own constants (gains, bounds, windows), as a mapping; each controller declares its
            constants and their defaults in its constructor (the table in `docs/kl.md`), and a key it does not
            declare is refused. E.g. `{"horizon": 10000}` for `adaptive`, `{"kp": 0.1, "ki": 0.3}` for `pid`,
            `{"coef_min": 1e-3}` for any controller with bounds. From a command line, a JSON string. `None`: the
            controller's defaults, the settings the evidence in `docs/kl.md` backs.
        kl_log_ratio_clamp (`float` or `None`, *optional*, defaults to `40.0`):
            `|log pi - log pi_ref|` is clamped to this before any `exp`, which keeps float32 finite.
        kl_value_clamp (`float` or `None`, *optional*, defaults to `None`):
            Opt-in clamp of every estimator's output to `[-v, v]` (OpenRLHF uses 10). Clamped tokens have zero
            gradient; their fraction is logged as `kl/clamped_frac`.
        kl_loss_agg_mode (`str`, *optional*, defaults to `"token-mean"`):
            Aggregation of the KL loss term: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean` or
            `seq-mean-token-sum-norm` (each sequence's sum divided by the constant `response_length`). Counts
            are global (all processes, whole mini-batch), so results do not depend on how a batch is split
            across processes and accumulation steps.
        kl_loss_scale (`str`, *optional*, defaults to `"advantage_std"`):
            How the loss-mode coefficient relates to `kl_coef`. With whitened advantages the policy-gradient
            term is divided by the advantages' standard deviation `s`, so adding `beta * KL` to the loss
            maximises `E[r] - beta * s * KL`, not `E[r] - beta * KL`. `"advantage_std"` uses `beta / s` in the
            loss (`s` reduced over all processes, logged as `policy/advantage_std`), so `kl_coef` names the
            same objective `E[r] - beta * KL` in every `kl_mode`; `s` is floored at 0.01, so the coefficient
            stays within `100 * beta` when the advantages collapse (every sample scored alike: the whitened
            advantages are then noise, and `s` would fall to the whitening's epsilon, `beta / s` to `1e4 * beta`).
            Rewards on a scale far below 1 are best rescaled. `"none"` uses `beta` as is: the convention of
            TRL's GRPO and verl, where beta weighs KL against the normalised advantage.
        kl_drift_patience (`int`, *optional*, defaults to `5`):
            Warn when the controller statistic stays above 2x or below 0.5x the target for this many
            consecutive updates (once per excursion; below only after it has first reached 0.5x the target,
            not while it climbs from 0 at the start).
        kl_guard (`bool` or `None`, *optional*, defaults to `None`: on with `equilibrium` and `tracking`, else off):
            An early stop on the KL to the reference inside one update, as CleanRL's `target_kl` is on the KL to the
            old policy: once the KL at the current policy passes `kl_target` and the update has pushed it up, the
            mini-batch takes no optimizer step, the rest of the update is skipped, and the optimizer's first moments
            (Adam's `exp_avg`, SGD's `momentum_buffer`) are cleared so that the push does not carry into the next
            update. Its low side does the same below the target, once a rollout's reading has reached it. That KL
            is the rollout's reading of the controller statistic plus the change the update has made on the
            mini-batch's tokens (k1 weighted by pi / pi_old, in `kl_target_unit`, reduced over all processes;
            with a `kl_statistic` whose expectation is not KL(pi || ref), such as `k2`, the two measure different
            things). The update's first step always goes ahead. It acts only where an update takes more than one step
            (`num_mini_batches * num_ppo_epochs > 1`). Logged as `kl/guard_fired` and `kl/guard_low_fired`. Unset,
            it is on with the `equilibrium` and `tracking` controllers (klppo's defaults whenever `kl_target` is
            set) and off with every other controller, so that they behave as published. Needs `kl_target`.
        full_kl_chunk_size (`int`, *optional*, defaults to `1024`):
            Positions per chunk for `kl_estimator="full"`.
        generation_logits_max_mb (`float`, *optional*, defaults to `1024`):
            A logits-based `kl_statistic` reads the policy's logits from generation (no scoring pass) when a
            rollout's response logits, `sequences x response_length x vocabulary` float32 values per process,
            fit in this many MiB (the default job: 75 MiB); above it, one policy forward per update scores them
            in chunks of `rollout_forward_batch_size` sequences.

        > PPO

        num_ppo_epochs (`int`, *optional*, defaults to `4`):
            Optimisation epochs over each rollout batch.
        num_mini_batches (`int`, *optional*, defaults to `1`):
            Mini-batches per rollout batch (one optimizer step each).
        cliprange (`float`, *optional*, defaults to `0.2`):
            Clip range of the policy ratio.
        cliprange_value (`float`, *optional*, defaults to `0.2`):
            Clip range of the value prediction around the rollout's value.
        vf_coef (`float`, *optional*, defaults to `0.1`):
            Weight of the value loss.
        gamma (`float`, *optional*, defaults to `1.0`), lam (`float`, *optional*, defaults to `0.95`):
            Discount and GAE lambda.
        whiten_rewards (`bool`, *optional*, defaults to `False`):
            Whiten per-token rewards (global statistics) before GAE.
        whiten_advantages (`bool`, *optional*, defaults to `True`):
            Whiten advantages with global statistics across processes.
        advantage_estimator (`str`, *optional*, defaults to `"gae"`):
            `"gae"`: GAE over per-token rewards with a critic (`critic`, `gamma`, `lam`). `"rloo"`: REINFORCE leave-one-out
            (Ahmadian et al. 2024): each response's return minus the mean return of the other `num_generations - 1`
            responses to its prompt, an unbiased policy gradient, then whitened like GAE's advantages, so `kl_coef`
            names the objective `E[r] - beta * KL` in reward and loss mode alike. `"grpo"`: `(return - group mean) /
            (group std + 1e-4)` (Shao et al. 2024, as TRL's GRPOTrainer); `whiten_advantages` and `kl_loss_scale` do
            not apply (the loss-mode coefficient is `kl_coef` as is, weighed against the group-normalised reward).
            The per-group std rescales each prompt's reward by a number that depends on the policy and the group
            size: with the KL in the loss the fixed point is a tilt of the reference whose strength moves with the
            policy's own reward spread, not `ref * exp(r / beta) / Z` (`klppo.ppo.advantages.grpo_advantages`); with
            `k1` in the reward the whole return is rescaled and `ref * exp(r / beta) / Z` stays a fixed point. Use a
            `kl_target` to hold the KL whatever beta then means. The return of a sequence is its score plus, in
            reward mode, its summed per-token KL rewards; its advantage goes to every response token. `"rloo"` and
            `"grpo"` build and train no critic (`critic`, `critic_init`, `value_model`, `vf_coef`, `cliprange_value`,
            `gamma`, `lam` are ignored, with one logged note).
        num_generations (`int` or `None`, *optional*, defaults to `None`):
            Responses sampled per prompt: each prompt of a rollout appears this many times in a row, on one process.
            The per-process rollout batch (`per_device_train_batch_size * gradient_accumulation_steps *
            num_mini_batches`) must be a multiple of it. `None`: 1 with `"gae"`, 4 with `"rloo"` and `"grpo"`, which
            need at least 2.
        critic (`str`, *optional*, defaults to `"separate"`):
            `"separate"`: a value model of its own (initialised per `critic_init`); `"shared"`: a value head on
            the policy backbone, one forward pass for both.
        shared_critic_detach (`bool`, *optional*, defaults to `False`):
            With `critic="shared"`: the value loss trains the value head only, not the policy's trunk (the head
            reads a detached last hidden state). Keeps the value loss from pulling the policy when the returns
            are large; the head is then a linear probe of the policy's features.
        critic_init (`str`, *optional*, defaults to `"policy"`):
            Where a separate critic's backbone comes from: `"policy"`, `"reward"` (the first reward model) or
            a model path / hub id.

        > Rollout

        response_length (`int`, *optional*, defaults to `53`):
            Maximum number of generated tokens.
        temperature (`float`, *optional*, defaults to `0.7`):
            Sampling temperature; policy and reference log-probs use the same scaling.
        stop_token (`str` or `None`, *optional*, defaults to `"eos"`):
            `"eos"` truncates responses after the first EOS token; `None` keeps the full length.
        stop_token_id (`int` or `None`, *optional*, defaults to `None`):
            An explicit stop token id (overrides `stop_token`).
        missing_eos_penalty (`float` or `None`, *optional*, defaults to `None`):
            Subtracted from the score of responses that did not end with the stop token (needs one:
            `stop_token="eos"` or `stop_token_id`).
        reward_weights (`list[float]` or `None`, *optional*, defaults to `None`):
            Weights of the reward functions (default: all 1).
        rollout_forward_batch_size (`int`, *optional*, defaults to `16`):
            Sequences per forward chunk when scoring rollouts: full-vocabulary logits never exist for more than
            this many sequences at once.
        max_prompt_length (`int` or `None`, *optional*, defaults to `256`):
            Prompts are truncated (from the left) to this many tokens.
        cache_implementation (`str` or `None`, *optional*, defaults to `None`):
            The KV cache generation decodes into. `None`: transformers' dynamic cache. `"static"`: one cache of
            `max_prompt_length + response_length` positions per batch size, made once and reused, so that on a GPU
            `generate` compiles the decoding step (transformers' automatic compilation: `torch.compile` with CUDA
            graphs) once per batch size, at the first rollout, whatever the prompts' width. Needs
            `max_prompt_length`. A model that transformers does not mark as compilable, and runs under DeepSpeed
            or FSDP, keep the dynamic cache (one log line says so). A LoRA policy then samples unmerged
            (`merge_adapter_for_generation` does not apply: its copies of the weights would move at every rollout).
        merge_adapter_for_generation (`bool`, *optional*, defaults to `True`):
            Sample from a LoRA policy with its adapter merged into copies of the base weights (put back, bit for
            bit, after sampling): no per-layer adapter overhead at every decoding step, at the cost of one extra
            set of the targeted base weights while sampling. Log-probs read from generation then differ from a
            scoring pass by rounding only (about 1e-5 to 1e-4). Skipped under DeepSpeed and FSDP, and for LoRA
            layers that cannot merge into a base weight of their own (quantized, DoRA and other variants, tied
            embeddings).

        > Optimisation

        learning_rate (`float` or `None`, *optional*, defaults to `None`):
            Peak learning rate. `None`: 5e-4 when the policy is trained through a LoRA adapter (measured on the
            default job: `policy/approxkl` <= 0.007 at 32 sequences per update), 3e-5 for full fine-tuning (measured
            on the default job with `use_peft: false`: 3e-6 and 1e-5 barely moved the policy in 36 updates, 3e-5
            raised the reward by 4.7-10.8 standard errors on 3 seeds with `policy/approxkl` <= 0.0025, 1e-4 gave
            back its early reward gains).

        > Diagnostics

        num_sample_generations (`int`, *optional*, defaults to `10`):
            How many times over training a table of sample completions is logged (0 disables).
        heldout_eval_texts (`int`, *optional*, defaults to `32`):
            Number of held-out texts for `eval/perplexity`.
        nonfinite_rollback (`bool` or `None`, *optional*, defaults to `None`):
            When a loss or gradient of an update is non-finite, or its steps leave a policy whose logits (or
            the critic's values) are not finite, undo the whole update: the trainable weights, the optimizer
            state and the scheduler are restored to the start of the update, so a skipped update changed
            nothing. This costs one copy of the trainable weights and of the optimizer state per update.
            `None` (the default) turns it on when the trainable weights (policy and critic) are at most 10% of
            all weights, as with LoRA and `critic="shared"`, where the copy is small, and off otherwise (full fine-tuning, or a separately trained critic), where the copy would
            hold those weights once more and Adam's two moments (3x the trainable weights); the log then says
            how many optimizer steps of the skipped update had already been applied, and a policy left with
            non-finite logits stops training (`TrainingDiverged`, nothing saved from it). `True` or `False`
            forces it (on the command line `--nonfinite_rollback true` or `false`).
        health_patience (`int`, *optional*, defaults to `3`):
            Warn, naming the fix, when `policy/approxkl` (> 0.02), `policy/clipfrac` (> 0.2), `policy/entropy`
            (< half its first value) or `val/clipfrac` (> 0.5) stays outside its healthy range for this many
            consecutive updates (`klppo.ppo.health`).
        max_nonfinite_updates (`int`, *optional*, defaults to `3`):
            Updates with a non-finite loss or KL are skipped; this many in a row abort training.

        > Defaults that differ from `TrainingArguments`

        logging_steps (`int`, *optional*, defaults to `1`):
            Log every this many PPO updates.
        remove_unused_columns (`bool`, *optional*, defaults to `False`):
            Keep every dataset column: columns other than `prompt` are passed to the reward functions.
        ddp_find_unused_parameters (`bool`, *optional*, defaults to `False`):
            Every trainable parameter takes part in each PPO loss, so DDP need not search for unused ones.

    """

def _field_docs(doc: str) -> dict[str, str]:
    """`{field: its description}` from the `Parameters:` section of a Hugging Face-style docstring (one entry
    may document several fields: `a (...), b (...):`)."""
    docs, names, body = {}, [], []
    section = doc.split("Parameters:", 1)[1]
    for line in section.splitlines() + [" " * 8 + "end (`x`):"]:
        if line.startswith(" " * 8) and not line.startswith(" " * 9) and line.rstrip().endswith(":"):
            docs.update({n: " ".join(body) for n in names})
            names, body = re.findall(r"\w+", re.sub(r"\([^)]*\)", "", line)), []
        elif line.startswith(" " * 12):
            body.append(line.strip())
    return docs


_FIELD_DOCS = _field_docs(KLPPO_CONFIG_DOC)


def _doc(name: str) -> dict:
    """A field's `metadata` (its `--help` text), taken from the class docstring: each field is documented once."""
    return {"help": _FIELD_DOCS[name]}


@dataclass
class KLPPOConfig(TrainingArguments):
    __doc__ = KLPPO_CONFIG_DOC

    # KL control
    kl_mode: str = field(default="reward", metadata=_doc("kl_mode"))
    kl_estimator: str = field(default="k1", metadata=_doc("kl_estimator"))
    kl_statistic: str | None = field(default=None, metadata=_doc("kl_statistic"))
    kl_coef: float = field(default=0.05, metadata=_doc("kl_coef"))
    kl_controller: str | None = field(default=None, metadata=_doc("kl_controller"))
    kl_target: float | None = field(default=None, metadata=_doc("kl_target"))
    kl_target_unit: str = field(default="sequence", metadata=_doc("kl_target_unit"))
    kl_controller_kwargs: dict | str | None = field(default=None, metadata=_doc("kl_controller_kwargs"))
    kl_log_ratio_clamp: float | None = field(default=40.0, metadata=_doc("kl_log_ratio_clamp"))
    kl_value_clamp: float | None = field(default=None, metadata=_doc("kl_value_clamp"))
    kl_loss_agg_mode: str = field(default="token-mean", metadata=_doc("kl_loss_agg_mode"))
    kl_loss_scale: str = field(default="advantage_std", metadata=_doc("kl_loss_scale"))
    kl_drift_patience: int = field(default=5, metadata=_doc("kl_drift_patience"))
    kl_guard: bool | None = field(default=None, metadata=_doc("kl_guard"))
    full_kl_chunk_size: int = field(default=1024, metadata=_doc("full_kl_chunk_size"))
    generation_logits_max_mb: float = field(default=1024.0, metadata=_doc("generation_logits_max_mb"))

    # PPO
    num_ppo_epochs: int = field(default=4, metadata=_doc("num_ppo_epochs"))
    num_mini_batches: int = field(default=1, metadata=_doc("num_mini_batches"))
    cliprange: float = field(default=0.2, metadata=_doc("cliprange"))
    cliprange_value: float = field(default=0.2, metadata=_doc("cliprange_value"))
    vf_coef: float = field(default=0.1, metadata=_doc("vf_coef"))
    gamma: float = field(default=1.0, metadata=_doc("gamma"))
    lam: float = field(default=0.95, metadata=_doc("lam"))
    whiten_rewards: bool = field(default=False, metadata=_doc("whiten_rewards"))
    whiten_advantages: bool = field(default=True, metadata=_doc("whiten_advantages"))
    advantage_estimator: str = field(default="gae", metadata=_doc("advantage_estimator"))
    num_generations: int | None = field(default=None, metadata=_doc("num_generations"))
    critic: str = field(default="separate", metadata=_doc("critic"))
    shared_critic_detach: bool = field(default=False, metadata=_doc("shared_critic_detach"))
    critic_init: str = field(default="policy", metadata=_doc("critic_init"))

    # Rollout
    response_length: int = field(default=53, metadata=_doc("response_length"))
    temperature: float = field(default=0.7, metadata=_doc("temperature"))
    stop_token: str | None = field(default="eos", metadata=_doc("stop_token"))
    stop_token_id: int | None = field(default=None, metadata=_doc("stop_token_id"))
    missing_eos_penalty: float | None = field(default=None, metadata=_doc("missing_eos_penalty"))
    reward_weights: list[float] | None = field(default=None, metadata=_doc("reward_weights"))
    rollout_forward_batch_size: int = field(default=16, metadata=_doc("rollout_forward_batch_size"))
    max_prompt_length: int | None = field(default=256, metadata=_doc("max_prompt_length"))
    cache_implementation: str | None = field(default=None, metadata=_doc("cache_implementation"))
    merge_adapter_for_generation: bool = field(default=True, metadata=_doc("merge_adapter_for_generation"))

    # Diagnostics
    num_sample_generations: int = field(default=10, metadata=_doc("num_sample_generations"))
    heldout_eval_texts: int = field(default=32, metadata=_doc("heldout_eval_texts"))
    nonfinite_rollback: bool | None = field(default=None, metadata=_doc("nonfinite_rollback"))
    health_patience: int = field(default=3, metadata=_doc("health_patience"))
    max_nonfinite_updates: int = field(default=3, metadata=_doc("max_nonfinite_updates"))

    # Defaults that differ from TrainingArguments
    learning_rate: float | None = field(default=None, metadata=_doc("learning_rate"))
    logging_steps: float = field(default=1, metadata=_doc("logging_steps"))
    remove_unused_columns: bool = field(default=False, metadata=_doc("remove_unused_columns"))
    ddp_find_unused_parameters: bool | None = field(default=False, metadata=_doc("ddp_find_unused_parameters"))

    def __post_init__(self):
        self._validate_kl_fields()
        self._validate_ppo_fields()
        self._deepspeed_settings()
        super().__post_init__()
        self._warn_biased_gradient()

    def _deepspeed_settings(self) -> None:
        """Under DeepSpeed: on a machine with no GPU (DeepSpeed's CPU accelerator), accelerate only counts the
        processes of a named backend, so without one every rank would believe it is alone: `ddp_backend` defaults
        to gloo, the backend DeepSpeed's CPU accelerator itself initialises. `nonfinite_rollback=True` is refused."""
        import torch

        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or self.deepspeed
        if deepspeed and self.ddp_backend is None and not self.use_cpu and not torch.cuda.is_available():
            self.ddp_backend = "gloo"
        if deepspeed and self.nonfinite_rollback:
            raise ValueError(
                "nonfinite_rollback=True is not available under DeepSpeed: its optimizer state is sharded and cannot "
                "be copied and restored by klppo. DeepSpeed itself drops a step whose gradients are not finite. "
                "Leave nonfinite_rollback unset (or false) under DeepSpeed."
            )

    # ------------------------------------------------------------------ validation
    def _validate_kl_fields(self) -> None:
        if self.kl_mode not in KL_MODES:
            raise _choice_error("kl_mode", self.kl_mode, KL_MODES)
        if self.kl_estimator not in kl_estimators():
            raise _choice_error("kl_estimator", self.kl_estimator, kl_estimators())
        if self.kl_statistic is None:
            self.kl_statistic = "full" if self.kl_target is not None else self.kl_estimator
        if self.kl_statistic not in kl_estimators():
            raise _choice_error("kl_statistic", self.kl_statistic, kl_estimators())
        reads_sequences = getattr(self, "_controller_reads_sequences", True)  # False where TRL's trainers run it
        # the tilt is the optimum of the undiscounted return (gamma 1, or critic-free sequence returns) of an
        # unclamped penalty
        undiscounted = getattr(self, "gamma", 1.0) == 1 or getattr(self, "advantage_estimator", "gae") != "gae"
        tilt = (reads_sequences and undiscounted and self.kl_value_clamp is None
                and follows_sequence_tilt(self.kl_mode, self.kl_estimator))
        if self.kl_controller is None:
            self.kl_controller = "fixed" if self.kl_target is None else "equilibrium" if tilt else "tracking"
        if self.kl_controller not in kl_controllers():
            raise _choice_error("kl_controller", self.kl_controller, kl_controllers())
        if hasattr(get_kl_controller(self.kl_controller), "observe_sequences") and not tilt:
            if not reads_sequences:
                why = "TRL's trainers do not hand it their sequences"
            elif not follows_sequence_tilt(self.kl_mode, self.kl_estimator):
                why = (f"{self.kl_estimator} in kl_mode={self.kl_mode!r} does not optimise the sequence-level "
                       "KL(pi || ref) whose optimum it solves for (only k1 in the reward does)")
            else:
                why = (f"with gamma={getattr(self, 'gamma', 1.0)} or kl_value_clamp={self.kl_value_clamp} that "
                       "optimum is not the one trained (it needs gamma 1 and no kl_value_clamp)")
            raise ValueError(
                f"`kl_controller='{self.kl_controller}'` sets beta from the batch's estimate of the coefficient whose "
                f"optimum ref * exp(r / beta) / Z has the target KL, but {why}. Use kl_controller='tracking' (or "
                "'pid'), which read only the KL statistic, or kl_mode='reward' with kl_estimator='k1'."
            )
        if self.kl_target_unit not in KL_STATISTIC_UNITS:
            raise _choice_error("kl_target_unit", self.kl_target_unit, KL_STATISTIC_UNITS)
        if self.kl_loss_agg_mode not in LOSS_AGG_MODES:
            raise _choice_error("kl_loss_agg_mode", self.kl_loss_agg_mode, LOSS_AGG_MODES)
        if self.kl_loss_scale not in KL_LOSS_SCALES:
            raise _choice_error("kl_loss_scale", self.kl_loss_scale, KL_LOSS_SCALES)
        if not get_kl_controller(self.kl_controller).needs_target:
            if self.kl_coef < 0:
                raise ValueError(f"`kl_coef` must be >= 0, got {self.kl_coef}.")
        else:
            if self.kl_mode == "none":
                raise ValueError(
                    f"`kl_mode='none'` applies no KL term, so `kl_controller='{self.kl_controller}'` has "
                    "nothing to adapt. Set `kl_controller='fixed'`, or choose kl_mode 'reward', 'loss' or 'both'."
                )
            if self.kl_target is None or not self.kl_target > 0:
                raise ValueError(
                    f"`kl_controller='{self.kl_controller}'` needs a positive `kl_target` (got {self.kl_target}), "
                    f"in the unit of `kl_target_unit` ('{self.kl_target_unit}'): e.g. 6.0 nats per sequence or "
                    "0.1 per token. Use `kl_controller='fixed'` for a constant coefficient."
                )
            if not self.kl_coef > 0:
                raise ValueError(
                    f"`kl_controller='{self.kl_controller}'` scales the coefficient multiplicatively, so "
                    f"`kl_coef` must be > 0 (got {self.kl_coef})."
                )
        if isinstance(self.kl_controller_kwargs, str):  # from a command line
            try:
                self.kl_controller_kwargs = json.loads(self.kl_controller_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"`kl_controller_kwargs` must be a mapping (JSON on a command line), got "
                    f"{self.kl_controller_kwargs!r}: {err}."
                ) from None
        # the controller's constants (gains, bounds, windows) are checked by building it once
        from ..kl import build_kl_controller

        try:
            build_kl_controller(self)
        except (ValueError, TypeError) as err:
            raise ValueError(f"`kl_controller='{self.kl_controller}'`: {err}") from None
        if self.kl_log_ratio_clamp is not None and not self.kl_log_ratio_clamp > 0:
            raise ValueError(
                f"`kl_log_ratio_clamp` must be > 0 or None, got {self.kl_log_ratio_clamp} (40 keeps float32 finite)."
            )
        if self.kl_value_clamp is not None and not self.kl_value_clamp > 0:
            raise ValueError(f"`kl_value_clamp` must be > 0 or None (off), got {self.kl_value_clamp}.")
        if self.kl_guard is None:
            self.kl_guard = self.kl_controller in ("equilibrium", "tracking") and self.kl_target is not None
        elif not isinstance(self.kl_guard, bool):
            raise ValueError(
                f"`kl_guard` must be true, false or unset (on with the equilibrium and tracking controllers), got "
                f"{self.kl_guard!r}."
            )
        elif self.kl_guard and self.kl_target is None:
            raise ValueError(
                "`kl_guard=True` stops an update once the KL to the reference passes `kl_target`, so it needs a "
                "`kl_target`; set one, or leave kl_guard unset."
            )
        if self.kl_drift_patience < 1:
            raise ValueError(f"`kl_drift_patience` must be >= 1, got {self.kl_drift_patience}.")
        if self.full_kl_chunk_size < 1:
            raise ValueError(f"`full_kl_chunk_size` must be >= 1, got {self.full_kl_chunk_size}.")
        if not self.generation_logits_max_mb >= 0:
            raise ValueError(
                f"`generation_logits_max_mb` must be >= 0 (MiB), got {self.generation_logits_max_mb}; 0 always scores "
                "the policy's logits in a forward pass, the default 1024 keeps the generation's when they fit."
            )

    def _validate_ppo_fields(self) -> None:
        if self.critic not in CRITIC_KINDS:
            raise _choice_error("critic", self.critic, CRITIC_KINDS)
        self._validate_advantage_fields()
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length", "rollout_forward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if not self.temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {self.temperature}.")
        if self.stop_token not in ("eos", None):
            raise _choice_error("stop_token", self.stop_token, ("eos", None))
        if self.missing_eos_penalty is not None and self.stop_token is None and self.stop_token_id is None:
            raise ValueError(
                f"`missing_eos_penalty={self.missing_eos_penalty}` needs a stop token: with `stop_token=None` every "
                "response has the full length and EOS is never sampled, so the penalty could never apply. Set "
                "stop_token='eos' (or stop_token_id), or remove missing_eos_penalty."
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"`gamma` and `lam` must lie in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        if self.cliprange <= 0 or self.cliprange_value <= 0:
            raise ValueError("`cliprange` and `cliprange_value` must be > 0.")
        if self.learning_rate is not None and not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(
                f"`learning_rate` must be a positive finite number, got {self.learning_rate}; leave it unset for "
                "the default (5e-4 with LoRA, 3e-5 for full fine-tuning)."
            )
        for name in ("vf_coef", "max_grad_norm", "weight_decay", "warmup_ratio"):
            value = getattr(self, name, None)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value}.")
        for name, low in (("per_device_train_batch_size", 1), ("gradient_accumulation_steps", 1),
                          ("heldout_eval_texts", 0), ("num_sample_generations", 0), ("full_kl_chunk_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"`{name}` must be >= {low}, got {getattr(self, name)}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1 or None, got {self.max_prompt_length}.")
        if self.cache_implementation not in (None, "static"):
            raise _choice_error("cache_implementation", self.cache_implementation, (None, "static"))
        if self.cache_implementation == "static" and self.max_prompt_length is None:
            raise ValueError(
                "`cache_implementation='static'` makes a cache of max_prompt_length + response_length positions, so "
                "it needs a `max_prompt_length` (e.g. 256). Set one, or leave cache_implementation unset."
            )
        for name in ("save_strategy", "eval_strategy", "logging_strategy"):
            if str(getattr(getattr(self, name), "value", getattr(self, name))) == "epoch":
                raise ValueError(
                    f"`{name}='epoch'` is not supported: klppo counts PPO updates, not epochs. Use "
                    f"`{name}='steps'` with `{name.split('_')[0]}_steps` (in PPO updates)."
                )
        if self.health_patience < 1:
            raise ValueError(f"`health_patience` must be >= 1, got {self.health_patience}.")
        if self.max_nonfinite_updates < 1:
            raise ValueError(f"`max_nonfinite_updates` must be >= 1, got {self.max_nonfinite_updates}.")

    def _validate_advantage_fields(self) -> None:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise _choice_error("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        if self.num_generations is None:
            self.num_generations = 1 if self.advantage_estimator == "gae" else CRITIC_FREE_DEFAULT_GENERATIONS
        if self.num_generations < 1 or (self.critic_free and self.num_generations < 2):
            least = 2 if self.critic_free else 1
            raise ValueError(
                f"`num_generations` must be >= {least} with advantage_estimator='{self.advantage_estimator}', got "
                f"{self.num_generations}" + (": its baseline is the other responses to the same prompt." if least == 2 else ".")
            )
        rollout = self.local_rollout_batch_size
        if rollout % self.num_generations:
            low = rollout // self.num_generations * self.num_generations
            raise ValueError(
                f"The per-process rollout batch ({rollout} = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x gradient_accumulation_steps {self.gradient_accumulation_steps} "
                f"x num_mini_batches {self.num_mini_batches}) is not a multiple of num_generations="
                f"{self.num_generations}: every prompt's {self.num_generations} responses must sit on one process, in "
                f"one rollout. Set per_device_train_batch_size (or gradient_accumulation_steps, num_mini_batches) so "
                f"that the product is a multiple of {self.num_generations}, e.g. {max(low, self.num_generations)} or "
                f"{low + self.num_generations}, or choose a num_generations that divides {rollout}."
            )

    def _warn_biased_gradient(self) -> None:
        for mode in self.kl_modes_applied:
            info = divergence_followed(self.kl_estimator, mode, off_policy=self.is_off_policy)
            if not info.unbiased:
                logger.warning("KL configuration: %s", info.message)

    # ------------------------------------------------------------------ derived values
    @property
    def kl_modes_applied(self) -> tuple[str, ...]:
        """The places the KL term acts: a subset of ("reward", "loss")."""
        return KL_MODES[self.kl_mode]

    @property
    def critic_free(self) -> bool:
        """Whether the advantages need no critic (`advantage_estimator` "rloo" or "grpo")."""
        return self.advantage_estimator != "gae"

    @property
    def local_prompts_per_rollout(self) -> int:
        """Distinct prompts in one rollout on this process (each sampled `num_generations` times)."""
        return self.local_rollout_batch_size // (self.num_generations or 1)

    @property
    def is_off_policy(self) -> bool:
        """Whether loss terms are evaluated on a policy that has moved since sampling (several optimizer
        steps per rollout batch)."""
        return self.num_ppo_epochs * self.num_mini_batches > 1

    @property
    def local_mini_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def local_rollout_batch_size(self) -> int:
        return self.local_mini_batch_size * self.num_mini_batches

    def num_updates(self, dataset_size: int, world_size: int) -> int:
        """Number of PPO updates: `max_steps` if set, else epochs over the prompt set."""
        if self.max_steps > 0:
            return int(self.max_steps)
        global_prompts = self.local_prompts_per_rollout * world_size
        return max(1, math.ceil(self.num_train_epochs * dataset_size / global_prompts))
