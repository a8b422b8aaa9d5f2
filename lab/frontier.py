"""Reward at equal KL: a controlled arm against the fixed-beta frontier, seed by seed.

    python -m lab.frontier --arm results/compare_default_startup_confirm/summary.json:tracking-two-sided \
        --fixed results/compare_default_confirm/summary.json:fixed-0.035,fixed-0.06 \
        results/compare_default_fixed008_confirm/summary.json:fixed-0.08

For every seed the controlled arm and the fixed arms share, the fixed arms' (final KL, final reward) points are
joined by straight lines (extended past the outer points with the nearest segment's slope), and read at the
controlled arm's final KL. The difference, controlled minus fixed at equal KL, is averaged over seeds with its
standard error. KL is read with `k1` (`final_kl_k1`, logged by every run; older summaries without it use
`final_kl`, whose statistic was `k1` then).
"""

from __future__ import annotations

import argparse
import json

from klppo.kl.tracking import mean_and_standard_error


def per_seed(spec: str) -> dict[str, dict[str, dict]]:
    """`summary.json:arm1,arm2` -> {arm: {seed: metrics}}."""
    path, arms = spec.rsplit(":", 1)
    summary = json.load(open(path))
    return {arm: summary["arms"][arm]["per_seed"] for arm in arms.split(",")}


def kl_of(metrics: dict) -> float:
    value = metrics.get("final_kl_k1")
    return metrics["final_kl"] if value is None else value


def reward_at(points: list[tuple[float, float]], kl: float) -> float:
    """Piecewise-linear reward of the fixed arms at `kl` (points sorted by KL; ends extended linearly)."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    for (k0, r0), (k1, r1) in zip(points, points[1:]):
        if kl <= k1 or (k1, r1) == points[-1]:
            return r0 + (r1 - r0) * (kl - k0) / (k1 - k0)
    raise AssertionError


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True, help="summary.json:arm of the controlled arm")
    parser.add_argument("--fixed", required=True, nargs="+", help="summary.json:arm1,arm2 of fixed-beta arms")
    args = parser.parse_args(argv)
    ((name, arm),) = per_seed(args.arm).items()
    fixed = {}
    for spec in args.fixed:
        fixed.update(per_seed(spec))
    diffs = []
    for seed, m in sorted(arm.items()):
        points = [(kl_of(f[seed]), f[seed]["final_reward"]) for f in fixed.values() if seed in f]
        if len(points) < 2:
            continue
        at = reward_at(points, kl_of(m))
        diffs.append(m["final_reward"] - at)
        shown = ", ".join(f"{k:.2f} nats: {r:.3f}" for k, r in sorted(points))
        print(
            f"seed {seed}: {name} KL {kl_of(m):.2f}, reward {m['final_reward']:.3f}; fixed ({shown}) -> "
            f"{at:.3f} at equal KL; difference {diffs[-1]:+.3f}"
        )
    if len(diffs) == 1:
        print(f"{name} minus fixed at equal KL: {diffs[0]:+.3f} (1 seed: no standard error)")
    elif diffs:
        mean, se = mean_and_standard_error(diffs)
        print(f"{name} minus fixed at equal KL: {mean:+.3f} +- {se:.3f} (SE, {len(diffs)} seeds)")


if __name__ == "__main__":
    main()
