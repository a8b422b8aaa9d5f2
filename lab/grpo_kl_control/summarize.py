"""The tables of results/grpo_kl_control/README.md from runs' summary.json files (tracking figures against the target
0.03 nats per token for every run, fixed-beta runs included; runs with another number of completions per step than
16 are labelled with it). With no argument it reads runs/*/summary.json; else the files named, e.g.

    python results/grpo_kl_control/summarize.py results/grpo_kl_control/summaries/gpu150-*.json
"""

import glob
import json
import os
import statistics
import sys

TARGET = 0.03
HERE = os.path.dirname(os.path.abspath(__file__))


def row(s):
    kl = s["kl"]
    half = kl[len(kl) // 2 :]
    errors = [abs(k / TARGET - 1) for k in half]
    return dict(
        reward_last5=s["reward_last5"], kl_half=sum(half) / len(half), tracking_error=sum(errors) / len(errors),
        in_band=sum(e <= 0.2 for e in errors) / len(errors), ppl_change=s["ppl_after"] / s["ppl_before"] - 1,
        beta_end=s["beta"][-1], seconds=s["seconds_per_update"],
    )


def main():
    runs = {}
    for path in sys.argv[1:] or sorted(glob.glob(os.path.join(HERE, "runs", "*", "summary.json"))):
        with open(path) as f:
            s = json.load(f)
        label = s["mode"] if (s["steps"], s["beta0"]) == (30, 0.04) else f"{s['mode']}, {s['steps']} updates, beta from {s['beta0']}"
        if s.get("kwargs"):
            label += f", kl_controller_kwargs {s['kwargs']}"
        if s.get("batch", 16) != 16:  # runs written before --batch existed used 16 completions per step
            label += f", {s['batch']} completions per step"
        runs.setdefault(label, []).append((s["seed"], row(s)))
    keys = ["reward_last5", "kl_half", "tracking_error", "in_band", "ppl_change", "beta_end", "seconds"]
    print("| run | seed | reward (last 5 updates) | KL/token, 2nd half | tracking error | in ±20% | held-out ppl | beta at end | s/update |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, rows in runs.items():
        for seed, r in rows:
            print(f"| {mode} | {seed} | {r['reward_last5']:+.3f} | {r['kl_half']:.4f} | {r['tracking_error']:.3f} | "
                  f"{r['in_band']:.0%} | {r['ppl_change']:+.1%} | {r['beta_end']:.4f} | {r['seconds']:.1f} |")
        if len(rows) > 1:
            m = {k: statistics.mean(r[k] for _, r in rows) for k in keys}
            se = {k: statistics.stdev(r[k] for _, r in rows) / len(rows) ** 0.5 for k in keys}
            print(f"| {mode} | mean ± SE | {m['reward_last5']:+.3f} ± {se['reward_last5']:.3f} | {m['kl_half']:.4f} | "
                  f"{m['tracking_error']:.3f} ± {se['tracking_error']:.3f} | {m['in_band']:.0%} ± {se['in_band']:.0%} | "
                  f"{m['ppl_change']:+.1%} | {m['beta_end']:.4f} | {m['seconds']:.1f} |")


if __name__ == "__main__":
    main()
