"""Step 3 of a PPO update: scoring sampled sequences under the policy, the critic and the reference, in chunks of
`rollout_forward_batch_size` sequences, and the per-token KL estimates the rest of the update reads.

`RolloutScorer` is built once by the trainer with everything scoring needs (the KL plan, the reference, the
sampling temperature and suppressed tokens); its methods take the model to run, since the trainer wraps it for
distributed training after it is built.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from trl.trainer.utils import use_adapter

from ...kl import estimate_kl, get_kl_estimator_spec
from ..actor_critic import _same_logits, last_hidden_states, lm_head_of
from ..distributed import root_unsharded, unshard_again, unwrap
from ..generation.sampling import Generation
from ..plan import LOGGED_ESTIMATORS, KLPlan
from ..results import Rollout, Sequences
from ..run.callbacks import timed
from .logprobs import ResponseLogits, position_ids_from_mask, read_response, response_positions


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
        logits_block_mb: MiB of float32 logits made at once (`read_response`): the LM heads run on blocks of
            response positions, and only per-token results are kept.
    """

    def __init__(
        self,
        plan: KLPlan,
        accelerator,
        ref_model,
        use_adapter_reference: bool,
        ref_adapter: str | None,
        temperature: float,
        suppressed_ids: torch.Tensor | None,
        chunk: int,
        critic_free: bool,
        logits_block_mb: float = 64.0,
    ):
        self.plan, self.accelerator, self.ref_model = plan, accelerator, ref_model
        self.use_adapter_reference, self.ref_adapter = use_adapter_reference, ref_adapter
        self.temperature, self.suppressed_ids = temperature, suppressed_ids
        self.chunk, self.critic_free, self.logits_block_mb = chunk, critic_free, logits_block_mb
        self.head_reads_hidden: dict[int, bool] = {}  # per reference model: `ActorCritic.head_reads_hidden`'s check

    @torch.no_grad()
    def score(
        self, model, sequences: Sequences, generated: Generation | None = None, timings: dict | None = None
    ) -> Rollout:
        """The `Rollout` of `sequences`, `chunk` sequences per forward pass of `model` (the actor-critic, wrapped or
        not), for what `generated` (what generation read while decoding) does not give: the policy's log-probs and
        logits as the plan needs them, the critic's values; always the reference's log-probs; then the log-ratio and
        the plan's per-token estimates, all read from one log-ratio."""
        timings = timings if timings is not None else defaultdict(float)
        generated = generated if generated is not None else Generation(sequences.responses)
        acc, plan, unwrapped = self.accelerator, self.plan, unwrap(self.accelerator, model)
        need_policy = generated.logp is None or plan.policy_logits_at_scoring
        need_values = generated.values is None and not self.critic_free
        logits_estimates = {
            name: partial(plan.estimate_from_logits, name)
            for name in dict.fromkeys((plan.estimator, plan.statistic))
            if get_kl_estimator_spec(name).needs_logits
        }
        parts = []
        for start in range(0, sequences.batch_size, self.chunk):
            rows = slice(start, start + self.chunk)
            seq = sequences.select(rows).without_padding_columns()
            qr, attn, resp = seq.query_responses, seq.attention_mask, seq.responses
            pos = position_ids_from_mask(attn)
            logp = None if generated.logp is None else generated.logp[rows]
            policy = (
                None if generated.logits is None else ResponseLogits.from_logits(generated.logits[rows], scaled=True)
            )
            values = None
            if need_policy:
                with timed(timings, "time/score_policy", acc):  # a shared critic's values come from this same pass
                    source, values = model(
                        qr,
                        attention_mask=attn,
                        position_ids=pos,
                        compute_values=need_values and unwrapped.shared,
                        response_length=resp.shape[1],
                        read=lambda source: source,  # the head in blocks, below
                    )
                    policy = source if policy is None else policy  # the generation's logits, when it kept them
                    if logp is None and not (logits_estimates and policy is source):
                        with self.unsharded(model):
                            logp = self.read(source, resp)["logp"]
            if need_values and values is None:
                with timed(timings, "time/score_value", acc), root_unsharded(model):
                    values = unwrapped.critic(qr, attention_mask=attn, position_ids=pos)
            with timed(timings, "time/score_ref", acc), self.unsharded(model):
                reference = self.reference_source(model, seq)
                from_logits = {}
                if logits_estimates:  # the policy's and the reference's logits, one block of positions at a time
                    from_logits = self.read(policy, resp, reference=reference, estimates=logits_estimates)
                    logp = from_logits["logp"] if logp is None else logp
                    ref_logp = from_logits["ref_logp"]
                else:
                    ref_logp = self.read(reference, resp)["logp"]
            with timed(timings, "time/kl", acc):  # the log-ratio once; every estimate reads it
                keep = seq.response_mask.bool()
                zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
                log_ratio = torch.where(keep, logp - ref_logp, zero)
                if plan.estimator in from_logits:
                    kl = from_logits[plan.estimator]
                    clamped = torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)
                else:
                    kl, clamped = plan.estimate(plan.estimator, log_ratio, return_clamped=True)
                statistic = (
                    kl
                    if plan.statistic == plan.estimator
                    else (
                        from_logits[plan.statistic]
                        if plan.statistic in from_logits
                        else plan.estimate(plan.statistic, log_ratio)
                    )
                )
                logged = torch.stack(
                    [
                        estimate_kl(name, log_ratio=log_ratio, log_ratio_clamp=plan.log_ratio_clamp)
                        for name in LOGGED_ESTIMATORS
                    ],
                    dim=-1,
                )
            parts.append(
                dict(
                    values=None if values is None else values[:, seq.context_length - 1 : -1].float(),
                    logp=logp,
                    ref_logp=ref_logp,
                    log_ratio=log_ratio,
                    kl=torch.where(keep, kl, zero),
                    kl_clamped=clamped & keep,
                    statistic_kl=torch.where(keep, statistic, zero),
                    logged_kl=logged,
                )
            )
        scored = {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0] if parts[0][k] is not None}
        if generated.values is not None:
            scored["values"] = generated.values
        if "values" not in scored:  # critic-free advantages: no values (zeros keep the rollout's shape)
            scored["values"] = torch.zeros_like(scored["ref_logp"])
        return Rollout(**vars(sequences.sequences()), **scored)

    def read(self, source: ResponseLogits, responses: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        """`read_response` with this run's temperature, suppressed ids and block size."""
        return read_response(source, responses, self.temperature, self.suppressed_ids, self.logits_block_mb, **kwargs)

    def reference_source(self, model, seq: Sequences, whole: bool = False) -> ResponseLogits:
        """The reference's logits at the response positions of `seq`, as a `ResponseLogits` of its last hidden states
        `[B, R, H]` and its LM head (no `[B, R, V]` tensor), or with `whole` of its logits `[B, R, V]`; `model` is the
        actor-critic (the reference is its policy with the adapter disabled, or `ref_model`). Its head is read
        inside `self.unsharded(model)`."""
        pos = position_ids_from_mask(seq.attention_mask)
        positions = response_positions(seq.responses.shape[1], seq.query_responses.shape[1], pos.device)
        kwargs = dict(
            input_ids=seq.query_responses,
            attention_mask=seq.attention_mask,
            position_ids=pos,
            use_cache=False,
            logits_to_keep=positions if whole else positions[-1:],
        )
        if self.use_adapter_reference:
            policy = unwrap(self.accelerator, model).policy
            context = partial(use_adapter, policy, self.ref_adapter)  # None: adapters disabled
        else:
            policy, context = self.ref_model, nullcontext
        with self.unsharded(model):
            if whole or self.head_reads_hidden.get(id(policy)) is False:  # the model's own logits at every position
                with context():
                    return ResponseLogits.from_logits(policy(**{**kwargs, "logits_to_keep": positions}).logits)
            with context(), last_hidden_states(policy) as hidden:
                logits = policy(**kwargs).logits
            if self.ref_model is not None:
                unshard_again(self.ref_model)  # its forward resharded its root: its head is read below
            states = hidden[-1].index_select(1, positions)
            head = lm_head_of(policy)
            if self.head_reads_hidden.get(id(policy)) is None:
                with context():
                    self.head_reads_hidden[id(policy)] = _same_logits(head(states[:, -1:]), logits, policy)
                if not self.head_reads_hidden[id(policy)]:
                    return self.reference_source(model, seq, whole=True)

        def reference_head(hidden: torch.Tensor) -> torch.Tensor:
            with context():
                return head(hidden)

        return ResponseLogits.from_hidden(states, reference_head, logits.shape[-1])

    @contextmanager
    def unsharded(self, model):
        """FSDP2's root units of the actor-critic `model` and of the reference whole inside the block
        (`root_unsharded`): for the forwards that do not enter through a root and the LM heads run on hidden
        states."""
        with root_unsharded(model), root_unsharded(self.ref_model) if self.ref_model is not None else nullcontext():
            yield

    def reference_logprobs(self, model, seq: Sequences) -> torch.Tensor:
        """The reference's log-probs of the responses of `seq`, `[B, R]`."""
        with self.unsharded(model):
            return self.read(self.reference_source(model, seq), seq.responses)["logp"]
