"""Rollout helpers: generation, stop-token truncation, response masks, log-prob scoring."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from trl.trainer.utils import selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded sequences: `cumsum(mask) - 1`, clamped at 0 on padding. `[B, L]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def truncate_at_stop(
    responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token.

    Args:
        responses: `[B, R]` generated token ids.

    Returns:
        `(responses, mask)`: tokens after the first stop token replaced by `pad_token_id`; `mask [B, R]` is 1
        up to and including the stop token (every token when there is none, or when `stop_token_id` is None).
    """
    positions = torch.arange(responses.shape[1], device=responses.device).expand_as(responses)
    if stop_token_id is None:
        last = torch.full_like(responses[:, 0], responses.shape[1] - 1)
    else:
        is_stop = responses == stop_token_id
        first = torch.where(is_stop, positions, torch.full_like(positions, responses.shape[1]))
        last = first.min(dim=1).values.clamp(max=responses.shape[1] - 1)
    mask = positions <= last.unsqueeze(1)
    return torch.where(mask, responses, torch.full_like(responses, pad_token_id)), mask.long()


def ends_with_stop(responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int | None) -> torch.Tensor:
    """`[B]` bool: whether the last valid token of each response is the stop token."""
    if stop_token_id is None:
        return torch.ones(responses.shape[0], dtype=torch.bool, device=responses.device)
    last = mask.sum(dim=1) - 1
    return responses.gather(1, last.unsqueeze(1)).squeeze(1) == stop_token_id


def make_generation_config(args, tokenizer, stop_token_id: int | None) -> GenerationConfig:
    """Sampling configuration of the rollout: pure temperature sampling (no top-k / top-p), so that the
    sampling distribution is exactly `softmax(logits / T)`, the one that is scored."""
    kwargs = dict(
        max_new_tokens=args.response_length,
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    if stop_token_id is None:
        kwargs["min_new_tokens"] = args.response_length
    else:
        kwargs["eos_token_id"] = stop_token_id
    return GenerationConfig(**kwargs)


@torch.no_grad()
def generate_responses(
    policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: GenerationConfig, chunk: int
) -> torch.Tensor:
    """Sample responses for left-padded prompts in chunks of `chunk` sequences.

    Returns `[B, R]` response ids (R <= `max_new_tokens`), right-padded with the pad token.
    """
    pad = generation_config.pad_token_id
    pieces = []
    for start in range(0, input_ids.shape[0], chunk):
        out = policy.generate(
            input_ids=input_ids[start : start + chunk],
            attention_mask=attention_mask[start : start + chunk],
            generation_config=generation_config,
        )
        pieces.append(out[:, input_ids.shape[1] :])
    width = max(p.shape[1] for p in pieces)
    pieces = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in pieces]
    return torch.cat(pieces, dim=0)


def response_logits(logits: torch.Tensor, response_length: int, temperature: float) -> torch.Tensor:
    """Logits that predict the `response_length` response tokens, scaled by the sampling temperature.

    `logits` is `[B, L, V]` for the whole sequence or `[B, K, V]` with `K >= response_length + 1` (a forward
    pass with `logits_to_keep=response_length + 1`, which skips the LM head on prompt positions); either way
    the result is `[B, response_length, V]`.
    """
    return logits[:, -(response_length + 1) : -1] / temperature


def response_logprobs(scaled_logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Log-probs of `responses [B, R]` under `scaled_logits [B, R, V]` (memory-light log-softmax + gather)."""
    return selective_log_softmax(scaled_logits, responses)
