"""results/lists/: the list task's runs (`lab/lists/run.sh`) summarised per arm, mean and standard error over seeds,
with their training curves. From the repository root, after the runs:

    python -m lab.lists.summarize outputs/lists-runs [OUT]   # OUT: results/lists by default
"""

import ast
import glob
import json
import os
import sys

from klppo.kl.tracking import mean_and_standard_error

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "results", "lists")
ARMS = {
    "ppo": "klppo PPO (GAE, shared critic), equilibrium controller",
    "rloo": "klppo RLOO advantages (no critic), equilibrium controller",
    "grpo": "TRL GRPOTrainer + add_kl_control (equilibrium)",
}
TARGET = 8.0  # nats per sequence, configs/lists.yaml


def klppo_curve(folder):
    """Per-update readings from klppo's printed logs (train.log)."""
    rows = []
    with open(os.path.join(folder, "train.log")) as f:
        for line in f:
            if line.startswith("{'") and "objective/scores" in line:
                d = ast.literal_eval(line.strip())
                rows.append(
                    dict(
                        reward=float(d["objective/scores"]),
                        kl=float(d["kl/value"]),
                        coef=float(d["kl/coef"]),
                        length=float(d["objective/response_length"]),
                        seconds=float(d["time/update"]),
                    )
                )
    with open(os.path.join(folder, "summary.json")) as f:
        wall = json.load(f)["wall_seconds"]
    return rows, wall


def trl_curve(folder):
    rows = []
    with open(os.path.join(folder, "log.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            if "reward" in d:
                rows.append(
                    dict(
                        reward=d["reward"],
                        kl=d["kl/value"],
                        coef=d["kl/coef"],
                        length=d["completions/mean_length"],
                        seconds=d["step_time"],
                    )
                )
    with open(os.path.join(folder, "summary.json")) as f:
        wall = json.load(f)["seconds"]
    return rows, wall


def run_summary(folder):
    arm, seed = os.path.basename(folder).rsplit("-", 1)
    rows, wall = (trl_curve if arm == "grpo" else klppo_curve)(folder)
    n = len(rows)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    with open(os.path.join(folder, "heldout.json")) as f:
        heldout = json.load(f)
    return dict(
        arm=arm,
        seed=int(seed),
        updates=n,
        reward_first5=mean([r["reward"] for r in rows[:5]]),
        reward_last5=mean([r["reward"] for r in rows[-5:]]),
        kl_second_half=mean([r["kl"] for r in rows[n // 2 :]]),
        coef_last=rows[-1]["coef"],
        length_last5=mean([r["length"] for r in rows[-5:]]),
        wall_seconds=wall,
        heldout_reward=heldout["reward"],
        heldout_kl=heldout["kl_sequence"],
        heldout_length=heldout["response_length"],
        curve=rows,
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    runs = argv[0] if argv else "outputs/lists-runs"
    out = argv[1] if len(argv) > 1 else RESULTS
    finished = [
        f for f in sorted(glob.glob(os.path.join(runs, "*-*"))) if os.path.isfile(os.path.join(f, "heldout.json"))
    ]
    summaries = [run_summary(f) for f in finished if not f.endswith("base-0")]
    with open(os.path.join(runs, "base-0", "heldout.json")) as f:
        base = json.load(f)
    keys = [
        "reward_first5",
        "reward_last5",
        "kl_second_half",
        "coef_last",
        "heldout_reward",
        "heldout_kl",
        "heldout_length",
        "wall_seconds",
    ]
    table = {}
    for arm in ARMS:
        mine = [s for s in summaries if s["arm"] == arm]
        if mine:
            table[arm] = dict(
                seeds=[s["seed"] for s in mine],
                **{k: mean_and_standard_error([s[k] for s in mine]) for k in keys},
            )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(dict(reference=base, arms=table, runs=summaries), f, indent=1)
    lines = [
        "| arm | seeds | reward, updates 1-5 | reward, last 5 | KL per sequence, 2nd half (target 8) | held-out "
        "reward | held-out KL per sequence | held-out length | wall (min) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| reference (no training) | - | - | - | - | {base['reward']:.3f} | 0 | {base['response_length']:.0f} | - |",
    ]
    for arm, t in table.items():

        def cell(k, fmt="{:.3f}", scale=1.0):
            m, se = t[k]
            if len(t["seeds"]) < 2:  # one run: no standard error
                return fmt.format(m * scale)
            return (fmt + " ± " + fmt).format(m * scale, se * scale)

        lines.append(
            f"| {ARMS[arm]} | {', '.join(map(str, t['seeds']))} | {cell('reward_first5')} | {cell('reward_last5')} | "
            f"{cell('kl_second_half', '{:.2f}')} | {cell('heldout_reward')} | {cell('heldout_kl', '{:.2f}')} | "
            f"{cell('heldout_length', '{:.0f}')} | {cell('wall_seconds', '{:.0f}', 1 / 60)} |"
        )
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summaries, os.path.join(out, "curves.png"))


def plot(summaries, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(ppo="C0", rloo="C1", grpo="C2")
    for s in summaries:
        x = range(1, len(s["curve"]) + 1)
        label = f"{s['arm']} seed {s['seed']}"
        axes[0].plot(x, [r["reward"] for r in s["curve"]], color=colors[s["arm"]], alpha=0.8, label=label)
        axes[1].plot(x, [r["kl"] for r in s["curve"]], color=colors[s["arm"]], alpha=0.8)
    axes[1].axhline(TARGET, color="k", ls="--", lw=1)
    axes[0].set(xlabel="update", ylabel="reward (list items)", title="reward per update")
    axes[1].set(xlabel="update", ylabel="KL per sequence (nats)", title="KL statistic the controller reads")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
