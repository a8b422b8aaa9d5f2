"""Plot one run's KL statistic, coefficient, reward and held-out perplexity.

The perplexity panel starts with the value before training, read from the run's summary.json.

    python scripts/plot_run.py outputs/default            # reads the newest checkpoint's trainer_state.json
    python scripts/plot_run.py outputs/default/checkpoint-20 --out run.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from klppo.report import metric_series

DPI = 110


def find_state(path: str) -> str:
    if os.path.isfile(path):
        return path
    direct = os.path.join(path, "trainer_state.json")
    if os.path.isfile(direct):
        return direct
    checkpoints = sorted(glob.glob(os.path.join(path, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[-1]))
    if not checkpoints:
        raise SystemExit(f"error: no trainer_state.json under {path}; train with save_strategy=steps first.")
    return os.path.join(checkpoints[-1], "trainer_state.json")


def find_summary(state_path: str) -> dict:
    """The run's `summary.json` (written by `scripts/train.py` into output_dir), looked for beside
    `trainer_state.json` and in the folder above a checkpoint; `{}` when there is none."""
    folder = os.path.dirname(os.path.abspath(state_path))
    for candidate in (folder, os.path.dirname(folder)):
        path = os.path.join(candidate, "summary.json")
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}


def panel_series(history: list[dict], key: str, summary: dict) -> list[tuple[int, float]]:
    """`(update, value)` points of one panel. Perplexity starts with the value before training (update 0) that
    the summary reports; evaluation during training logs only the later ones."""
    series = metric_series(history, key)
    if key == "eval/perplexity" and summary.get("perplexity_before") is not None:
        series = [(0, summary["perplexity_before"])] + [(step, v) for step, v in series if step != 0]
    return series


PANELS = (
    ("kl/value", "KL statistic"),
    ("kl/coef", "KL coefficient"),
    ("objective/scores", "reward"),
    ("eval/perplexity", "held-out perplexity"),
)


def draw(history: list[dict], summary: dict):
    """The figure: one panel per entry of `PANELS`, over PPO updates; the KL panel shades the target +-20%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, title) in zip(axes, PANELS):
        series = panel_series(history, key, summary)
        if series:
            ax.plot(*zip(*series), marker="." if len(series) < 40 else None)
        if key == "kl/value":
            target = next((h["kl/target"] for h in history if "kl/target" in h), None)
            if target:
                ax.axhspan(0.8 * target, 1.2 * target, color="tab:green", alpha=0.15, label="target +-20%")
                ax.legend()
        ax.set_title(title)
        ax.set_xlabel("PPO update")
    fig.tight_layout()
    return fig


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="output_dir, a checkpoint folder or a trainer_state.json")
    parser.add_argument("--out", default=None, help="PNG path (default: <run>/klppo_run.png)")
    args = parser.parse_args(argv)
    state_path = find_state(args.run)
    with open(state_path) as f:
        history = json.load(f)["log_history"]
    fig = draw(history, find_summary(state_path))
    out = args.out or os.path.join(os.path.dirname(state_path), "klppo_run.png")
    fig.savefig(out, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(out)
    return out


if __name__ == "__main__":
    main()
