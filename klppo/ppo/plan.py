"""The KL plan of a run: which KL, from which logits, where it goes; decided once, when the trainer is built.

Every step of an update reads the plan instead of deciding again:

- rollout (steps 1-3): whether the sampling policy's log-probs (and a shared critic's values) are read while
  decoding, and whether the generation's full-vocabulary logits are kept for a logits-based statistic;
- scoring (step 3): which logits the scoring forward passes must produce, and the per-token estimates;
- the KL step (steps 5-6): where the configured estimate acts (reward, loss) and in which unit the controller reads;
- the loss (step 8): whether the loss term needs the reference's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kl import estimate_kl, get_kl_estimator_spec

LOGGED_ESTIMATORS = ("k1", "k2", "k3")  # logged whatever the configured estimator (TRL issue 1161)


@dataclass(frozen=True)
class KLPlan:
    """How one run estimates, applies and reads the KL.

    Args:
        estimator: `kl_estimator`, the estimate that enters the reward or the loss.
        statistic: `kl_statistic`, the estimate the controller reads (`kl/value`).
        places: where the estimator acts: a subset of ("reward", "loss").
        unit: `kl_target_unit` ("sequence": per-sequence sums; "token": token mean).
        log_ratio_clamp, value_clamp, chunk_size: the estimators' clamps and `full`'s chunk size.
        read_while_decoding: the sampling policy's log-probs (and a shared critic's values) are read at each decoding
            step instead of by a scoring forward pass: only when the policy computes in float32 (in bf16 the KV-cache
            path and a full forward differ, `docs/results.md`), the decoding step is not compiled, no logits-based estimator needs the policy's logits
            at scoring, and a logits-based statistic's logits fit in `generation_logits_max_mb` (else the scoring
            forward that computes them gives the log-probs too).
        keep_generation_logits: the logits-based statistic reads the generation's logits (they fit in
            `generation_logits_max_mb`), so that scoring runs no policy forward for it.
        mode: `kl_mode`, as configured (the log line's).
        target: `kl_target`, or None.
        guard: `kl_guard`, resolved: False, True or a registered guard's name.
        drift_patience: `kl_drift_patience`, updates outside the band before the drift monitor warns.
        loss_agg_mode: `kl_loss_agg_mode`, how the loss term aggregates its tokens.
        loss_scale_by_advantage_std: the loss-mode coefficient is beta divided by the advantages' whitening scale
            (`kl_loss_scale="advantage_std"`, except with GRPO, whose advantages are normalised per group).
        loss_baseline: the loss term takes a baseline out of its per-token gradient (`kl_loss_baseline`, with a KL in
            the loss that is per-token and aggregated other than `seq-mean-token-mean`, which weighs a token by its
            own response's length).
        grpo_slope: the equilibrium controller weighs each score by GRPO's advantage slope (GRPO with a KL in the
            loss: the group-normalised advantage follows the policy gradient of `E[Delta * r]`).
    """

    estimator: str
    statistic: str
    places: tuple[str, ...]
    unit: str
    log_ratio_clamp: float | None
    value_clamp: float | None
    chunk_size: int
    read_while_decoding: bool
    keep_generation_logits: bool
    mode: str = "reward"
    target: float | None = None
    guard: bool | str = False
    drift_patience: int = 5
    loss_agg_mode: str = "token-mean"
    loss_scale_by_advantage_std: bool = False
    loss_baseline: bool = False
    grpo_slope: bool = False

    @property
    def estimator_needs_logits(self) -> bool:
        return get_kl_estimator_spec(self.estimator).needs_logits

    @property
    def statistic_needs_logits(self) -> bool:
        return get_kl_estimator_spec(self.statistic).needs_logits

    @property
    def policy_logits_at_scoring(self) -> bool:
        """Whether scoring must run the policy forward for its logits (a logits-based estimator, or a logits-based
        statistic whose generation logits are not kept)."""
        return self.estimator_needs_logits or (self.statistic_needs_logits and not self.keep_generation_logits)

    def describe(self) -> str:
        """One line for the log: where the KL acts, which estimate, which statistic in which unit, the target."""
        target = f", target {self.target:g} per {self.unit}" if self.target is not None else ""
        return f"KL applied in: {self.mode} (estimator {self.estimator}, statistic {self.statistic} per {self.unit}{target})"

    def estimate_from_logits(self, name: str, logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
        """Per-position KL by the logits-based estimator `name` from scaled logits `[..., V]` (`read_response`'s
        `estimates`)."""
        return self.estimate(name, logits=logits, ref_logits=ref_logits)

    def estimate(
        self, name: str, log_ratio=None, old_log_ratio=None, logits=None, ref_logits=None, return_clamped: bool = False
    ):
        """Per-position KL by the estimator `name`, with this run's clamps (`klppo.kl.estimate_kl`): a per-token
        estimator reads the log-ratios `logp - ref_logp` and `logp - old_logp`, a logits-based one the logits."""
        return estimate_kl(
            name,
            log_ratio=log_ratio,
            old_log_ratio=old_log_ratio,
            logits=logits,
            ref_logits=ref_logits,
            chunk_size=self.chunk_size,
            return_clamped=return_clamped,
            log_ratio_clamp=self.log_ratio_clamp,
            value_clamp=self.value_clamp,
        )


def make_kl_plan(
    args,
    policy: torch.nn.Module,
    mixed_precision: bool,
    vocab_size: int,
    compiled_decoding: bool = False,
    decode_reads: bool = True,
) -> KLPlan:
    """The plan of a run from its `KLPPOConfig`, the policy (its weights' dtype), whether accelerate or the
    arguments set mixed precision and whether generation runs a compiled decoding step (a static cache: the scoring
    forward then gives the log-probs, which costs far less than reading them in every compiled step, where a shared
    critic's read of the hidden states would split the compiled graph). `decode_reads` False: the generation engine
    cannot read the trainer's log-probs, values or logits while decoding (vLLM: `GenerationEngine.reads_while_decoding`),
    so scoring computes them all."""
    x = args.experimental
    estimator = get_kl_estimator_spec(args.kl_estimator)
    statistic = get_kl_estimator_spec(x.kl_statistic)
    float32 = not mixed_precision and all(
        p.dtype == torch.float32 for p in policy.parameters() if p.is_floating_point()
    )
    # a rollout's response logits, float32, per process: decided from the configured size, so every process agrees
    logits_bytes = args.local_rollout_batch_size * args.response_length * vocab_size * 4
    fits = logits_bytes <= x.generation_logits_max_mb * 2**20
    read = (
        decode_reads
        and float32
        and not compiled_decoding
        and not estimator.needs_logits
        and (fits or not statistic.needs_logits)
    )
    places, grpo = args.kl_modes_applied, args.advantage_estimator == "grpo"
    return KLPlan(
        estimator=args.kl_estimator,
        statistic=x.kl_statistic,
        places=places,
        unit=args.kl_target_unit,
        log_ratio_clamp=x.kl_log_ratio_clamp,
        value_clamp=args.kl_value_clamp,
        chunk_size=x.full_kl_chunk_size,
        read_while_decoding=read,
        keep_generation_logits=read and statistic.needs_logits and fits,
        mode=args.kl_mode,
        target=args.kl_target,
        guard=x.kl_guard,
        drift_patience=x.kl_drift_patience,
        loss_agg_mode=args.kl_loss_agg_mode,
        loss_scale_by_advantage_std=x.kl_loss_scale == "advantage_std" and not grpo,
        loss_baseline=(
            x.kl_loss_baseline
            and "loss" in places
            and not estimator.needs_logits
            and args.kl_loss_agg_mode != "seq-mean-token-mean"
        ),
        grpo_slope=grpo and "loss" in places,
    )
