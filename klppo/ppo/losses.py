"""Clipped PPO losses (per token; aggregation is `klppo.kl.aggregate_loss`)."""

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


def ppo_losses(logits, logp, values, old_logp, old_values, advantages, returns, mask, num_tokens, share: float, *,
               cliprange: float, cliprange_value: float):  # fmt: skip
    """The clipped policy and value losses of one micro-batch as token means over the mini-batch's global
    `num_tokens`, and their logging parts `{name: (sum, count)}`.

    `logits [B, R, V]` (scaled) only feed the entropy statistic; `share` is this micro-batch's part of one
    optimizer step's logged loss (1 / (micro-batches per mini-batch * ranks)); `cliprange` and `cliprange_value` as
    in `KLPPOConfig`. Returns `(policy_loss, value_loss, parts)`, `value_loss` None when `values` is (no critic).
    """
    from trl.trainer.utils import entropy_from_logits

    from ..kl.penalty import aggregate_loss

    pg_tok, pg_clipped, log_ratio = clipped_policy_loss(logp, old_logp, advantages, cliprange)
    pg_loss = aggregate_loss(pg_tok, mask, "token-mean", num_tokens=num_tokens)
    fmask = mask.to(logp.dtype)
    n_tok = fmask.sum()
    parts = {
        "loss/policy": (pg_loss.detach(), share),
        "policy/approxkl": ((0.5 * log_ratio.detach() ** 2 * fmask).sum(), n_tok),
        "policy/clipfrac": ((pg_clipped.to(fmask.dtype) * fmask).sum(), n_tok),
        "policy/entropy": ((entropy_from_logits(logits.detach()) * fmask).sum(), n_tok),
        # the probability ratio pi / pi_old: its token mean, and its second moment for `val/ratio_var`
        "val/ratio": ((log_ratio.detach().exp() * fmask).sum(), n_tok),
        "val/ratio_sq": (((2 * log_ratio.detach()).exp() * fmask).sum(), n_tok),
    }
    if values is None:  # critic-free advantages: no value loss
        return pg_loss, None, parts
    vf_tok, vf_clipped = clipped_value_loss(values, old_values, returns, cliprange_value)
    vf_loss = aggregate_loss(vf_tok, mask, "token-mean", num_tokens=num_tokens)
    parts["loss/value"] = (vf_loss.detach(), share)
    parts["val/clipfrac"] = ((vf_clipped.to(fmask.dtype) * fmask).sum(), n_tok)
    return pg_loss, vf_loss, parts
