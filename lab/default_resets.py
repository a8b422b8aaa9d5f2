"""Reference resets on the default task: the default job run longer, with and without `ref_reset_steps`, paired by seed.

    python -m lab.default_task_lr --lrs 5e-4 --seeds 11 12 --out results/default_resets/none -- --max_steps 72
    python -m lab.default_task_lr --lrs 5e-4 --seeds 11 12 --out results/default_resets/reset36 -- --max_steps 72 --ref_reset_steps 36
    python -m lab.default_resets results/default_resets/none results/default_resets/reset36 --segment 36

(from the repository root). The same per-segment target in both arms (the job's 4 nats): without resets the KL to the
starting model is held at the target for the whole run; with them, the KL to each segment's reference. Per run and
segment: the mean score over the segment's first and last 5 updates, the second-half KL over the target; per run: the
KL to the starting model at the end (`kl/initial` with resets, `kl/k3` without: the same estimator on the sampled
tokens), the held-out perplexity's change and the job's verdict. Then the paired difference (second folder minus
first) as mean and standard error over seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab import paired_table


def _mean(rows: list[dict], key: str) -> float:
    values = [h[key] for h in rows if key in h and h[key] == h[key]]
    return sum(values) / len(values) if values else float("nan")


def summarise(folder: Path, segment: int) -> dict:
    """One run's figures: per segment `reward_first5_<k>`, `reward_last5_<k>`, `kl_ratio_<k>` (k from 1), and
    `kl_initial_end` (the last 5 updates), `perplexity_change`, `passed`."""
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    logs = [h for h in history if "kl/value" in h]
    out: dict[str, float] = {}
    for k, start in enumerate(range(0, len(logs), segment), start=1):
        part = logs[start : start + segment]
        out[f"reward_first5_{k}"] = _mean(part[:5], "objective/scores")
        out[f"reward_last5_{k}"] = _mean(part[-5:], "objective/scores")
        out[f"kl_ratio_{k}"] = _mean(part[len(part) // 2 :], "kl/value") / part[0]["kl/target"]
    initial = "kl/initial" if "kl/initial" in logs[-1] else "kl/k3"
    out["kl_initial_end"] = _mean(logs[-5:], initial)
    verdict = json.loads((folder / "summary.json").read_text())["verdict"]
    out["perplexity_change"] = verdict["perplexity_change"]
    out["passed"] = bool(verdict["learned"] and verdict["kl_held"] and verdict["perplexity_kept"])
    return out


def runs(folder: Path, segment: int) -> dict[str, dict]:
    return {
        p.name.split("_seed")[1]: summarise(p, segment)
        for p in sorted(folder.iterdir())
        if (p / "summary.json").exists()
    }


def table(base: Path, other: Path, segment: int) -> str:
    first, second = runs(base, segment), runs(other, segment)
    figures = [f for f in next(iter(first.values())) if f != "passed"]
    return paired_table(base.name, first, other.name, second, figures)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the runs without resets (lab.default_task_lr's --out)")
    parser.add_argument("other", type=Path, help="the runs with them")
    parser.add_argument("--segment", type=int, default=36, help="updates per segment (the runs' ref_reset_steps)")
    args = parser.parse_args(argv)
    print(table(args.base, args.other, args.segment), end="")


if __name__ == "__main__":
    main()
