"""The entry points of the KL estimators: a per-token estimate from log-ratios (`kl_from_log_ratio`) or log-probs
(`compute_kl`), with the optional output clamp and the mask of clamped tokens, and any registered estimator by name,
per-token or logits-based (`estimate_kl`). The estimators are declared in `klppo.kl.estimators`."""

from __future__ import annotations

from typing import Optional

import torch

from .estimator_registry import get_kl_estimator_spec

__all__ = ["kl_from_log_ratio", "compute_kl", "estimate_kl"]


def _check_bound(value, name):
    if value is None:
        return None
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number or None to disable it, got {value}")
    return value


def kl_from_log_ratio(
    log_ratio: torch.Tensor,
    estimator: str = "k1",
    old_log_ratio: Optional[torch.Tensor] = None,
    log_ratio_clamp: Optional[float] = 40.0,
    value_clamp: Optional[float] = None,
    return_clamped: bool = False,
):
    """Per-token KL estimate from the log-ratios, differentiable through them.

    Args:
        log_ratio ``[...]``: ``d = logp - ref_logp`` of the sampled tokens (the policy's gradient, if any, flows
            through it).
        estimator: a per-token name from ``kl_estimators()``.
        old_log_ratio ``[...]`` or None: ``logp - old_logp``; read by ``corrected_k3`` (and its twin) only. At the
            policy that sampled the tokens it is 0 (the same as None).
        log_ratio_clamp: clamp both log-ratios to ``[-C, C]`` before any exp; None disables it.
        value_clamp: opt-in clamp of the output to ``[-value_clamp, value_clamp]`` (10 reproduces
            OpenRLHF's ``compute_approx_kl``); clamped tokens get a zero gradient.
        return_clamped: also return a bool mask of the tokens where any clamp was active (log-ratio,
            importance ratio, the estimator's own output clamp, ``value_clamp``); its mean is the
            ``kl/clamped_frac`` metric.

    Returns:
        ``kl`` ``[...]`` (broadcast shape, input dtype), or ``(kl, clamped)`` with ``clamped`` a bool
        tensor of the same shape.
    """
    spec = get_kl_estimator_spec(estimator)
    if spec.needs_logits:
        raise ValueError(
            f"KL estimator {estimator!r} takes logits, not log-probs: call `estimate_kl` with logits and "
            "ref_logits (or `full_kl(logits, ref_logits)`)."
        )
    log_ratio_clamp = _check_bound(log_ratio_clamp, "log_ratio_clamp")
    value_clamp = _check_bound(value_clamp, "value_clamp")
    kl = spec.fn(log_ratio, old_log_ratio, log_ratio_clamp)

    clamped = None
    if return_clamped:
        with torch.no_grad():
            clamped = torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)
            if log_ratio_clamp is not None:
                clamped |= log_ratio.abs() > log_ratio_clamp
                if spec.uses_old_logp and old_log_ratio is not None:
                    clamped |= old_log_ratio.abs() > log_ratio_clamp
            if spec.output_clamp is not None:
                clamped |= kl.abs() >= spec.output_clamp
            if value_clamp is not None:
                clamped |= kl.abs() > value_clamp
    if value_clamp is not None:
        kl = kl.clamp(-value_clamp, value_clamp)
    return (kl, clamped) if return_clamped else kl


def compute_kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k1",
    old_logp: Optional[torch.Tensor] = None,
    log_ratio_clamp: Optional[float] = 40.0,
    value_clamp: Optional[float] = None,
    return_clamped: bool = False,
):
    """``kl_from_log_ratio`` from log-probs: ``logp`` ``[...]`` (log pi_theta of the sampled tokens, carries the
    gradient), ``ref_logp`` and ``old_logp`` (log pi_ref and log pi_old of the same tokens, constants; ``old_logp``
    is read by ``corrected_k3`` only). The other arguments and the result are ``kl_from_log_ratio``'s."""
    old_log_ratio = None if old_logp is None else logp - old_logp.detach()
    return kl_from_log_ratio(
        logp - ref_logp.detach(),
        estimator,
        old_log_ratio,
        log_ratio_clamp=log_ratio_clamp,
        value_clamp=value_clamp,
        return_clamped=return_clamped,
    )


def estimate_kl(
    estimator: str,
    logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    old_logp: Optional[torch.Tensor] = None,
    logits: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    return_clamped: bool = False,
    log_ratio: Optional[torch.Tensor] = None,
    old_log_ratio: Optional[torch.Tensor] = None,
    **clamps,
):
    """Per-position KL by any registered estimator. A per-token one reads ``log_ratio`` (and ``old_log_ratio``)
    when given, else forms them from ``logp``, ``ref_logp`` and ``old_logp`` (``kl_from_log_ratio``, with
    ``clamps``: ``log_ratio_clamp``, ``value_clamp``); a logits-based one reads ``logits`` / ``ref_logits``
    (temperature-scaled, ``[..., V]``) and its values are never clamped."""
    spec = get_kl_estimator_spec(estimator)
    if not spec.needs_logits:
        if log_ratio is None:
            return compute_kl(logp, ref_logp, estimator, old_logp=old_logp, return_clamped=return_clamped, **clamps)
        return kl_from_log_ratio(log_ratio, estimator, old_log_ratio, return_clamped=return_clamped, **clamps)
    if logits is None or ref_logits is None:
        raise ValueError(f"KL estimator {estimator!r} needs the policy's and the reference's logits.")
    kl = spec.fn(logits, ref_logits.detach(), chunk_size)
    return (kl, torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)) if return_clamped else kl
