"""Correcting an engine's drift: truncated importance sampling between the engine that sampled and the trainer.

An inexact engine (vLLM) samples from `mu`, its own numerics at its copy of the weights; the trainer scores the same
tokens with its own forward, `pi_old`. PPO's ratio `pi / pi_old` assumes the tokens came from `pi_old`; they came
from `mu`. As TRL's `vllm_importance_sampling_*` does (truncated importance sampling, Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"), each token's policy loss is weighted by

    w = min(pi_old / mu, clip_max)        per token                       (`token_truncate`)
    w = min(prod_t pi_old / mu, clip_max) per sequence, on all its tokens  (`sequence_truncate`)

The ratios are weighed into the advantages (`weight_advantages`): PPO's clipped loss is linear in the advantage and
`w > 0`, so `max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r))`, the per-token policy loss times `w` exactly. The
advantages are first centred on their mean under `pi_old` (`weight_advantages` says why). The KL
penalty in the reward reaches the gradient through those same advantages, so it is corrected with them; a KL term in
the loss carries its own gradient, and each token's term (its baseline's mean too) is weighted by the same `w`
(`update.micro_batch_loss`): with the advantages weighted and that term not, the two halves of the gradient were
expectations under different distributions, and the loss-mode bandit settled 10x further from its optimum. The KL
statistic the controller and the guard read (`statistic_kl`, the guard's per-token sums) and the logged
`kl/k1..k3` are the trainer's log-ratios weighted by the same `w` (their expectation under `pi_old` instead of
`mu`); the equilibrium controller, which reads whole sequences, weighs each by its own truncated ratio
(`is_log_weight`: `min(prod_t pi_old / mu, clip_max)`, in either mode). Every reading is of the trainer's
log-probs, never the engine's: the engine's enter only through `w`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

IS_MODES = ("token_truncate", "sequence_truncate")


def importance_weights(
    logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, mode: str, clip_max: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(w, ratio, capped)`: the truncated weights `[B, R]` (1 outside `mask`), the untruncated ratios `[B, R]`
    and a bool `[B, R]` of the tokens the cap touched, from the trainer's `logp` and the engine's `sampling_logp`."""
    keep = mask.bool()
    diff = torch.where(keep, logp.double() - sampling_logp.double(), 0.0)
    if mode == "token_truncate":
        log_ratio = diff
    elif mode == "sequence_truncate":
        log_ratio = diff.sum(dim=1, keepdim=True).expand_as(diff)
    else:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    ratio = log_ratio.clamp(max=700.0).exp()  # a long sequence's product can pass float64's range (exp(709))
    capped = (ratio > clip_max) & keep
    w = torch.where(keep, ratio.clamp(max=clip_max), 1.0)
    return w.to(logp.dtype), ratio, capped


def _global(value: torch.Tensor, op: str, accelerator) -> float:
    """`value` (a 0-dim tensor) reduced over all ranks by `op` (`sum`, `max`, `min`)."""
    if accelerator is not None and accelerator.num_processes > 1:
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        value = value.double().to(accelerator.device).clone()
        dist.all_reduce(value, op=ops[op])
    return float(value)


def correct_rollout(rollout, enabled: bool, mode: str, clip_max: float, accelerator=None):
    """The rollout of an inexact engine (`sampling_logp` set) with the engine's drift measured and, when `enabled`,
    corrected: `is_weight` set, `statistic_kl` and `logged_kl` weighted by it. `sampling_metrics` holds, reduced
    over all ranks: `sampling/logp_diff_mean` and `_max` (|trainer - engine| per token, nats),
    `sampling/is_ratio_mean`, `_min`, `_max` (the untruncated ratios) and `sampling/is_capped_frac` (the tokens the
    cap touched). A rollout of an exact engine is returned as it is."""
    if getattr(rollout, "sampling_logp", None) is None:
        return rollout
    keep = rollout.response_mask.bool()
    w, ratio, capped = importance_weights(rollout.logp, rollout.sampling_logp, rollout.response_mask, mode, clip_max)
    diff_signed = rollout.logp.double() - rollout.sampling_logp.double()
    diff = diff_signed.abs()
    n = _global(keep.sum().double(), "sum", accelerator)
    big, inf = torch.tensor(float("inf"), dtype=torch.float64), torch.tensor(float("-inf"), dtype=torch.float64)
    kept = lambda x, fill: torch.where(keep, x, fill.to(x.device))  # noqa: E731
    metrics = {
        "sampling/logp_diff_mean": _global((diff * keep).sum(), "sum", accelerator) / max(n, 1.0),
        "sampling/logp_diff_max": _global(kept(diff, inf).max(), "max", accelerator),
        "sampling/is_ratio_mean": _global((ratio * keep).sum(), "sum", accelerator) / max(n, 1.0),
        "sampling/is_ratio_min": _global(kept(ratio, big).min(), "min", accelerator),
        "sampling/is_ratio_max": _global(kept(ratio, inf).max(), "max", accelerator),
        "sampling/is_capped_frac": _global(capped.sum().double(), "sum", accelerator) / max(n, 1.0),
    }
    if not enabled:
        return replace(rollout, sampling_metrics=metrics)
    zero = torch.zeros((), dtype=rollout.statistic_kl.dtype, device=w.device)
    # a sequence's own truncated ratio, min(pi_old(y) / mu(y), clip_max), in either mode (float64 from the log-ratios:
    # a weight that underflows to 0 would give the controller an infinite log-ratio)
    log_w = torch.where(keep, diff_signed, 0.0).sum(dim=1).clamp(max=math.log(clip_max))
    return replace(
        rollout,
        is_weight=w,
        is_log_weight=log_w,
        sampling_metrics=metrics,
        statistic_kl=torch.where(keep, rollout.statistic_kl * w.to(rollout.statistic_kl.dtype), zero),
        logged_kl=rollout.logged_kl * w.to(rollout.logged_kl.dtype).unsqueeze(-1),
    )


def weight_advantages(advantages, rollout, valid: torch.Tensor | None = None, accelerator=None):
    """`advantages` centred on their mean under the trainer's policy, then each token's times its truncated
    importance weight (the per-token policy loss times the weight: see the module's docstring); unchanged without
    weights. `valid [B, R]`: the tokens that carry a policy gradient (default: the response mask); the mean is
    self-normalised, `sum w A / sum w` over them on all ranks.

    Why centre: the whitening took out the advantages' mean over the engine's samples, their mean under `mu`; the
    weighted gradient is an expectation under `pi_old`, where that mean is off by as much as the signal near the
    optimum. Taking out any constant leaves the expected gradient as it is (`E[grad log pi] = 0`), and taking out
    the mean under `pi_old` removes the noise the other one leaves. Measured on the one-token bandit sampled at a
    temperature 30% above the trainer's, KL(pi || pi*) after 120 updates: 0.075 weighted without centring, 0.005
    centred, 0.006 on-policy (`tests/test_generation.py`)."""
    if getattr(rollout, "is_weight", None) is None:
        return advantages
    a = advantages.advantages
    w = rollout.is_weight.to(a.dtype)
    valid = (rollout.response_mask if valid is None else valid).to(a.dtype)
    total = _global((w * valid).sum(), "sum", accelerator)
    mean = _global((w * a * valid).sum(), "sum", accelerator) / total if total > 0 else 0.0
    return replace(advantages, advantages=(a - mean) * valid * w)
