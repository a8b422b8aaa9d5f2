"""The default job (`configs/default.yaml`) at several LoRA learning rates and seeds: does the KL hold its target?

    python -m lab.default_task_lr --lrs 1e-4 2.5e-4 5e-4 --seeds 1 2 3 --out results/default_task_lr
    python -m lab.default_task_lr --table --out results/default_task_lr

(from the repository root). Each run is `scripts/train.py --config configs/default.yaml` with `--learning_rate`,
`--seed` and any further flags given after `--` (an experimental setting as `--experimental '{"kl_guard": true}'`),
one after another, one thread each (`--plugin M` imports the lab's module `M`, or any module, first, for a
controller or a guard of its own); its `trainer_state.json` and `summary.json` are kept under
`--out/lr<lr>_seed<seed>/`. The table gives, per learning rate, the second-half tracking error (mean
|KL - target| / target), the share of second-half updates within +-20% of the target, the peak KL over the
target (`klppo.kl.tracking`) and the second half's geometric-mean beta, as mean and standard error over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from klppo.kl.tracking import mean_and_standard_error, tracking_stats

ROOT = Path(__file__).resolve().parents[1]


# runs scripts/train.py (from the repository root, so that `lab` imports) after importing a module that registers
# a controller or a guard of its own
_WITH_PLUGIN = (
    "import runpy, sys; from lab import import_plugin; import_plugin(sys.argv[1]); "
    "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run(lr: str, seed: int, out: Path, extra: list[str], plugin: str | None = None) -> None:
    dest = out / f"lr{lr}_seed{seed}"
    if (dest / "summary.json").exists():
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            str(ROOT / "scripts/train.py"),
            "--config",
            str(ROOT / "configs/default.yaml"),
            "--learning_rate",
            lr,
            "--seed",
            str(seed),
            "--output_dir",
            tmp,
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            *extra,
        ]
        if plugin:
            cmd = [sys.executable, "-c", _WITH_PLUGIN, plugin, *cmd[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(out / f"lr{lr}_seed{seed}.log", "w") as log:
            subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("trainer_state.json", "summary.json"):
            shutil.copy(Path(tmp) / name, dest / name)


def summarise(folder: Path) -> dict:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    logs = [h for h in history if "kl/value" in h]
    kls = [h["kl/value"] for h in logs]
    stats = tracking_stats(kls, logs[0]["kl/target"])
    betas = [h["kl/coef"] for h in logs][len(kls) // 2 :]
    verdict = json.loads((folder / "summary.json").read_text())["verdict"]
    return {
        "tracking_error": stats.error,
        "in_band": stats.in_band,
        "peak": stats.peak_ratio,
        "beta": math.exp(sum(map(math.log, betas)) / len(betas)),
        "passed": bool(verdict["learned"] and verdict["kl_held"] and verdict["perplexity_kept"]),
        "reward_rise": verdict["reward_rise"],
    }


def table(out: Path, seeds: list[int], lrs: Optional[list[str]] = None) -> str:
    """The finished runs of ``seeds`` (and of ``lrs``, all when None) in ``out``."""
    groups: dict[str, list[dict]] = {}
    for folder in sorted(p for p in out.iterdir() if (p / "summary.json").exists()):
        lr, seed = folder.name[2:].split("_seed")
        if int(seed) not in seeds or (lrs is not None and float(lr) not in map(float, lrs)):
            continue
        groups.setdefault(lr, []).append(summarise(folder))
    lines = [
        "| LoRA lr | seeds | tracking error | in band | peak KL / target | geo-mean beta | reward rise "
        "| verdict PASS |",
        "|" + " --- |" * 8,
    ]
    for lr in sorted(groups, key=float):
        rows = groups[lr]
        cols = []
        for name in ("tracking_error", "in_band", "peak", "beta", "reward_rise"):
            mean, se = mean_and_standard_error(r[name] for r in rows)
            cols.append(f"{mean:.3g} ± {se:.2g}")
        passed = sum(r["passed"] for r in rows)
        lines.append(f"| {lr} | {len(rows)} | " + " | ".join(cols) + f" | {passed}/{len(rows)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", nargs="+", default=["1e-4", "2.5e-4", "5e-4"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the table of the finished runs of --lrs and --seeds in --out and exit",
    )
    parser.add_argument(
        "--plugin",
        help="a module to import first, the lab's by its short name (one that registers a controller or a guard)",
    )
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        for lr in args.lrs:
            for seed in args.seeds:
                run(lr, seed, args.out, extra, args.plugin)
    print(table(args.out, args.seeds, args.lrs), end="")


if __name__ == "__main__":
    main()
