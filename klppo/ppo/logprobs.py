"""Log-probs of sampled responses from logits: the positions that predict the response, temperature scaling, the
suppressed tokens masked out, and the memory-light log-softmax + gather."""

from __future__ import annotations

import torch
from trl.trainer.utils import selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded sequences: `cumsum(mask) - 1`, clamped at 0 on padding. `[B, L]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_positions(response_length: int, length: int, device) -> torch.Tensor:
    """`logits_to_keep` for a forward pass over `length` positions whose last `response_length` tokens are the
    response: the indices of the positions that predict those tokens, `length - response_length - 1` to
    `length - 2`. The LM head then runs on these positions only: not on the prompt, and not on the last position,
    which predicts past the response.

    An index tensor rather than an int: for an int, transformers' causal LMs run their LM head on
    `hidden_states[:, -n:]`, a strided view that matmul cannot fold into one matrix product; it takes a slower
    batched path (on CPU: timings in `docs/results.md`, "Speed and memory"). And the logits are exactly the
    response's, so no slice of them has to be differentiated (a slice's backward fills a zero gradient of the
    whole logits tensor first).
    """
    if length <= response_length:
        raise ValueError(f"{length} positions cannot hold a prompt and a response of {response_length} tokens.")
    return torch.arange(length - response_length - 1, length - 1, device=device)


def response_logits(
    logits: torch.Tensor, response_length: int, temperature: float, suppressed: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits that predict the `response_length` response tokens, scaled by the sampling temperature, with
    the `suppressed` token ids (never sampled) masked out.

    `logits` is `[B, response_length, V]`, from a forward pass with `logits_to_keep=response_positions(...)`
    (the LM head on the predicting positions only), or `[B, L, V]` for the whole sequence of `L >
    response_length` positions; either way the result is `[B, response_length, V]`.
    """
    if logits.shape[1] != response_length:
        logits = logits[:, -(response_length + 1) : -1]
    if temperature == 1.0:
        return mask_suppressed(logits, suppressed)
    return mask_suppressed(logits / temperature, suppressed, inplace=True)  # the quotient is a new tensor


def mask_suppressed(scaled_logits: torch.Tensor, suppressed: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
    """`scaled_logits [..., V]` with the `suppressed` ids set to the dtype's lowest finite value: their
    probability is exactly 0 after softmax, and entropy / full-vocabulary KL stay finite (a `-inf` would
    give `0 * inf`). Differentiable; out of place unless `inplace` (for a tensor the caller has just made, which
    spares a copy of the logits); no-op when `suppressed` is None or empty."""
    if suppressed is None or suppressed.numel() == 0:
        return scaled_logits
    fill = scaled_logits.index_fill_ if inplace else scaled_logits.index_fill
    return fill(-1, suppressed.to(scaled_logits.device), torch.finfo(scaled_logits.dtype).min)


def response_logprobs(scaled_logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Log-probs of `responses [B, R]` under `scaled_logits [B, R, V]` (memory-light log-softmax + gather)."""
    return selective_log_softmax(scaled_logits, responses)
