"""Clipped PPO losses, per token (aggregation is `klppo.kl.aggregate_loss`), and their logging statistics."""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token.

    Args:
        logp: `[B, T]` log-probs of the current policy (differentiable).
        old_logp: `[B, T]` log-probs of the sampling policy.
        advantages: `[B, T]`.

    Returns:
        `(loss, clipped, log_ratio)`: `loss = max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c))`, a bool mask
        of tokens where the clipped branch was taken, and `logp - old_logp`.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(pg_loss1, pg_loss2), pg_loss2 > pg_loss1, log_ratio


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, per token: `0.5 * max((v - R)^2, (v_clip - R)^2)` with
    `v_clip = old_v + clip(v - old_v, -c, c)`. Returns `(loss, clipped)`."""
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    loss1 = (values - returns) ** 2
    loss2 = (values_clipped - returns) ** 2
    return 0.5 * torch.max(loss1, loss2), loss2 > loss1


def ppo_statistics(entropy, log_ratio, pg_clipped, vf_clipped, mask, share: float, **losses) -> dict:
    """The logging parts `{name: (sum, count)}` of one micro-batch's PPO losses: each loss in `losses` (`policy`,
    `value`: already a mean over the mini-batch) with this micro-batch's `share` of one optimizer step
    (1 / (micro-batches per mini-batch * ranks)), and token sums of the approximate KL to the sampling policy, the
    clipped fractions (`vf_clipped` None: no critic), the entropy (`[B, R]`, of the scaled logits) and the ratio's
    first two moments (`val/ratio_var`)."""
    fmask = mask.to(log_ratio.dtype)
    n_tok, log_ratio = fmask.sum(), log_ratio.detach()
    parts = {f"loss/{name}": (loss.detach(), share) for name, loss in losses.items() if loss is not None}
    parts.update(
        {
            "policy/approxkl": ((0.5 * log_ratio**2 * fmask).sum(), n_tok),
            "policy/clipfrac": ((pg_clipped.to(fmask.dtype) * fmask).sum(), n_tok),
            "policy/entropy": ((entropy.detach() * fmask).sum(), n_tok),
            "val/ratio": ((log_ratio.exp() * fmask).sum(), n_tok),
            "val/ratio_sq": (((2 * log_ratio).exp() * fmask).sum(), n_tok),
        }
    )
    if vf_clipped is not None:
        parts["val/clipfrac"] = ((vf_clipped.to(fmask.dtype) * fmask).sum(), n_tok)
    return parts
