"""The data one PPO update builds, one typed result per step.

`KLPPOTrainer.ppo_update` reads as the steps of the algorithm; each step returns one of these, and the data
between steps travels only in them (the trainer's own state that steps change: the KL controller, the guard and the
drift monitor in `update_controller`, the weights and the optimizer in `optimise`):

    batch    = trainer.prompt_batch(prompts)                  PromptBatch
    rollout  = trainer.rollout(batch)                         Rollout      steps 1-3
    rewards  = trainer.compute_rewards(rollout)               Rewards      step 4
    penalty  = trainer.apply_kl(rollout, rewards)             KLPenalty    step 5
    trainer.update_controller(rollout, rewards, penalty)      its metrics  step 6
    adv      = trainer.compute_advantages(rollout, rewards, penalty)  Advantages  step 7
    result   = trainer.optimise(rollout, adv, kl_reading=penalty.reading)  OptimiseResult  step 8
                                           (the reading is what the KL guard starts from)

Shapes: `B` sequences on this rank, `P` prompt length (left-padded), `R` response length. Every per-sequence
field can be sliced with `select(rows)`, e.g. to give each rank its share of one rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


class _Selectable:
    """`select(rows)`: the same object restricted to some sequences (tensors and lists with a batch dimension)."""

    def select(self, rows):
        n = self.batch_size
        if torch.is_tensor(rows) and rows.dtype == torch.bool:
            rows = rows.nonzero().flatten()
        index = list(range(n))[rows] if isinstance(rows, slice) else [int(i) for i in rows]
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
                picked[f.name] = value[torch.as_tensor(index, device=value.device, dtype=torch.long)]
            elif isinstance(value, list) and len(value) == n:
                picked[f.name] = [value[i] for i in index]
            elif isinstance(value, dict) and f.name == "extra":
                picked[f.name] = {k: [v[i] for i in index] if len(v) == n else v for k, v in value.items()}
        return replace(self, **picked)


@dataclass
class PromptBatch(_Selectable):
    """Prompts of one rollout, tokenized and left-padded."""

    prompts: list  # plain strings or conversational message lists, as given
    input_ids: torch.Tensor  # [B, P]
    attention_mask: torch.Tensor  # [B, P]
    extra: dict = field(default_factory=dict)  # other dataset columns, passed to the reward functions

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Sequences(_Selectable):
    """Step 1-2: prompts with their sampled responses, truncated at the stop token."""

    prompts: list
    extra: dict
    query_responses: torch.Tensor  # [B, P + R] prompt then response token ids
    attention_mask: torch.Tensor  # [B, P + R]
    responses: torch.Tensor  # [B, R], padding after the stop token
    response_mask: torch.Tensor  # [B, R], 1 on response tokens (up to and including the stop token)
    context_length: int  # P
    sampled_finite: bool = True  # False: the sampling policy's logits were not finite (the tokens mean nothing)
    # [B, R] the sampled tokens' log-probs as an inexact engine (vLLM) computed them, 0 outside the mask; None when
    # the engine samples with the trainer's own forward (`GenerationEngine.exact`)
    sampling_logp: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.responses.shape[0]

    def sequences(self) -> Sequences:
        """Only the tokens (drops any scores a subclass holds)."""
        return Sequences(**{f.name: getattr(self, f.name) for f in fields(Sequences)})

    def without_padding_columns(self) -> Sequences:
        """The same sequences (and scores) without the leading columns that are padding in every row, as in a
        micro-batch of a rollout padded to a longer prompt: the same forward passes on fewer positions (attention
        skips padding, and position ids count real tokens only)."""
        real = self.attention_mask[:, : self.context_length].any(dim=0)
        first = int(real.int().argmax())  # every prompt has a token, so some prompt column is real
        if first == 0:
            return self
        return replace(
            self,
            query_responses=self.query_responses[:, first:],
            attention_mask=self.attention_mask[:, first:],
            context_length=self.context_length - first,
        )


@dataclass(kw_only=True)
class Rollout(Sequences):
    """Steps 1-3: the sequences, their scores under the sampling policy, the critic and the reference, and the
    per-token KL they give, computed once (every KL field is 0 outside `response_mask`)."""

    logp: torch.Tensor  # [B, R] log-prob of each response token under the sampling policy
    ref_logp: torch.Tensor  # [B, R] the same under the reference
    values: torch.Tensor  # [B, R] the critic's value before each response token (zeros without a critic)
    log_ratio: torch.Tensor  # [B, R] logp - ref_logp
    kl: torch.Tensor  # [B, R] the configured estimator (`kl_estimator`), what the reward or the loss charges
    kl_clamped: torch.Tensor  # [B, R] bool: tokens where a clamp bounded the estimate
    statistic_kl: torch.Tensor  # [B, R] the controller's estimator (`kl_statistic`)
    logged_kl: torch.Tensor  # [B, R, 3] k1, k2 and k3 (`LOGGED_ESTIMATORS`), each with the log-ratio clamp only
    # [B, R] the truncated importance weights pi_trainer / pi_engine of an inexact engine's tokens (None: exact
    # engine, or the correction is off); the policy loss, a KL loss term, the KL statistic, the guard's readings and
    # the logged KL are weighted by them
    is_weight: torch.Tensor | None = None
    # [B] the same correction for whole sequences: log min(pi_trainer(y) / pi_engine(y), clip), in either mode, which
    # the equilibrium controller's batch is weighted by
    is_log_weight: torch.Tensor | None = None
    sampling_metrics: dict = field(default_factory=dict)  # the engine's drift and the correction's, reduced


@dataclass
class Rewards(_Selectable):
    """Step 4: what the reward functions said."""

    completions: list[str]  # decoded responses
    scores: torch.Tensor  # [B] weighted sum of the reward functions (minus any missing-EOS penalty)
    scorable: torch.Tensor  # [B] bool: some reward function applied (None from all: no policy gradient)
    metrics: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.scores.shape[0]


@dataclass
class KLPenalty:
    """Step 5: the per-token rewards with the KL penalty in them, the coefficient in force and the controller's
    statistic (its reading), before the controller's step."""

    token_rewards: torch.Tensor  # [B, R] -coef * kl in reward mode (else 0), plus the score at the last token
    coef: float  # the coefficient in force for this update, before the controller's step (its next: `kl/coef_next`)
    reading: float  # the controller statistic `kl/value` of this rollout, reduced over all ranks
    finite: bool  # False: the scores or the KL held NaN/inf and the update must be skipped
    metrics: dict = field(default_factory=dict)


@dataclass
class Advantages:
    """Step 7: the advantages (GAE, or critic-free RLOO / GRPO, the same on every token) and returns, and the
    loss-mode KL coefficient."""

    advantages: torch.Tensor  # [B, R]
    returns: torch.Tensor  # [B, R]
    kl_loss_coef: float  # coef, divided by the advantage std unless kl_loss_scale="none"
    metrics: dict = field(default_factory=dict)
    kl_loss_baseline: torch.Tensor | None = None  # [B, 1] b of `kl_loss_baseline` per sequence (None: no baseline)


@dataclass
class OptimiseResult:
    """Step 8: the PPO epochs' statistics and whether a non-finite loss or gradient stopped them."""

    metrics: dict
    skipped: bool  # a non-finite loss or gradient was met: the update is rolled back (or partly applied)
    applied_steps: int  # optimizer steps taken before that
