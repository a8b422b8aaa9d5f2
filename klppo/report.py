"""End-of-run summary: what changed between the start and the end of training."""

from __future__ import annotations

import math

import torch


def metric_series(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    """`(step, value)` pairs of one metric from `trainer.state.log_history`."""
    return [(h["step"], h[key]) for h in log_history if key in h and isinstance(h[key], (int, float))]


def _edge_mean(series: list[tuple[int, float]], first: bool, n: int = 3) -> float:
    values = [v for _, v in series if math.isfinite(v)]
    if not values:
        return float("nan")
    part = values[:n] if first else values[-n:]
    return sum(part) / len(part)


@torch.no_grad()
def sample_completions(trainer, prompts: list, seed: int = 0) -> list[str]:
    """Completions of `prompts` by the current policy, sampled as in training with a fixed seed."""
    batch = trainer._collate([{"prompt": p} for p in prompts])
    device = trainer.accelerator.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        rollout = trainer._rollout(batch)
        trainer._compute_scores(rollout)
    return [f"{c!r} (reward {s:+.3f})" for c, s in zip(rollout["completions"], rollout["scores"].tolist())]


def run_summary(trainer, before: dict, after: dict) -> dict:
    """Numbers for the summary: reward, KL and coefficient at the start and the end, perplexity change.

    Args:
        before / after: `{"perplexity": float, "samples": [str], "prompts": [...]}` taken before and after
            `trainer.train()`.
    """
    history = trainer.state.log_history
    args = trainer.args
    scores = metric_series(history, "objective/scores")
    kl = metric_series(history, "kl/value")
    coef = metric_series(history, "kl/coef")
    return {
        "updates": trainer.state.global_step,
        "reward_first": _edge_mean(scores, True),
        "reward_last": _edge_mean(scores, False),
        "kl_first": _edge_mean(kl, True),
        "kl_last": _edge_mean(kl, False),
        "kl_target": args.kl_target,
        "kl_unit": args.kl_target_unit,
        "kl_mode": args.kl_mode,
        "kl_estimator": args.kl_estimator,
        "kl_controller": args.kl_controller,
        "coef_trajectory": [v for _, v in coef] + [trainer.kl_controller.value],
        "perplexity_before": before.get("perplexity"),
        "perplexity_after": after.get("perplexity"),
        "prompts": [str(p) for p in before.get("prompts", [])],
        "samples_before": before.get("samples", []),
        "samples_after": after.get("samples", []),
    }


def format_summary(summary: dict, wall_seconds: float | None = None) -> str:
    """A short human-readable report of `run_summary`'s numbers."""
    coefs = summary["coef_trajectory"]
    shown = coefs if len(coefs) <= 12 else coefs[:6] + ["..."] + coefs[-5:]
    coef_text = " -> ".join(c if isinstance(c, str) else f"{c:.4g}" for c in shown)
    target = summary["kl_target"]
    target_text = f"target {target:g} nats/{summary['kl_unit']}" if target else f"no target (unit: {summary['kl_unit']})"
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
    for i, prompt in enumerate(summary["prompts"]):
        lines.append(f"prompt {i + 1}: {prompt!r}")
        if i < len(summary["samples_before"]):
            lines.append(f"  before: {summary['samples_before'][i]}")
        if i < len(summary["samples_after"]):
            lines.append(f"  after:  {summary['samples_after'][i]}")
    lines.append("=" * 72)
    return "\n".join(lines)
