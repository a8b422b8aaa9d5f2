"""The generation seam: what the rollout asks of an engine, whichever decodes.

A `GenerationEngine` takes a batch of left-padded prompts and gives back `Sampled`: the `Sequences` (responses cut at
the stop token, their masks, and the sampling policy's per-token log-probs as the engine computed them), with what
the engine read while decoding (`Generation`: the trainer's own log-probs, a shared critic's values, kept logits,
where the engine decodes with the trainer's own forward). An engine that decodes from its own copy of the weights
(`holds_weights`) is given the policy's weights at the start of every rollout (`sync_weights`), so it samples from
the policy that the last update left. Two engines implement it:

- `GenerateEngine` (`hf.py`): transformers' `generate` on the trainer's own model, with the dynamic KV cache or a
  compiled step over a static one (`static_cache.py`); its sampling distribution is the trainer's, so nothing is
  corrected and its sync is a no-op.
- `VLLMEngine` (`vllm.py`): a vLLM engine colocated in each training process; its weights are a copy, loaded after
  every update, and its numerics differ from the trainer's forward: the rollout scores the responses with the
  trainer's forward and corrects the difference by truncated importance sampling (`correction.py`).

The trainer calls, per rollout::

    engine.sync_weights(model_wrapped)              # a no-op unless the engine holds a copy of the weights
    with engine.generating(model_wrapped) as model: # the model to score with (ZeRO-3: the gathered one)
        sampled = engine.generate(batch, plan)      # Sampled(sequences, generated)
        rollout = scorer.score(model, sampled.sequences, sampled.generated)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..results import PromptBatch, Sequences
from .sampling import Generation, truncate_at_stop


class Sampled(NamedTuple):
    """What an engine returns for one batch of prompts: the sequences (with `sampling_logp` when the engine's own
    log-probs are not the trainer's) and what it read while decoding (`Generation`, tokens cut at the stop token;
    `logp` only when it is the trainer's own)."""

    sequences: Sequences
    generated: Generation


class GenerationEngine:
    """The interface the rollout calls (see the module's docstring).

    Attributes:
        name: the engine's name (`"generate"`, `"vllm"`).
        exact: its sampling distribution is the trainer's forward at the same weights (no correction applies).
        reads_while_decoding: it can read the trainer's log-probs, values and logits while decoding (the KL plan's
            `read_while_decoding`); False: scoring computes them.
        compiled: the decoding step is compiled (a static cache).
        holds_weights: it decodes from a copy of the weights that `sync_weights` refreshes.
        stop_token_id: the token that ends a response, or None (fixed length).
        suppressed_ids: token ids never sampled (a tensor), or None.
        accelerator: the run's `Accelerator` (each engine sets it).
    """

    name = "engine"
    exact = True
    reads_while_decoding = True
    compiled = False
    holds_weights = False
    stop_token_id: int | None = None
    suppressed_ids: torch.Tensor | None = None

    @contextmanager
    def generating(self, model_wrapped):
        """Around one rollout: yields the model the rollout scores with."""
        yield model_wrapped

    def generate(self, batch: PromptBatch, plan) -> Sampled:
        raise NotImplementedError

    @contextmanager
    def unwrapped(self, model_wrapped):
        """The actor-critic whole on this rank, to call `generate` on outside a rollout (TRL's
        `unwrap_model_for_generation`: ZeRO-3 gathers the weights)."""
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(model_wrapped, self.accelerator) as model:
            yield model

    def sync_weights(self, model_wrapped) -> dict[str, float]:
        """Load the policy's current weights into the engine; returns what to log (nothing by default)."""
        return {}

    def shutdown(self) -> None:
        """Free what the engine holds (a no-op by default)."""

    def sequences(
        self,
        batch: PromptBatch,
        tokens: torch.Tensor,
        pad_token_id: int,
        finite: bool = True,
        sampling_logp: torch.Tensor | None = None,
    ) -> Sequences:
        """`Sequences` of `batch`'s prompts and the raw sampled `tokens [B, R]` (right-padded), cut after the stop
        token; `sampling_logp [B, R]` (the engine's log-probs of the tokens) is zeroed outside the response mask."""
        responses, mask = truncate_at_stop(tokens, self.stop_token_id, pad_token_id)
        if sampling_logp is not None:
            sampling_logp = torch.where(mask.bool(), sampling_logp.to(tokens.device).float(), 0.0)
        return Sequences(
            prompts=batch.prompts,
            extra=batch.extra,
            query_responses=torch.cat([batch.input_ids, responses], dim=1),
            attention_mask=torch.cat([batch.attention_mask, mask], dim=1),
            responses=responses,
            response_mask=mask,
            context_length=batch.input_ids.shape[1],
            sampled_finite=finite,
            sampling_logp=sampling_logp,
        )
