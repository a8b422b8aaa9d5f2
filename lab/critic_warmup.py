"""Does critic warm-up earn a default? The default job with and without `critic_warmup_steps`, paired by seed.

    python -m lab.default_task_lr --lrs 5e-4 --seeds 7 8 9 --out results/critic_warmup/none
    python -m lab.default_task_lr --lrs 5e-4 --seeds 7 8 9 --out results/critic_warmup/warmup3 -- --critic_warmup_steps 3
    python -m lab.critic_warmup results/critic_warmup/none results/critic_warmup/warmup3

(from the repository root). Per run: the reward over the last 5 updates, the KL over the second half (the target
is held by the controller, so the reward compares at equal KL), the value loss and the explained variance of the
values over the first 10 updates after the warm-up and over the second half, and the verdict; then the paired
difference (second folder minus first) as mean and standard error over seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab import paired_table

FIGURES = ("reward_last5", "kl_ratio", "value_loss_early", "value_loss_late", "explained_early", "explained_late")


def summarise(folder: Path) -> dict:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    logs = [h for h in history if "kl/value" in h]
    warm = sum(h.get("train/critic_warmup", 0.0) > 0 for h in logs)
    trained, half = logs[warm:], logs[len(logs) // 2 :]

    def mean(rows, key):
        values = [h[key] for h in rows if key in h and h[key] == h[key]]
        return sum(values) / len(values) if values else float("nan")

    verdict = json.loads((folder / "summary.json").read_text())["verdict"]
    return {
        "reward_last5": mean(logs[-5:], "objective/scores"),
        "kl_ratio": mean(half, "kl/value") / logs[0]["kl/target"],
        "value_loss_early": mean(trained[:10], "loss/value"),
        "value_loss_late": mean(half, "loss/value"),
        "explained_early": mean(trained[:10], "val/explained_variance"),
        "explained_late": mean(half, "val/explained_variance"),
        "passed": bool(verdict["learned"] and verdict["kl_held"] and verdict["perplexity_kept"]),
    }


def runs(out: Path) -> dict[str, dict]:
    return {p.name.split("_seed")[1]: summarise(p) for p in sorted(out.iterdir()) if (p / "summary.json").exists()}


def table(base: Path, other: Path) -> str:
    return paired_table(base.name, runs(base), other.name, runs(other), list(FIGURES))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the runs without warm-up (lab.default_task_lr's --out)")
    parser.add_argument("other", type=Path, help="the runs with it")
    args = parser.parse_args(argv)
    print(table(args.base, args.other), end="")


if __name__ == "__main__":
    main()
