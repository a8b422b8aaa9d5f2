"""The tables of results/grpo_kl_control/README.md from runs' summary.json files (tracking figures against the target
0.03 nats per token for every run, fixed-beta runs included; runs with another number of completions per step than
16 are labelled with it). With no argument it reads results/grpo_kl_control/runs/*/summary.json; else the files
named, e.g. (from the repository root)

    python -m lab.grpo_kl_control.summarize results/grpo_kl_control/summaries/gpu150-*.json

`--first N` reads only each run's first N updates: what a run of N updates at the same constant learning rate gives.
"""

import glob
import json
import os
import sys

from klppo.kl.tracking import mean_and_standard_error, tracking_stats

TARGET = 0.03
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "results", "grpo_kl_control")


def row(s, first=None):
    kl, beta = s["kl"][:first], s["beta"][:first]
    tracking = tracking_stats(kl, TARGET)
    reward = s["reward_last5"] if first is None else sum(s["reward"][:first][-5:]) / len(s["reward"][:first][-5:])
    return dict(
        reward_last5=reward,
        kl_half=tracking.mean_ratio * TARGET,
        tracking_error=tracking.error,
        in_band=tracking.in_band,
        peak=tracking.peak_ratio,
        ppl_change=s["ppl_after"] / s["ppl_before"] - 1 if first is None else float("nan"),
        beta_end=beta[-1],
        seconds=s["seconds_per_update"],
    )


def main():
    paths, first = sys.argv[1:], None
    if paths[:1] == ["--first"]:
        first, paths = int(paths[1]), paths[2:]
    runs = {}
    for path in paths or sorted(glob.glob(os.path.join(RESULTS, "runs", "*", "summary.json"))):
        with open(path) as f:
            s = json.load(f)
        label = (
            s["mode"]
            if (s["steps"], s["beta0"]) == (30, 0.04)
            else f"{s['mode']}, {s['steps']} updates, beta from {s['beta0']}"
        )
        if s.get("kwargs"):
            label += f", kl_controller_kwargs {s['kwargs']}"
        if s.get("batch", 16) != 16:  # runs written before --batch existed used 16 completions per step
            label += f", {s['batch']} completions per step"
        if first is not None:
            label += f", first {first} updates"
        runs.setdefault(label, []).append((s["seed"], row(s, first)))
    keys = ["reward_last5", "kl_half", "tracking_error", "in_band", "peak", "ppl_change", "beta_end", "seconds"]
    print(
        "| run | seed | reward (last 5 updates) | KL/token, 2nd half | tracking error | in ±20% | peak / target | "
        "held-out ppl | beta at end | s/update |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, rows in runs.items():
        for seed, r in rows:
            print(
                f"| {mode} | {seed} | {r['reward_last5']:+.3f} | {r['kl_half']:.4f} | {r['tracking_error']:.3f} | "
                f"{r['in_band']:.0%} | {r['peak']:.2f} | {r['ppl_change']:+.1%} | {r['beta_end']:.4f} | {r['seconds']:.1f} |"
            )
        if len(rows) > 1:
            m, se = {}, {}
            for k in keys:
                m[k], se[k] = mean_and_standard_error(r[k] for _, r in rows)
            print(
                f"| {mode} | mean ± SE | {m['reward_last5']:+.3f} ± {se['reward_last5']:.3f} | {m['kl_half']:.4f} | "
                f"{m['tracking_error']:.3f} ± {se['tracking_error']:.3f} | {m['in_band']:.0%} ± {se['in_band']:.0%} | "
                f"{m['peak']:.2f} ± {se['peak']:.2f} | "
                f"{m['ppl_change']:+.1%} | {m['beta_end']:.4f} | {m['seconds']:.1f} |"
            )


if __name__ == "__main__":
    main()
