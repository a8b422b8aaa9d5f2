"""KL into the rewards (reward mode) or into the loss (loss mode), and loss aggregation.

Reward mode: ``rewards_t = -beta * kl_t`` per response token (detached), the task score is added at
the last token, and the return / advantage (GAE) carries the penalty back to earlier tokens.
Loss mode: ``beta * aggregate(kl)`` is added to the policy loss and backpropagated through the
estimator. Which gradient each estimator then gives is listed in ``klppo.kl.divergence``.

Aggregation across data-parallel ranks and gradient-accumulation steps
----------------------------------------------------------------------
DDP averages gradients over ranks, and accumulation sums (or averages) over micro-batches. A
per-micro-batch mean (``sum / local count``) therefore weights every micro-batch equally, whatever
its number of tokens: the result is a mean of means, not the mean over the mini-batch. To get the
exact global mean, pass the GLOBAL counts of the whole mini-batch (all ranks, all accumulation
steps) as ``num_tokens`` / ``num_seqs`` and scale the loss so that the framework's averaging is
undone: with DDP averaging over ``W`` ranks and ``A`` accumulation steps whose losses are divided by
``A``, multiply each micro-batch loss by ``W * A``; equivalently, the sum over all micro-batches of
``aggregate_loss(values, mask, num_tokens=global_count)`` is exactly the global token mean. (The
same remark is in OpenRLHF's loss code; verl passes ``global_batch_info`` for the same reason.)
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["KL_MODES", "KL_PLACES", "LOSS_AGG_MODES", "aggregate_loss", "kl_reward", "kl_loss"]

# Where the KL term can act, and what each `kl_mode` applies.
KL_PLACES = ("reward", "loss")
KL_MODES = {"reward": ("reward",), "loss": ("loss",), "both": ("reward", "loss"), "none": ()}

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = Union[int, float, torch.Tensor, None]


def _count(value: Count, default: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A count as a tensor in ``like``'s dtype; values below 1 become 1 (an empty mask gives 0)."""
    count = default if value is None else torch.as_tensor(value)
    return count.to(dtype=like.dtype, device=like.device).clamp(min=1)


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_len: Optional[int] = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` ``[B, T]`` under ``mask`` ``[B, T]`` to a scalar loss.

    Modes (``m`` = mask, ``n_b = sum_t m[b, t]``):
        token-mean: ``sum_{b,t} v*m / num_tokens`` (default ``num_tokens = sum m``).
        seq-mean-token-sum: ``sum_b (sum_t v*m) / num_seqs`` (default ``num_seqs = B``).
        seq-mean-token-mean: ``sum_b (sum_t v*m / n_b) / num_seqs``.
        seq-mean-token-sum-norm: ``sum_{b,t} v*m / (num_seqs * norm_len)``, ``norm_len`` a constant
            (required): the maximum response length, as in Dr. GRPO and verl. Not the padded width
            ``T``, which changes with the longest response of each batch.

    ``num_tokens`` / ``num_seqs`` may be global counts (all ranks, the whole mini-batch); see the
    module docstring for why. Fully masked rows count as sequences (with zero loss) in the default
    ``num_seqs``. Positions outside the mask are ignored, even if they hold NaN or inf. Counts below
    1 are treated as 1, so an empty mask gives 0, not NaN.

    Naive equivalent of ``seq-mean-token-mean``::

        sum(sum(v[b, t] for t if m[b, t]) / max(n_b, 1) for b in range(B)) / num_seqs
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values and mask must both be [B, T], got {tuple(values.shape)} and {tuple(mask.shape)}")
    keep = mask.bool()
    masked = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    weights = keep.to(values.dtype)
    if mode == "token-mean":
        return masked.sum() / _count(num_tokens, weights.sum(), values)
    n_seqs = _count(num_seqs, torch.tensor(values.shape[0]), values)
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / n_seqs
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / weights.sum(-1).clamp(min=1)
        return per_seq.sum() / n_seqs
    if norm_len is None:
        raise ValueError(
            "seq-mean-token-sum-norm divides by a constant: pass norm_len, the maximum response length "
            "(`response_length`)."
        )
    return masked.sum() / (n_seqs * _count(norm_len, None, values))


def kl_reward(kl: torch.Tensor, mask: torch.Tensor, coef: Union[float, torch.Tensor]) -> torch.Tensor:
    """Per-token KL rewards ``-coef * kl`` ``[B, T]``, zero outside ``mask``, detached.

    ``kl`` ``[B, T]`` per-token estimate (its gradient is dropped: in reward mode the penalty
    reaches the policy through the advantage only); ``coef``: beta (float or 0-dim tensor).
    """
    kl = kl.detach()
    coef = coef.detach() if torch.is_tensor(coef) else coef
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    return torch.where(mask.bool(), -coef * kl, zero)


def kl_loss(
    kl: torch.Tensor,
    mask: torch.Tensor,
    coef: Union[float, torch.Tensor],
    mode: str = "token-mean",
    **counts,
) -> torch.Tensor:
    """Loss-mode KL term: ``coef * aggregate_loss(kl, mask, mode, **counts)`` (a 0-dim tensor).

    ``kl`` ``[B, T]`` must carry the gradient (from ``compute_kl`` with a non-detached ``logp``);
    ``counts``: ``num_tokens``, ``num_seqs``, ``norm_len`` as in ``aggregate_loss``.
    """
    return coef * aggregate_loss(kl, mask, mode, **counts)
