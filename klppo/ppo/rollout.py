"""Rollout helpers: generation, stop-token truncation, response masks, log-prob scoring."""

from __future__ import annotations

import copy

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
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    chunk: int,
    temperature: float | None = None,
    value_head=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sample responses for left-padded prompts in chunks of `chunk` sequences.

    With `temperature`, the log-probs of the sampled tokens under `softmax(logits / temperature)` are read
    from the generation's own logits, so scoring needs no second policy forward pass; with `value_head` too,
    the values of the states before each token come from the generation's last hidden states (a shared
    critic). Full-vocabulary logits exist for one chunk at a time.

    Returns:
        `(responses [B, R], logp [B, R] or None, values [B, R] or None)`, right-padded (pad token / 0),
        R <= `max_new_tokens`.
    """
    pad = generation_config.pad_token_id
    with_scores = temperature is not None
    generation_config = copy.deepcopy(generation_config)
    generation_config.return_dict_in_generate = True
    generation_config.output_logits = with_scores
    generation_config.output_hidden_states = with_scores and value_head is not None
    pieces, logps, values = [], [], []
    for start in range(0, input_ids.shape[0], chunk):
        out = policy.generate(
            input_ids=input_ids[start : start + chunk],
            attention_mask=attention_mask[start : start + chunk],
            generation_config=generation_config,
        )
        tokens = out.sequences[:, input_ids.shape[1] :]
        pieces.append(tokens)
        if with_scores:
            step_logits = torch.stack(out.logits, dim=1)  # [b, R, V], unprocessed
            logps.append(response_logprobs(step_logits / temperature, tokens))
            del step_logits
            if value_head is not None:
                # the last layer's state at the last position of every step: the state before each token
                last = torch.stack([step[-1][:, -1] for step in out.hidden_states], dim=1)
                values.append(value_head(last).float())
        del out

    def cat(parts, value):
        width = max(p.shape[1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts], dim=0)

    return cat(pieces, pad), cat(logps, 0.0) if logps else None, cat(values, 0.0) if values else None


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
