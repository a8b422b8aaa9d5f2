"""End-of-run summary: what changed between the start and the end of training."""

from __future__ import annotations

import math

from .kl.tracking import mean_and_standard_error, tracking_stats
from .rewards.text import completion_text


def metric_series(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    """`(step, value)` pairs of one metric from a run's logged metrics (`trainer.state.log_history`)."""
    return [(h["step"], h[key]) for h in log_history if key in h and isinstance(h[key], (int, float))]


def _edge_mean(series: list[tuple[int, float]], first: bool, n: int = 3) -> float:
    values = [v for _, v in series if math.isfinite(v)]
    if not values:
        return float("nan")
    part = values[:n] if first else values[-n:]
    return sum(part) / len(part)


def sample_completions(trainer, prompts: list, seed: int = 0) -> list[str]:
    """Completions of `prompts` by the current policy, sampled as in training with a fixed seed."""
    _, rewards = trainer.sample(prompts, seed=seed)
    return [f"{c!r} (reward {s:+.3f})" for c, s in zip(rewards.completions, rewards.scores.tolist())]


def learning_verdict(
    rewards: list[float],
    kls: list[float],
    kl_target: float | None,
    perplexity_before: float | None,
    perplexity_after: float | None,
    window: int = 5,
    min_standard_errors: float = 3.0,
    kl_tolerance: float = 0.25,
    max_perplexity_rise: float = 0.15,
) -> dict:
    """Did the run learn while KL held? The figures the default job is judged by.

    - reward: mean of the last `window` updates minus the first `window`, in standard errors of that
      difference (`sqrt(se_first^2 + se_last^2)`, each from the spread of the per-update means); the rise
      counts when it exceeds `min_standard_errors`;
    - KL: mean of the controller statistic over the second half of the updates relative to the target, and
      the tracking error (mean of `|kl - target| / target` over the second half) and the share of
      second-half updates within +-20% of the target; held when the mean is within `kl_tolerance`;
    - held-out perplexity change, relative; kept when it rose by at most `max_perplexity_rise`.
    """
    out: dict = {"updates": len(rewards), "judged": len(rewards) >= 2 * window}
    first, last = mean_and_standard_error(rewards[:window]), mean_and_standard_error(rewards[-window:])
    rise = last[0] - first[0]
    se = math.sqrt(first[1] ** 2 + last[1] ** 2)
    out["reward_first"], out["reward_last"], out["reward_rise"] = first[0], last[0], rise
    out["reward_rise_se"] = rise / se if se > 0 else (math.inf if rise > 0 else float("nan"))
    out["learned"] = len(rewards) >= 2 * window and out["reward_rise_se"] > min_standard_errors
    if kl_target and kls:
        stats = tracking_stats(kls, kl_target)
        if stats.readings:
            out["kl_second_half_mean"] = stats.mean_ratio * kl_target
            out["kl_second_half_ratio"] = stats.mean_ratio
            out["kl_tracking_error"] = stats.error
            out["kl_in_band"] = stats.in_band
            out["kl_held"] = abs(stats.mean_ratio - 1) <= kl_tolerance
    if perplexity_before and perplexity_after is not None and math.isfinite(perplexity_before):
        change = perplexity_after / perplexity_before - 1
        out["perplexity_change"] = change
        out["perplexity_kept"] = change <= max_perplexity_rise
    return out


def format_verdict(verdict: dict) -> str:
    """One line: the figures of `learning_verdict` and whether each criterion was met."""
    if not verdict.get("judged", True):
        return f"verdict: not judged: {verdict.get('updates')} updates (at least 10 are needed to compare the first and last 5)"
    parts = [
        f"reward {verdict['reward_first']:+.3f} -> {verdict['reward_last']:+.3f} "
        f"({verdict['reward_rise_se']:.1f} SE, {'rose' if verdict['learned'] else 'did not rise'} by > 3 SE)"
    ]
    if "kl_held" in verdict:
        parts.append(
            f"KL 2nd half {100 * verdict['kl_second_half_ratio']:.0f}% of target "
            f"(tracking error {verdict['kl_tracking_error']:.2f}, {100 * verdict['kl_in_band']:.0f}% in +-20%; "
            f"{'held' if verdict['kl_held'] else 'not held'} within +-25%)"
        )
    if "perplexity_kept" in verdict:
        parts.append(
            f"perplexity {100 * verdict['perplexity_change']:+.1f}% "
            f"({'<=' if verdict['perplexity_kept'] else '>'} +15%)"
        )
    met = all(verdict.get(k, True) for k in ("learned", "kl_held", "perplexity_kept"))
    return f"verdict: {'PASS' if met else 'FAIL'}: " + "; ".join(parts)


def run_summary(history: list[dict], args, final_coef: float, before: dict, after: dict) -> dict:
    """Numbers for the summary: reward, KL and coefficient at the start and the end, perplexity change.

    Args:
        history: the run's logged metrics (`trainer.state.log_history`).
        args: its `KLPPOConfig`.
        final_coef: the KL coefficient after the last update (the controller's value).
        before / after: `{"perplexity": float, "samples": [str], "prompts": [...]}` taken before and after
            training.
    """
    scores = metric_series(history, "objective/scores")
    kl = metric_series(history, "kl/value")
    coef = metric_series(history, "kl/coef")
    verdict = learning_verdict(
        [v for _, v in scores], [v for _, v in kl], args.kl_target, before.get("perplexity"), after.get("perplexity")
    )
    return {
        "verdict": verdict,
        "updates": max((h.get("step", 0) for h in history), default=0),
        "reward_first": _edge_mean(scores, True),
        "reward_last": _edge_mean(scores, False),
        "kl_first": _edge_mean(kl, True),
        "kl_last": _edge_mean(kl, False),
        "kl_target": args.kl_target,
        "kl_unit": args.kl_target_unit,
        "kl_mode": args.kl_mode,
        "kl_estimator": args.kl_estimator,
        "kl_controller": args.kl_controller,
        "coef_trajectory": [v for _, v in coef] + [final_coef],
        "perplexity_before": before.get("perplexity"),
        "perplexity_after": after.get("perplexity"),
        "prompts": [completion_text(p) for p in before.get("prompts", [])],  # a conversation: its last message
        "samples_before": before.get("samples", []),
        "samples_after": after.get("samples", []),
    }


def format_summary(summary: dict, wall_seconds: float | None = None) -> str:
    """A short human-readable report of `run_summary`'s numbers."""
    coefs = summary["coef_trajectory"]
    shown = coefs if len(coefs) <= 12 else coefs[:6] + ["..."] + coefs[-5:]
    coef_text = " -> ".join(c if isinstance(c, str) else f"{c:.4g}" for c in shown)
    target = summary["kl_target"]
    target_text = (
        f"target {target:g} nats/{summary['kl_unit']}" if target else f"no target (unit: {summary['kl_unit']})"
    )
    lines = [
        "=" * 72,
        f"klppo run summary: {summary['updates']} PPO updates"
        + (f" in {wall_seconds:.0f} s" if wall_seconds is not None else ""),
        f"KL: mode={summary['kl_mode']} estimator={summary['kl_estimator']} controller={summary['kl_controller']}",
        f"reward (mean of first/last 3 updates): {summary['reward_first']:+.4f} -> {summary['reward_last']:+.4f}",
        f"KL statistic: {summary['kl_first']:.4f} -> {summary['kl_last']:.4f} ({target_text})",
        f"KL coefficient: {coef_text}",
    ]
    pb, pa = summary["perplexity_before"], summary["perplexity_after"]
    if pb is not None and pa is not None:
        lines.append(f"held-out perplexity: {pb:.3f} -> {pa:.3f} ({100 * (pa - pb) / pb:+.2f}%)")
    if summary.get("verdict"):
        lines.append(format_verdict(summary["verdict"]))
    for i, prompt in enumerate(summary["prompts"]):
        lines.append(f"prompt {i + 1}: {prompt!r}")
        if i < len(summary["samples_before"]):
            lines.append(f"  before: {summary['samples_before'][i]}")
        if i < len(summary["samples_after"]):
            lines.append(f"  after:  {summary['samples_after'][i]}")
    lines.append("=" * 72)
    return "\n".join(lines)
