"""Advantage estimators: GAE over response tokens (with a critic) and the critic-free RLOO and GRPO."""

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


# ---------------------------------------------------------------------- critic-free estimators
# Both take one return per sequence, `[B]`, with the `num_generations` responses to one prompt in consecutive rows
# (rows `g * G .. g * G + G - 1` form group g), and give one advantage per sequence, `[B]`, which the trainer
# broadcasts to every response token. The return is the sequence-level RLHF reward: the score plus the summed
# per-token KL rewards in reward mode (`-beta * kl_t`), the score alone otherwise.

GRPO_STD_EPS = 1e-4  # TRL's GRPO adds the same to the group std


def _groups(returns: torch.Tensor, num_generations: int) -> torch.Tensor:
    if returns.dim() != 1 or returns.shape[0] % num_generations:
        raise ValueError(
            f"Expected a [B] tensor of returns with B a multiple of num_generations={num_generations}, got shape "
            f"{tuple(returns.shape)}."
        )
    return returns.view(-1, num_generations)


def rloo_advantages(returns: torch.Tensor, num_generations: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each return minus the mean of the other
    `num_generations - 1` returns of its prompt.

    Args:
        returns: `[B]` sequence returns, groups of `num_generations` consecutive rows.
        num_generations: responses per prompt, `G >= 2`.

    Returns:
        `[B]` advantages, `A_i = R_i - (sum_g R - R_i) / (G - 1) = G / (G - 1) * (R_i - mean_g R)`. The baseline does
        not depend on sample i, so `E[A_i * grad log pi(y_i)] = grad E[R]`: an unbiased policy gradient with
        coefficient 1 (no critic, no bias from one).

    Naive equivalent::

        for i in range(B):
            group = range(i // G * G, i // G * G + G)
            adv[i] = R[i] - sum(R[j] for j in group if j != i) / (G - 1)
    """
    if num_generations < 2:
        raise ValueError(f"RLOO needs num_generations >= 2 (a leave-one-out baseline), got {num_generations}.")
    grouped = _groups(returns, num_generations)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return (grouped - baseline).reshape(-1)


def grpo_advantages(returns: torch.Tensor, num_generations: int, eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """GRPO's group-normalised advantages (Shao et al. 2024): `(R_i - mean_g R) / (std_g R + eps)`, with the
    unbiased (Bessel-corrected) std of the group, as TRL's GRPOTrainer computes it (`scale_rewards="group"`).

    Args:
        returns: `[B]` sequence returns, groups of `num_generations` consecutive rows.
        num_generations: responses per prompt, `G >= 2`.
        eps: added to the std; a group whose returns are all equal gets advantage 0.

    Returns:
        `[B]` advantages.

    The division rescales each prompt's reward by a number that depends on the policy (and on the group size), so
    the objective is not `E[r] - beta * KL` any more. With the KL in the loss (TRL's GRPO) the fixed point is not
    `ref * exp(r / beta) / Z` but the optimum for the reward `Delta * r` (`advantage_slope`), whose strength moves
    with the policy's own reward spread: for `k2` and a 0/1 reward of probability q, `ref * exp(r * Delta_G(q) /
    beta) / Z` with `Delta_G(q) = E[A | r = 1] - E[A | r = 0]` (`tests/test_convergence_critic_free.py`).
    With k1 in the reward the whole return `r - beta * KL` is divided by a positive number per group, and
    `ref * exp(r / beta) / Z` stays a fixed point (the return is the same for every response there); the
    normalised advantages keep unit scale next to it, so the steps do not shrink as the policy nears it.

    Naive equivalent::

        for i in range(B):
            group = [R[j] for j in range(i // G * G, i // G * G + G)]
            adv[i] = (R[i] - mean(group)) / (statistics.stdev(group) + eps)
    """
    if num_generations < 2:
        raise ValueError(f"GRPO needs num_generations >= 2 (a group std), got {num_generations}.")
    grouped = _groups(returns, num_generations)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + eps)).reshape(-1)


def advantage_slope(advantages: torch.Tensor, rewards: torch.Tensor, group: int) -> float:
    """How much GRPO's advantage rises per unit of reward, on average: `Delta = sum_i A_i r_i / (G * sum_g s_g^2)`
    from `[B]` advantages and rewards, `s_g^2` the unbiased variance of group g's rewards (groups of `group`
    consecutive rows).

    Where the expected advantage of a completion is `Delta * (r - mean)` within its prompt (exactly so for a 0/1
    reward, GRPO's `Delta_G(q)`), `E[sum_i A_i r_i] = G * Delta * var`, and `E[s_g^2] = var`: the ratio estimates
    `Delta` pooled over prompts. (Regressing A on `r - group mean` would give `Delta * G / (G - 1)`, as each group's
    own mean moves with its rewards.) GRPO's loss follows the policy gradient of `E[Delta * r]`, so its fixed point
    is the KL's optimum for the reward `Delta * r`. A group with a NaN reward is left out; 0 if no group varies."""
    a, r = _groups(advantages.double(), group), _groups(rewards.double(), group)
    keep = torch.isfinite(r).all(dim=1)
    a, r = a[keep], r[keep]
    spread = r.var(dim=1).sum() if r.shape[0] else r.new_zeros(())
    return float((a * r).sum() / (group * spread)) if spread > 0 else 0.0


CRITIC_FREE_ADVANTAGES = {"rloo": rloo_advantages, "grpo": grpo_advantages}


def sequence_advantages(estimator: str, returns: torch.Tensor, num_generations: int) -> torch.Tensor:
    """`[B]` advantages of a critic-free `estimator` ("rloo" or "grpo") from `[B]` sequence returns."""
    try:
        fn = CRITIC_FREE_ADVANTAGES[estimator]
    except KeyError:
        raise ValueError(
            f"No critic-free advantage estimator {estimator!r}; choose one of {sorted(CRITIC_FREE_ADVANTAGES)}."
        ) from None
    return fn(returns, num_generations)
