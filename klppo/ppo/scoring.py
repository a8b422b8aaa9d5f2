"""Step 3 of a PPO update: scoring sampled sequences under the policy, the critic and the reference, in chunks of
`rollout_forward_batch_size` sequences, and the per-token KL estimates the rest of the update reads.

`RolloutScorer` is built once by the trainer with everything scoring needs (the KL plan, the reference, the
sampling temperature and suppressed tokens); its methods take the model to run, since the trainer wraps it for
distributed training after it is built.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl.trainer.utils import use_adapter

from .callbacks import timed
from .engines import root_unsharded, unwrap
from ..kl import estimate_kl
from .plan import LOGGED_ESTIMATORS, KLPlan
from .logprobs import position_ids_from_mask, response_logits, response_logprobs, response_positions
from .generation.sampling import Generation
from .steps import Rollout, Sequences


class RolloutScorer:
    """Scores sequences: policy log-probs, values, reference log-probs and the per-token KL estimates.

    Args:
        plan: the run's `KLPlan`.
        accelerator: the trainer's accelerator (unwrapping, timing).
        ref_model: the frozen reference, or None when the reference is the policy with `ref_adapter`
            (`use_adapter_reference`).
        use_adapter_reference: the reference is the policy with its adapter disabled, or with `ref_adapter` active.
        ref_adapter: the adapter the reference runs with (None: adapters disabled).
        temperature: the sampling temperature; every log-prob is scored at it.
        suppressed_ids: token ids never sampled, masked out of every scored log-softmax (or None).
        chunk: sequences per forward pass.
        critic_free: no critic: the values are zeros.
    """

    def __init__(self, plan: KLPlan, accelerator, ref_model, use_adapter_reference: bool, ref_adapter: str | None,
                 temperature: float, suppressed_ids: torch.Tensor | None, chunk: int, critic_free: bool):  # fmt: skip
        self.plan, self.accelerator, self.ref_model = plan, accelerator, ref_model
        self.use_adapter_reference, self.ref_adapter = use_adapter_reference, ref_adapter
        self.temperature, self.suppressed_ids = temperature, suppressed_ids
        self.chunk, self.critic_free = chunk, critic_free

    @torch.no_grad()
    def score(self, model, sequences: Sequences, generated: Generation | None = None, timings: dict | None = None) -> Rollout:
        """The `Rollout` of `sequences`, `chunk` sequences per forward pass of `model` (the actor-critic, wrapped or
        not), for what `generated` (what generation read while decoding) does not give: the policy's log-probs and
        logits as the plan needs them, the critic's values; always the reference's log-probs; then the log-ratio and
        the plan's per-token estimates, all read from one log-ratio."""
        timings = timings if timings is not None else defaultdict(float)
        generated = generated if generated is not None else Generation(sequences.responses)
        acc, plan, unwrapped = self.accelerator, self.plan, unwrap(self.accelerator, model)
        need_policy = generated.logp is None or plan.policy_logits_at_scoring
        need_values = generated.values is None and not self.critic_free
        parts = []
        for start in range(0, sequences.batch_size, self.chunk):
            rows = slice(start, start + self.chunk)
            seq = sequences.select(rows).without_padding_columns()
            qr, attn, resp = seq.query_responses, seq.attention_mask, seq.responses
            pos = position_ids_from_mask(attn)
            logp = None if generated.logp is None else generated.logp[rows]
            logits = None if generated.logits is None else generated.logits[rows]
            values = None
            if need_policy:
                with timed(timings, "time/score_policy", acc):  # a shared critic's values come from this same pass
                    policy_logits, values = model(
                        qr, attention_mask=attn, position_ids=pos, compute_values=need_values and unwrapped.shared,
                        response_length=resp.shape[1],  # the LM head runs on the response's predicting positions only
                    )  # fmt: skip
                    policy_logits = response_logits(policy_logits, resp.shape[1], self.temperature, self.suppressed_ids)
                    logits = policy_logits if logits is None else logits  # the generation's, when it kept them
                    logp = response_logprobs(policy_logits, resp) if logp is None else logp
            if need_values and values is None:
                with timed(timings, "time/score_value", acc), root_unsharded(model):
                    values = unwrapped.critic(qr, attention_mask=attn, position_ids=pos)
            with timed(timings, "time/score_ref", acc):
                ref_logits = self.reference_logits(model, seq)
                ref_logp = response_logprobs(ref_logits, resp)
            with timed(timings, "time/kl", acc):  # the log-ratio once; every estimate reads it
                keep = seq.response_mask.bool()
                zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
                log_ratio = torch.where(keep, logp - ref_logp, zero)
                kl, clamped = plan.estimate(plan.estimator, log_ratio, logits=logits, ref_logits=ref_logits, return_clamped=True)
                statistic = kl if plan.statistic == plan.estimator else plan.estimate(
                    plan.statistic, log_ratio, logits=logits, ref_logits=ref_logits)  # fmt: skip
                logged = torch.stack([estimate_kl(name, log_ratio=log_ratio, log_ratio_clamp=plan.log_ratio_clamp)
                                      for name in LOGGED_ESTIMATORS], dim=-1)  # fmt: skip
            parts.append(dict(
                values=None if values is None else values[:, seq.context_length - 1 : -1].float(), logp=logp,
                ref_logp=ref_logp, log_ratio=log_ratio, kl=torch.where(keep, kl, zero), kl_clamped=clamped & keep,
                statistic_kl=torch.where(keep, statistic, zero), logged_kl=logged,
            ))  # fmt: skip
        scored = {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0] if parts[0][k] is not None}
        if generated.values is not None:
            scored["values"] = generated.values
        if "values" not in scored:  # critic-free advantages: no values (zeros keep the rollout's shape)
            scored["values"] = torch.zeros_like(scored["ref_logp"])
        return Rollout(**vars(sequences.sequences()), **scored)

    def reference_logits(self, model, seq: Sequences) -> torch.Tensor:
        """Temperature-scaled reference logits for the response positions `[B, R, V]`; `model` is the actor-critic
        (the reference is its policy with the adapter disabled, or `ref_model`)."""
        pos = position_ids_from_mask(seq.attention_mask)
        kwargs = dict(
            input_ids=seq.query_responses, attention_mask=seq.attention_mask, position_ids=pos, use_cache=False,
            logits_to_keep=response_positions(seq.responses.shape[1], seq.query_responses.shape[1], pos.device),
        )  # fmt: skip
        if self.use_adapter_reference:
            policy = unwrap(self.accelerator, model).policy
            with use_adapter(policy, self.ref_adapter), root_unsharded(model):  # None: adapters disabled
                logits = policy(**kwargs).logits
        else:
            logits = self.ref_model(**kwargs).logits
        return response_logits(logits, seq.responses.shape[1], self.temperature, self.suppressed_ids)
