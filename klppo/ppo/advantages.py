"""Generalised advantage estimation over response tokens."""

from __future__ import annotations

import torch


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) per token, treating the last response token as terminal.

    Args:
        rewards: `[B, T]` per-token rewards (KL penalty on every token, score on the last one).
        values: `[B, T]` value predictions for the state before each response token.
        mask: `[B, T]` 1 on response tokens, 0 on padding after the stop token.
        gamma, lam: discount and GAE lambda.

    Returns:
        `(advantages, returns)`, both `[B, T]` and zero outside `mask`.

    Naive equivalent, per sequence with `n` valid tokens::

        for t in reversed(range(n)):
            next_v = values[t + 1] if t + 1 < n else 0
            delta = rewards[t] + gamma * next_v - values[t]
            adv[t] = delta + gamma * lam * (adv[t + 1] if t + 1 < n else 0)
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    last = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        next_values = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    returns = (advantages + values) * mask
    return advantages, returns
