"""Step 3 of a PPO update for `KLPPOTrainer`: scoring the sampled sequences under the policy, the critic and the
reference, in chunks of `rollout_forward_batch_size` sequences, and the form the policy samples in."""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from trl.trainer.utils import use_adapter

from ..kl import estimate_kl
from .callbacks import timed
from .engines import root_unsharded
from .rollout import (
    contiguous_lm_head_input,
    merged_lora,
    position_ids_from_mask,
    response_logits,
    response_logprobs,
    response_positions,
)
from .steps import Rollout, Sequences


class ScoringMixin:
    """`score` and `reference_logits` for `KLPPOTrainer`, with what decides how the rollout is scored."""

    @functools.cached_property
    def logprobs_from_generation(self) -> bool:
        """Whether the sampling policy's log-probs (and a shared critic's values) are read from generation rather
        than from a second forward pass: only when the policy computes in float32. In bfloat16 the KV-cache path
        and a full forward differ by up to 0.32 nats on a token, 0.04 on average (SmolLM2 on CPU, `results/bf16_logprobs`), which would
        make the first mini-batch's ratio far from 1, so they are recomputed, as TRL did."""
        policy = self.accelerator.unwrap_model(self.model_wrapped).policy
        # mixed precision set by the arguments or by accelerate (`mixed_precision` in an accelerate config file)
        mixed = self.args.bf16 or self.args.fp16 or self.accelerator.mixed_precision != "no"
        return not mixed and all(p.dtype == torch.float32 for p in policy.parameters() if p.is_floating_point())

    @contextmanager
    def _sampling_form(self, policy):
        """The policy as it samples: the LM head's input made contiguous (generation's first step); a LoRA adapter
        merged into copies of the base weights (`merge_adapter_for_generation`), except under DeepSpeed or FSDP,
        whose sharded parameters are not plain tensors to copy."""
        merge = self.args.merge_adapter_for_generation and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        merge = merge and self.static_caches is None  # a compiled decoding step keeps reading the same weight tensors
        with contiguous_lm_head_input(policy), merged_lora(policy) if merge else nullcontext():
            yield

    def _generation_logits_fit(self) -> bool:
        """Whether the generation's logits of a whole rollout (float32) stay within `generation_logits_max_mb`.
        Decided from the configured per-process rollout size, so every process takes the same path (evaluation
        may sample fewer rows on some processes)."""
        config = self.accelerator.unwrap_model(self.model_wrapped).policy.config
        vocab = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
        size = self.args.local_rollout_batch_size * self.args.response_length * vocab * 4
        return size <= self.args.generation_logits_max_mb * 2**20

    @torch.no_grad()
    def score(self, sequences: Sequences, logp=None, values=None, timings: dict | None = None,
              policy_logits: torch.Tensor | None = None) -> Rollout:  # fmt: skip
        """Step 3: forward passes in chunks of `rollout_forward_batch_size` sequences for what is not given: the
        policy's log-probs (`logp`), the critic's values (`values`); always the reference's log-probs.
        `policy_logits` (the generation's scaled logits `[B, R, V]`) feed a logits-based statistic."""
        timings = timings if timings is not None else defaultdict(float)
        chunk = self.args.rollout_forward_batch_size
        need_policy = logp is None or (self.kl_statistic_spec.needs_logits and policy_logits is None)
        need_values = values is None and not self.args.critic_free
        parts = [
            self._score_chunk(sequences.select(slice(i, i + chunk)), need_policy, need_values, timings,
                              None if policy_logits is None else policy_logits[i : i + chunk])  # fmt: skip
            for i in range(0, sequences.batch_size, chunk)
        ]
        scored = {k: torch.cat([p[k] for p in parts], dim=0) if parts[0][k] is not None else None for k in parts[0]}
        scored["logp"] = logp if logp is not None else scored["logp"]
        scored["values"] = values if values is not None else scored["values"]
        if scored["values"] is None:  # critic-free advantages: no values (zeros keep the rollout's shape)
            scored["values"] = torch.zeros_like(scored["ref_logp"])
        return Rollout(**vars(sequences.sequences()), **scored)

    def _score_chunk(self, seq: Sequences, need_policy: bool, need_values: bool, timings: dict,
                     policy_logits: torch.Tensor | None = None) -> dict:  # fmt: skip
        acc, args = self.accelerator, self.args
        unwrapped = acc.unwrap_model(self.model_wrapped)
        qr, attn, resp = seq.query_responses, seq.attention_mask, seq.responses
        pos = position_ids_from_mask(attn)
        out = dict(logp=None, values=None, ref_logp=None, logits_kl=None, statistic_kl=None)
        logits = values = None
        if need_policy:
            with timed(timings, "time/score_policy", acc):  # a shared critic's values come from this same pass
                logits, values = self.model_wrapped(
                    qr, attention_mask=attn, position_ids=pos, compute_values=need_values and unwrapped.shared,
                    response_length=resp.shape[1],  # the LM head runs on the response's predicting positions only
                )  # fmt: skip
                logits = response_logits(logits, resp.shape[1], args.temperature, self.suppressed_ids)
                out["logp"] = response_logprobs(logits, resp)
        if need_values:
            if values is None:
                with timed(timings, "time/score_value", acc), root_unsharded(self.model_wrapped):
                    values = unwrapped.critic(qr, attention_mask=attn, position_ids=pos)
            out["values"] = values[:, seq.context_length - 1 : -1].float()
        with timed(timings, "time/score_ref", acc):
            ref_logits = self.reference_logits(seq)
            out["ref_logp"] = response_logprobs(ref_logits, resp)
        with timed(timings, "time/kl", acc):
            if self.kl_estimator.needs_logits:
                out["logits_kl"] = self._estimate_kl(logits=logits, ref_logits=ref_logits)
            if self.kl_statistic_spec.needs_logits and args.kl_statistic != args.kl_estimator:
                logits = policy_logits if logits is None else logits  # the generation's, when not scored here
                out["statistic_kl"] = estimate_kl(
                    args.kl_statistic, logits=logits, ref_logits=ref_logits, chunk_size=args.full_kl_chunk_size
                )
        return out

    def reference_logits(self, seq: Sequences) -> torch.Tensor:
        """Temperature-scaled reference logits for the response positions `[B, R, V]`."""
        pos = position_ids_from_mask(seq.attention_mask)
        kwargs = dict(
            input_ids=seq.query_responses, attention_mask=seq.attention_mask, position_ids=pos, use_cache=False,
            logits_to_keep=response_positions(seq.responses.shape[1], seq.query_responses.shape[1], pos.device),
        )  # fmt: skip
        if self.use_adapter_reference:
            policy = self.accelerator.unwrap_model(self.model_wrapped).policy
            with use_adapter(policy, self.ref_adapter_name), root_unsharded(self.model_wrapped):  # None: adapters disabled
                logits = policy(**kwargs).logits
        else:
            logits = self.ref_model(**kwargs).logits
        return response_logits(logits, seq.responses.shape[1], self.args.temperature, self.suppressed_ids)
