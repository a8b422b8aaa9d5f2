"""Learning against the peer: reward gained per 1,000 sampled sequences, klppo vs TRL 1.12's PPO, same task.

The task is klppo's default job (`configs/default.yaml`: SmolLM2-135M-Instruct with LoRA, VADER sentiment of
the completion, 32 sequences of 12 tokens per update, 36 updates = 1,152 sampled sequences). klppo runs it as
shipped (its default controller, target 4 nats per sequence, starting at beta 0.07); the peer
(`benchmarks/learn_peer.py`, TRL 1.12 `trl.experimental.ppo.PPOTrainer` in its own virtual environment) runs the
same model, adapter, prompts, batch layout and reward with its own layout (a separate value model) and a
fixed beta of 0.07, k1 in the reward, as TRL has no controller.

Each side gets a learning-rate sweep on seed 0; the best rate (largest reward slope on seed 0) then runs on
the other seeds. Reward gained per 1,000 sequences is the least-squares slope of the per-update mean reward
(`objective/scores`, the raw reward before any KL penalty) against sequences sampled, times 1,000.

    python benchmarks/learn_vs_peer.py run      # the sweep, then the best rates on seeds 1 and 2 (2 processes)
    python benchmarks/learn_vs_peer.py report   # results/learn_vs_peer/: summary.md, summary.json, curves.png

Runs are resumable: a run whose output exists is not repeated. One torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQUENCES_PER_UPDATE = 32
LEARNING_RATES = (2.5e-4, 5e-4, 1e-3)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--runs", default=str(ROOT / "results" / "learn_vs_peer" / "runs"))
    parser.add_argument("--out", default=str(ROOT / "results" / "learn_vs_peer"))
    parser.add_argument("--klppo-lrs", type=float, nargs="+", default=list(LEARNING_RATES))
    parser.add_argument("--peer-lrs", type=float, nargs="+", default=list(LEARNING_RATES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the first one is the sweep seed")
    parser.add_argument("--parallel", type=int, default=2)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------- runs
def run_name(side: str, lr: float, seed: int) -> str:
    return f"{side}_lr{lr:g}_s{seed}"


def run_command(side: str, lr: float, seed: int, runs: Path) -> list[str]:
    name = run_name(side, lr, seed)
    if side == "klppo":
        return [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "--config",
            str(ROOT / "configs" / "default.yaml"),
            "--output_dir",
            str(runs / name),
            "--seed",
            str(seed),
            "--learning_rate",
            str(lr),
            "--report_to",
            "none",
        ]
    import bench_assets  # this script's folder is on sys.path
    from klppo.data import offline_prompts

    prompts = runs / "prompts.json"
    if not prompts.exists():  # the default job's training prompts, as plain strings
        prompts.write_text(json.dumps(offline_prompts("train"), indent=0))
    return [
        str(bench_assets.ensure_peer_venv()),
        str(ROOT / "benchmarks" / "learn_peer.py"),
        "--model-path",
        bench_assets.resolve_model("smollm2"),
        "--prompts",
        str(prompts),
        "--learning-rate",
        str(lr),
        "--seed",
        str(seed),
        "--out",
        str(runs / f"{name}.json"),
    ]


def is_done(side: str, lr: float, seed: int, runs: Path) -> bool:
    name = run_name(side, lr, seed)
    return (runs / name / "trainer_state.json").exists() if side == "klppo" else (runs / f"{name}.json").exists()


def run_jobs(jobs: list[tuple[str, float, int]], runs: Path, parallel: int) -> None:
    """Run the jobs not yet done, `parallel` at a time, one torch thread each; logs beside the outputs."""
    pending = list(jobs)
    active: list[tuple[subprocess.Popen, tuple]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    while pending or active:
        while pending and len(active) < parallel:
            job = pending.pop(0)
            if is_done(*job, runs):  # checked when its turn comes: another invocation may have finished it
                continue
            log = open(runs / f"{run_name(*job)}.log", "w")
            print(f"start {run_name(*job)}", flush=True)
            active.append(
                (subprocess.Popen(run_command(*job, runs), stdout=log, stderr=subprocess.STDOUT, env=env), job)
            )
        time.sleep(5)
        for proc, job in list(active):
            if proc.poll() is not None:
                active.remove((proc, job))
                print(f"done {run_name(*job)} (exit {proc.returncode})", flush=True)


def run(args) -> None:
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    sweep_seed = args.seeds[0]
    sweep = [("klppo", lr, sweep_seed) for lr in args.klppo_lrs] + [("peer", lr, sweep_seed) for lr in args.peer_lrs]
    run_jobs(sweep, runs, args.parallel)
    best = {
        side: best_rate(runs, side, lrs, sweep_seed)
        for side, lrs in (("klppo", args.klppo_lrs), ("peer", args.peer_lrs))
    }
    run_jobs([(side, lr, s) for side, lr in best.items() for s in args.seeds[1:]], runs, args.parallel)


# ---------------------------------------------------------------------- analysis
def load_curve(runs: Path, side: str, lr: float, seed: int) -> dict[str, list[float]] | None:
    """Per-update series of a finished run: reward, KL per sequence, approxkl, clipfrac."""
    name = run_name(side, lr, seed)
    if side == "klppo":
        path = runs / name / "trainer_state.json"
        keys = {
            "reward": "objective/scores",
            "kl": "kl/value",
            "approxkl": "policy/approxkl",
            "clipfrac": "policy/clipfrac",
        }
    else:
        path = runs / f"{name}.json"
        keys = {
            "reward": "objective/scores",
            "kl": "objective/kl",
            "approxkl": "policy/approxkl_avg",
            "clipfrac": "policy/clipfrac_avg",
        }
    if not path.exists():
        return None
    history = json.loads(path.read_text())["log_history"]
    rows = [h for h in history if keys["reward"] in h and keys["kl"] in h]
    return {field: [float(h[key]) for h in rows] for field, key in keys.items()}


def slope_per_1000(rewards: list[float], per_update: int = SEQUENCES_PER_UPDATE) -> float:
    """Least-squares slope of reward against sequences sampled (after each update), times 1,000."""
    xs = [per_update * (i + 1) for i in range(len(rewards))]
    mx, my = statistics.fmean(xs), statistics.fmean(rewards)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, rewards)) / sxx


def run_figures(curve: dict[str, list[float]], window: int = 5) -> dict[str, float]:
    rewards = curve["reward"]
    return {
        "slope_per_1000": slope_per_1000(rewards),
        "reward_first": statistics.fmean(rewards[:window]),
        "reward_last": statistics.fmean(rewards[-window:]),
        "kl_last": statistics.fmean(curve["kl"][-window:]),
        "approxkl_max": max(curve["approxkl"]),
        "clipfrac_max": max(curve["clipfrac"]),
        "updates": len(rewards),
    }


def best_rate(runs: Path, side: str, lrs: list[float], seed: int) -> float:
    """The rate with the largest reward slope on the sweep seed."""
    slopes = {lr: run_figures(c)["slope_per_1000"] for lr in lrs if (c := load_curve(runs, side, lr, seed))}
    if not slopes:
        raise SystemExit(f"no finished {side} sweep run in {runs}")
    return max(slopes, key=slopes.get)


def mean_std(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def analyse(args) -> dict:
    runs = Path(args.runs)
    sweep_seed = args.seeds[0]
    result = {"sweep_seed": sweep_seed, "sweep": {}, "best_lr": {}, "seeds": {}}
    for side, lrs in (("klppo", args.klppo_lrs), ("peer", args.peer_lrs)):
        result["sweep"][side] = {
            f"{lr:g}": run_figures(c) for lr in lrs if (c := load_curve(runs, side, lr, sweep_seed))
        }
        lr = best_rate(runs, side, lrs, sweep_seed)
        result["best_lr"][side] = lr
        result["seeds"][side] = {s: run_figures(c) for s in args.seeds if (c := load_curve(runs, side, lr, s))}
    paired = sorted(set(result["seeds"]["klppo"]) & set(result["seeds"]["peer"]))
    ratios = [
        result["seeds"]["klppo"][s]["slope_per_1000"] / result["seeds"]["peer"][s]["slope_per_1000"] for s in paired
    ]
    result["ratio_per_seed"] = dict(zip(paired, ratios))
    for side in ("klppo", "peer"):
        figures = list(result["seeds"][side].values())
        result[f"{side}_summary"] = {
            k: mean_std([f[k] for f in figures])
            for k in ("slope_per_1000", "kl_last", "reward_first", "reward_last", "approxkl_max", "clipfrac_max")
        }
    result["ratio"] = mean_std(ratios) if ratios else None
    return result


# ---------------------------------------------------------------------- report
def fmt(stat: dict, digits: int = 3) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def summary_markdown(result: dict) -> str:
    lines = [
        "# Learning against the peer: klppo vs TRL 1.12 PPO on the default task",
        "",
        "Command: `python benchmarks/learn_vs_peer.py run && python benchmarks/learn_vs_peer.py report`. "
        f"Rates swept on seed {result['sweep_seed']}; the best rate of each side then ran on every seed. "
        "Reward gained per 1,000 sampled sequences: least-squares slope of the per-update mean reward "
        "(VADER compound score, before any KL penalty) against sequences sampled, x 1,000. KL: nats per "
        "sequence (k1 summed over the response, mean over sequences), mean of the last 5 updates.",
        "",
        "## Sweep (seed {})".format(result["sweep_seed"]),
        "",
        "| side | learning rate | reward / 1,000 seqs | reward first 5 -> last 5 | KL last 5 | max approxkl | max clipfrac |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, rows in result["sweep"].items():
        for lr, f in rows.items():
            lines.append(
                f"| {side} | {lr} | {f['slope_per_1000']:+.3f} | {f['reward_first']:+.3f} -> {f['reward_last']:+.3f} | "
                f"{f['kl_last']:.2f} | {f['approxkl_max']:.4f} | {f['clipfrac_max']:.3f} |"
            )
    lines += [
        "",
        "## Best rates on every seed",
        "",
        "| seed | klppo reward / 1,000 seqs | peer reward / 1,000 seqs | ratio klppo / peer | klppo KL | peer KL |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seed, ratio in result["ratio_per_seed"].items():
        k, p = result["seeds"]["klppo"][seed], result["seeds"]["peer"][seed]
        lines.append(
            f"| {seed} | {k['slope_per_1000']:+.3f} | {p['slope_per_1000']:+.3f} | {ratio:.2f} | {k['kl_last']:.2f} | {p['kl_last']:.2f} |"
        )
    ks, ps = result["klppo_summary"], result["peer_summary"]
    lines += [
        "",
        f"klppo (lr {result['best_lr']['klppo']:g}): {fmt(ks['slope_per_1000'])} per 1,000 sequences, KL {fmt(ks['kl_last'], 2)}; "
        f"peer (lr {result['best_lr']['peer']:g}): {fmt(ps['slope_per_1000'])}, KL {fmt(ps['kl_last'], 2)} "
        f"(mean ± std over {ks['slope_per_1000']['n']} seeds).",
        "",
        f"**Ratio klppo / peer: {fmt(result['ratio'], 2)}** (per seed, paired by seed).",
        "",
        "![reward curves](curves.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(args, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = Path(args.runs)
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for side, color in (("klppo", "tab:blue"), ("peer", "tab:orange")):
        lr = result["best_lr"][side]
        curves = [c for s in args.seeds if (c := load_curve(runs, side, lr, s))]
        n = min(len(c["reward"]) for c in curves)
        xs = [SEQUENCES_PER_UPDATE * (i + 1) for i in range(n)]
        for field, ax in (("reward", ax_r), ("kl", ax_k)):
            for c in curves:
                ax.plot(xs, c[field][:n], color=color, alpha=0.2, lw=0.8)
            mean = [statistics.fmean(c[field][i] for c in curves) for i in range(n)]
            label = f"{'klppo' if side == 'klppo' else 'TRL 1.12 PPO'} (lr {lr:g}, {len(curves)} seeds)"
            ax.plot(xs, mean, color=color, lw=2, label=label)
    ax_r.set(xlabel="sequences sampled", ylabel="mean reward per update", title="reward (VADER)")
    ax_k.set(xlabel="sequences sampled", ylabel="KL (nats / sequence)", title="KL to the reference")
    ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = analyse(args)
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "summary.md").write_text(summary_markdown(result))
    plot(args, result, out / "curves.png")
    print(summary_markdown(result))


def main(argv=None) -> None:
    args = parse_args(argv)
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
