"""Compare KL controllers on one task: every arm x seed is a separate PPO run in its own process.

    python -m lab.compare --config lab/configs/compare_default.yaml --seeds 0 1 2 --parallel 2 --out results/compare_default
    python -m lab.compare --quick --out /tmp/compare-quick     # tiny model, 2 arms, 1 seed, 2 updates
    python -m lab.compare --config ... --out ... --summarize   # redo summary and plots from the runs

(from the repository root). The YAML is an ordinary `scripts/train.py` experiment plus one block of its own,
`compare:`:

    compare:
      band: 0.2            # "within target" means |KL - target| <= band * target
      final_window: 5      # final reward = mean objective/scores of the last N updates
      arms:                # name -> fields that replace the base experiment's (usually KL fields)
        fixed-0.02: {kl_controller: fixed, kl_coef: 0.02}
        adaptive: {kl_controller: adaptive, kl_coef: 0.05, kl_controller_kwargs: {horizon: 32}}
        no-guard: {kl_controller: tracking, experimental: {kl_guard: false}}

Everything outside `compare:` goes through `scripts/train.py`'s parser (TrlParser over ScriptArguments,
KLPPOConfig and ModelConfig), so it is validated exactly as a training run would be, and every arm's
fields are passed to that parser as command-line overrides (a mapping, such as `kl_controller_kwargs`, as
JSON). An arm's `experimental` settings are added to the base experiment's, not put in their place. The arms
therefore share the prompts, the
reward, the number of updates and the seeds; only their own fields differ. Fixed-coefficient arms have no
target of their own: they are measured against the experiment's `kl_target`, like the controlled arms.

Outputs under `--out`:
    base_config.yaml                  the experiment without the `compare:` block (what the parser read)
    runs/<arm>-seed<k>.json           per-update records of one run (reward, KL statistic, coefficient,
                                      k1/k2/k3, held-out perplexity and eval reward at step 0 and every
                                      eval_steps updates); a run whose record exists is not run again
    logs/<arm>-seed<k>.log            the run's stdout/stderr
    summary.json, summary.md          per-arm mean / std / min / max over seeds of the comparison metrics
    invocations.json                  command, wall time and number of runs trained of every invocation
    reward.png, kl.png, coef.png, perplexity.png, eval_reward.png

Scheduling: on the 2-core machine this was written for, two runs at a time with one torch thread each
finished the same pair of 6-update SmolLM2 runs in 114 s and 182 s (two measurements) against 212 s and
217 s for one run at a time with two threads (generation is latency bound and scales poorly with threads;
process start-up and evaluation overlap). Hence the default `--parallel 2` with `cores / parallel`
threads per run. Runs with the same seed and arm give the same numbers in either mode. Each run is a fresh
process of a `concurrent.futures.ProcessPoolExecutor` (spawned, one run per process), its output in its log. A
run that fails leaves no record and is trained again by the next invocation; a process that dies outright
(killed, out of memory) fails the runs still waiting too.

summary.md keeps the text between its `<!-- findings -->` and `<!-- /findings -->` markers when it is
regenerated, so the written reading of the numbers survives a re-run of the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import yaml

from klppo.cli import build_trainer, parse
from klppo.kl.tracking import tracking_stats
from klppo.utils import write_json as _write_json_atomic
from lab.tracking import whole_run_stats

ROOT = Path(__file__).resolve().parents[1]

# Metrics copied from each update's log entry into the run record.
UPDATE_KEYS = (
    "objective/scores",
    "objective/rlhf_reward",
    "objective/non_score_reward",
    "objective/response_length",
    "objective/eos_frac",
    "kl/value",
    "kl/coef",
    "kl/coef_next",
    "kl/target",
    "kl/error",
    "kl/k1",
    "kl/k2",
    "kl/k3",
    "kl/full",
    "loss/policy",
    "loss/value",
    "policy/approxkl",
    "policy/clipfrac",
    "policy/entropy",
    "time/update",
    "kl/guard_fired",
    "kl/guard_low_fired",
    "kl/during_update",
)

# --quick: the tiny random model of configs/tiny.yaml, two arms, one seed, two updates.
QUICK_CONFIG = ROOT / "configs" / "tiny.yaml"
# (tiny.yaml's adaptive constants cleared: each arm names its controller's own)
QUICK_OVERRIDES = {
    "max_steps": 2,
    "eval_steps": 1,
    "heldout_eval_texts": 4,
    "output_dir": "outputs/compare-quick",
    "kl_controller_kwargs": None,
}
QUICK_SPEC = {
    "band": 0.2,
    "final_window": 2,
    "arms": {
        "fixed-0.05": {"kl_controller": "fixed", "kl_coef": 0.05},
        "adaptive": {"kl_controller": "adaptive", "kl_coef": 0.05, "kl_controller_kwargs": {"horizon": 64}},
    },
}

FINDINGS_OPEN, FINDINGS_CLOSE = "<!-- findings -->", "<!-- /findings -->"


# ---------------------------------------------------------------------------- experiment definition
def load_experiment(config: Path | None, quick: bool) -> tuple[dict, dict]:
    """(base experiment for train.py's parser, the `compare:` block)."""
    path = QUICK_CONFIG if quick else config
    with open(path) as f:
        base = yaml.safe_load(f)
    if not isinstance(base, dict):
        raise SystemExit(f"error: {path} must hold a YAML mapping.")
    spec = base.pop("compare", None)
    if quick:
        base.update(QUICK_OVERRIDES)
        spec = QUICK_SPEC
    if not spec or not spec.get("arms"):
        raise SystemExit(f"error: {path} has no `compare: arms:` block; see the docstring of lab/compare.py.")
    for name, fields in spec["arms"].items():
        if not isinstance(fields, dict) or not fields:
            raise SystemExit(f"error: arm {name!r} must map field names to values, e.g. {{kl_controller: pid}}.")
        if "seed" in fields or "max_steps" in fields:
            raise SystemExit(f"error: arm {name!r} sets seed/max_steps; arms must share them (use --seeds).")
    spec.setdefault("band", 0.2)
    spec.setdefault("final_window", 5)
    return base, spec


def arm_overrides(base: dict, fields: dict) -> dict:
    """An arm's fields as command-line overrides of `base`: its `experimental` settings added to the base's (a
    command-line mapping replaces the YAML's whole)."""
    if isinstance(fields.get("experimental"), dict) and isinstance(base.get("experimental"), dict):
        return {**fields, "experimental": {**base["experimental"], **fields["experimental"]}}
    return fields


def cli_value(value) -> str:
    """A field's value as the parser reads it from a command line: a mapping or list (`kl_controller_kwargs`)
    as JSON, which `KLPPOConfig` parses."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def train_argv(base_config: Path, fields: dict, seed: int, output_dir: str) -> list[str]:
    """Arguments for train.py's parser: the base YAML, then the arm's fields as command-line overrides."""
    argv = ["--config", str(base_config)]
    for key, value in fields.items():
        argv += [f"--{key}", cli_value(value)]
    argv += [
        "--seed",
        str(seed),
        "--output_dir",
        output_dir,
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    return argv


# settings a run resolves from defaults that can change between versions: part of a run's fingerprint, so that a
# record written under other defaults is trained again rather than kept
RESOLVED_KEYS = ("kl_controller", "kl_statistic", "kl_guard")


def resolved_settings(args) -> dict:
    """The RESOLVED_KEYS of a parsed config."""
    return {k: getattr(args.experimental if hasattr(args.experimental, k) else args, k) for k in RESOLVED_KEYS}


def fingerprint(base: dict, fields: dict, seed: int, resolved: dict) -> str:
    text = json.dumps({"base": base, "arm": fields, "seed": seed, "resolved": resolved}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- one run (child process)
def run_worker(job: dict) -> None:
    """Train one (arm, seed) and write its record. Runs in a process of its own (`run_logged`)."""
    import torch

    torch.set_num_threads(job["threads"])
    script_args, training_args, model_args = parse(job["argv"])
    start = time.time()
    trainer = build_trainer(script_args, training_args, model_args)
    evals = [{"step": 0, **trainer.evaluate_policy()}]
    trainer.train()
    history = trainer.state.log_history
    steps = trainer.state.global_step
    evals += [
        {"step": h["step"], **{k: h[k] for k in ("eval/perplexity", "eval/scores") if k in h}}
        for h in history
        if "eval/perplexity" in h
    ]
    if evals[-1]["step"] != steps:  # the last update is always evaluated
        evals.append({"step": steps, **trainer.evaluate_policy()})
    updates = [{"step": h["step"], **{k: h[k] for k in UPDATE_KEYS if k in h}} for h in history if "kl/value" in h]
    args = trainer.args
    record = {
        "arm": job["arm"],
        "seed": job["seed"],
        "fields": job["fields"],
        "fingerprint": job["fingerprint"],
        "complete": True,
        "updates_done": steps,
        "wall_seconds": time.time() - start,
        "threads": job["threads"],
        "kl_target": args.kl_target,
        "kl_target_unit": args.kl_target_unit,
        "kl_controller": args.kl_controller,
        "kl_statistic": args.experimental.kl_statistic,
        "kl_controller_kwargs": args.kl_controller_kwargs,
        "kl_guard": args.experimental.kl_guard,
        "kl_coef_initial": args.kl_coef,
        "kl_coef_final": trainer.kl_controller.value,
        "controller_state": trainer.kl_controller.state_dict(),
        "sequences_per_update": args.local_rollout_batch_size * trainer.accelerator.num_processes,
        "updates": updates,
        "evals": evals,
        "samples": trainer.completion_samples,
    }
    write_json(Path(job["record"]), record)


def write_json(path: Path, data) -> None:
    """`klppo.utils.write_json`: atomic, so a crash never leaves a half-written record that would count as
    finished."""
    _write_json_atomic(path, data, indent=1, default=_json_default)


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


# ---------------------------------------------------------------------------- scheduling (parent)
def record_is_done(path: Path, fp: str) -> bool:
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if record.get("fingerprint") != fp:
        print(f"  {path.name}: written by a different configuration, running it again", flush=True)
        return False
    return bool(record.get("complete"))


def run_logged(job: dict, log: str) -> None:
    """One run in a worker process of the pool, from the repository root: its stdout and stderr (the C
    libraries' too) go to `log`; a failure is written there in full and reaches the parent as a `RuntimeError`
    naming it."""
    os.chdir(ROOT)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        run_worker(job)
    except (Exception, SystemExit) as err:
        traceback.print_exc()
        sys.stderr.flush()
        raise RuntimeError(f"{type(err).__name__}: {err}"[:2000]) from None
    finally:
        sys.stdout.flush()


@contextlib.contextmanager
def _child_environment(threads: int):
    """The environment the pool's processes start with (they are spawned while it holds): `threads` OpenMP / MKL
    threads, no tokenizer threads, no wandb, unbuffered output."""
    env = {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_all(jobs: list[dict], parallel: int, out: Path) -> list[tuple[dict, str]]:
    """Train the jobs, `parallel` at a time, each in a fresh process; returns the failed (job, reason) pairs."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    failed: list[tuple[dict, str]] = []
    pending = list(jobs)
    one_run_each = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    context = multiprocessing.get_context("spawn")  # with one run per process (3.11+): no state carried between runs
    with (
        _child_environment(jobs[0]["threads"] if jobs else 1),
        ProcessPoolExecutor(parallel, mp_context=context, **one_run_each) as pool,
    ):
        running = {}
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                try:
                    future = pool.submit(run_logged, job, str(out / "logs" / f"{job['name']}.log"))
                except BrokenProcessPool as err:
                    failed += [(j, f"not started: {err}") for j in [job, *pending]]
                    pending = []
                    break
                running[future] = (job, time.time())
                print(f"  started {job['name']} ({job['threads']} thread(s))", flush=True)
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job, t0 = running.pop(future)
                err = future.exception()
                status = "done" if err is None else f"FAILED ({err}; see logs/{job['name']}.log)"
                print(f"  {job['name']}: {status} in {time.time() - t0:.0f} s", flush=True)
                if err is not None:
                    failed.append((job, str(err)))
    return failed


# ---------------------------------------------------------------------------- metrics
def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _mean(values) -> float:
    values = _finite(values)
    return sum(values) / len(values) if values else float("nan")


def _readings(values) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def run_metrics(record: dict, target: float, band: float, window: int) -> dict:
    """Comparison metrics of one run. Tracking is measured against the experiment's target for every arm
    (`klppo.kl.tracking`: the second half of the updates, and the whole run)."""
    ups = record["updates"]
    kl = _readings(u.get("kl/value") for u in ups)
    k1 = _readings(u.get("kl/k1") for u in ups)  # k1 is logged by every run: arms of any statistic compare
    second, whole = tracking_stats(kl, target, band), whole_run_stats(kl, target, band)
    second_k1 = tracking_stats(k1, target, band)

    evals = record["evals"]
    ppl0, ppl1 = evals[0].get("eval/perplexity"), evals[-1].get("eval/perplexity")
    return {
        "final_reward": _mean(u.get("objective/scores") for u in ups[-window:]),
        "initial_reward": _mean(u.get("objective/scores") for u in ups[:window]),
        "final_kl": _mean(kl[-window:]),
        "max_kl": max(_finite(kl), default=float("nan")),
        "tracking_error": second.error,
        "tracking_error_all": whole.error,
        "in_band_second_half": second.in_band,
        "in_band_all": whole.in_band,
        "final_kl_k1": _mean(k1[-window:]),
        "tracking_error_k1": second_k1.error,
        "in_band_second_half_k1": second_k1.in_band,
        "perplexity_initial": ppl0,
        "perplexity_final": ppl1,
        "perplexity_change_pct": 100.0 * (ppl1 - ppl0) / ppl0 if ppl0 and ppl1 is not None else float("nan"),
        "eval_reward_initial": evals[0].get("eval/scores", float("nan")),
        "eval_reward_final": evals[-1].get("eval/scores", float("nan")),
        "final_coef": record["kl_coef_final"],
        "seconds_per_update": _mean(u.get("time/update") for u in ups),
    }


def spread(values: list[float]) -> dict:
    values = _finite(values)
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    m = sum(values) / len(values)
    if len(values) > 1 and max(values) > min(values):
        std = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    else:
        std = 0.0
    return {"mean": m, "std": std, "min": min(values), "max": max(values), "n": len(values)}


METRIC_NAMES = (
    "final_reward",
    "initial_reward",
    "final_kl",
    "max_kl",
    "tracking_error",
    "tracking_error_all",
    "in_band_second_half",
    "in_band_all",
    "final_kl_k1",
    "tracking_error_k1",
    "in_band_second_half_k1",
    "perplexity_change_pct",
    "eval_reward_initial",
    "eval_reward_final",
    "final_coef",
    "seconds_per_update",
)


def summarize(records: dict[str, list[dict]], spec: dict, target: float) -> dict:
    band, window = spec["band"], spec["final_window"]
    arms = {}
    for arm, runs in records.items():
        per_seed = {r["seed"]: run_metrics(r, target, band, window) for r in runs}
        arms[arm] = {
            "fields": spec["arms"][arm],
            "seeds": sorted(per_seed),
            "metrics": {m: spread([s[m] for s in per_seed.values()]) for m in METRIC_NAMES},
            "per_seed": {str(k): v for k, v in sorted(per_seed.items())},
        }
    return arms


def _clean(obj):
    """JSON without NaN/inf (they become null)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ---------------------------------------------------------------------------- plots
def _series(runs: list[dict], key: str, source: str = "updates") -> tuple[list[int], list[list[float]]]:
    """Steps and one row of values per seed (NaN where a seed lacks the step)."""
    steps = sorted({e["step"] for r in runs for e in r[source] if key in e})
    rows = []
    for r in runs:
        by_step = {e["step"]: e[key] for e in r[source] if key in e and e[key] is not None}
        rows.append([float(by_step.get(s, float("nan"))) for s in steps])
    return steps, rows


SMOOTH = 3  # updates in the trailing average of the reward curves


def _trailing_mean(values, window: int):
    import numpy as np

    out = np.empty_like(values)
    for i in range(len(values)):
        with np.errstate(all="ignore"):
            out[i] = np.nanmean(values[max(0, i - window + 1) : i + 1])
    return out


def make_plots(records: dict[str, list[dict]], target: float, band: float, unit: str, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = plt.get_cmap("tab10").colors
    n_seeds = max(len(runs) for runs in records.values())
    suffix = f"mean of {n_seeds} seeds (thin lines: each seed)" if n_seeds > 1 else "1 seed"
    figures = [
        ("reward.png", "objective/scores", "updates", "mean reward of the rollout batch", False),
        ("kl.png", "kl/value", "updates", f"KL statistic (nats per {unit})", False),
        ("coef.png", "kl/coef", "updates", "KL coefficient beta used in the update", True),
        ("perplexity.png", "eval/perplexity", "evals", "held-out perplexity of the policy", False),
        ("eval_reward.png", "eval/scores", "evals", "mean reward on held-out eval prompts", False),
    ]
    written = []
    for filename, key, source, ylabel, log_y in figures:
        fig, ax = plt.subplots(figsize=(8, 4.8))
        if key == "kl/value":
            ax.axhspan(target * (1 - band), target * (1 + band), color="0.85", label=f"target +/-{band:.0%}")
            ax.axhline(target, color="0.4", lw=1, ls="--")
        plotted = False
        for i, (arm, runs) in enumerate(records.items()):
            steps, rows = _series(runs, key, source)
            if not steps:
                continue
            color = colors[i % len(colors)]
            values = np.array(rows, dtype=float)
            if len(runs) > 1:
                for row in values:
                    ax.plot(steps, row, color=color, lw=0.7, alpha=0.35)
            with np.errstate(all="ignore"):
                # geometric mean on a log axis (beta spans decades), arithmetic mean otherwise
                mean = np.exp(np.nanmean(np.log(values), axis=0)) if log_y else np.nanmean(values, axis=0)
            if key == "objective/scores" and len(mean) >= SMOOTH:
                mean = _trailing_mean(mean, SMOOTH)
            ax.plot(steps, mean, color=color, lw=2, label=arm, marker="o" if source == "evals" else None, ms=3)
            plotted = True
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("PPO update")
        ax.set_ylabel(ylabel)
        title = f"{ylabel}: {'geometric ' if log_y else ''}{suffix}"
        if key == "objective/scores":
            title += f";\nthick line: seed mean averaged over the last {SMOOTH} updates (rollout rewards are noisy)"
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if plotted:
            ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(filename)
    return written


# ---------------------------------------------------------------------------- summary.md
def _fmt(stat: dict, spec: str, pct: bool = False, std_spec: str | None = None) -> str:
    """`mean ± std` of a per-arm statistic, formatted with `spec` (e.g. ".2f", ".3g"; `std_spec` for the std)."""
    if stat["mean"] is None:
        return "n/a"
    scale = 100.0 if pct else 1.0
    text = format(stat["mean"] * scale, spec)
    if stat["n"] > 1:
        text += " ± " + format(stat["std"] * scale, std_spec or spec)
    return text


def write_markdown(summary: dict, out: Path) -> None:
    meta, arms = summary["experiment"], summary["arms"]
    unit = meta["kl_target_unit"]
    lines = [
        f"# KL controller comparison: {meta['name']}",
        "",
        f"Tables and plots written by: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}. Sum of the per-run wall times: {meta['run_wall_seconds_sum']:.0f} s.",
        "",
        "Invocations that trained runs (wall time of the whole invocation):",
        "",
        *[
            f"- {inv['started']}: `{inv['command']}`: {inv['runs_trained']} run(s), {inv['parallel']} at a time with "
            f"{inv['threads_per_run']} thread(s) each, {inv['wall_seconds']:.0f} s ({inv['wall_seconds'] / 60:.1f} min)"
            for inv in meta["invocations"]
            if inv["runs_trained"] > 0
        ],
        "",
        f"Task: model `{meta['model']}`, {meta['updates']} PPO updates of {meta['sequences_per_update']} sequences, "
        f"seeds {meta['seeds']}. KL target {meta['kl_target']:g} nats per {unit} (statistic: "
        + ("mean over sequences of the per-sequence sum" if unit == "sequence" else "token-weighted mean")
        + f" of `{meta.get('kl_statistic', meta['kl_estimator'])}`, KL in the {meta['kl_mode']} as `{meta['kl_estimator']}`), band ±{meta['band']:.0%}. Fixed-coefficient arms are "
        "measured against the same target (they do not aim at it; it is the experiment's target).",
        "",
        "Metrics (mean ± std over seeds; per-seed values and min/max in summary.json):",
        f"reward = mean rollout reward of the first / last {meta['final_window']} updates; final KL = mean KL "
        f"statistic of the last {meta['final_window']} updates; tracking error = mean "
        "|KL - target| / target over the second half of the updates; in band = fraction of updates with KL within "
        f"±{meta['band']:.0%} of the target; Δ perplexity = held-out perplexity after the last update vs. step 0.",
        "",
        "| arm | fields | reward, first → last updates | final KL | tracking error (2nd half) | in band (2nd half) | in band (all) "
        "| Δ perplexity % | eval reward (final) | final beta |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, entry in arms.items():
        m = entry["metrics"]
        fields = ", ".join(f"{k}={v}" for k, v in entry["fields"].items())
        lines.append(
            f"| {arm} | {fields} | {_fmt(m['initial_reward'], '.3f')} → {_fmt(m['final_reward'], '.3f')} "
            f"| {_fmt(m['final_kl'], '.2f')} "
            f"| {_fmt(m['tracking_error'], '.2f')} | {_fmt(m['in_band_second_half'], '.2f')} "
            f"| {_fmt(m['in_band_all'], '.2f')} | {_fmt(m['perplexity_change_pct'], '.2f')} "
            f"| {_fmt(m['eval_reward_final'], '.3f')} | {_fmt(m['final_coef'], '.3g', std_spec='.2g')} |"
        )
    lines += [
        "",
        "The same KL read with `k1` (logged by every run, whatever its statistic), so that arms whose statistic "
        "differs compare:",
        "",
        "| arm | final KL (k1) | tracking error (k1, 2nd half) | in band (k1, 2nd half) |",
        "| --- | --- | --- | --- |",
    ]
    for arm, entry in arms.items():
        m = entry["metrics"]
        lines.append(
            f"| {arm} | {_fmt(m['final_kl_k1'], '.2f')} | {_fmt(m['tracking_error_k1'], '.2f')} "
            f"| {_fmt(m['in_band_second_half_k1'], '.2f')} |"
        )
    # arms that read different statistics are ranked on k1, which every run logs
    key = "tracking_error_k1" if "," in str(meta.get("kl_statistic", "")) else "tracking_error"
    ranked = sorted(
        (a for a in arms if arms[a]["metrics"][key]["mean"] is not None),
        key=lambda a: arms[a]["metrics"][key]["mean"],
    )
    if ranked:
        lines += [
            "",
            f"Tracking error{' on k1' if key.endswith('k1') else ''}, best first: "
            + ", ".join(f"{a} ({arms[a]['metrics'][key]['mean']:.2f})" for a in ranked)
            + ".",
        ]
    lines += [
        "",
        "Plots: reward.png, kl.png (target band shaded), coef.png (log scale), perplexity.png, "
        "eval_reward.png. Per-update records: runs/<arm>-seed<k>.json.",
        "",
    ]

    old = (out / "summary.md").read_text() if (out / "summary.md").is_file() else ""
    if FINDINGS_OPEN in old and FINDINGS_CLOSE in old:
        findings = old[old.index(FINDINGS_OPEN) : old.index(FINDINGS_CLOSE) + len(FINDINGS_CLOSE)]
    else:
        findings = f"{FINDINGS_OPEN}\n## What the data show\n\n(not written yet)\n{FINDINGS_CLOSE}"
    (out / "summary.md").write_text("\n".join(lines) + "\n" + findings + "\n")


def machine_text() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({cpu}), no GPU, Python {platform.python_version()}"


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="experiment YAML with a `compare:` block")
    parser.add_argument("--out", type=Path, required=False, help="results folder, e.g. results/compare_default")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1; --quick: 0)")
    parser.add_argument("--arms", nargs="+", default=None, help="run only these arms (default: all)")
    parser.add_argument(
        "--parallel", type=int, default=None, help="runs at a time (default: 2 when there are 2 cores or more, else 1)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / parallel)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 arms, 1 seed, 2 updates (tests)")
    parser.add_argument("--summarize", action="store_true", help="only rebuild summary and plots from the runs")
    args = parser.parse_args(argv)
    if args.out is None or (args.config is None and not args.quick):
        parser.error("--out and one of --config / --quick are required")

    start = time.time()
    command = " ".join(
        shlex.quote(a) for a in ["python", "-m", "lab.compare", *(argv if argv is not None else sys.argv[1:])]
    )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base, spec = load_experiment(args.config, args.quick)
    arm_names = list(spec["arms"])
    if args.arms:
        unknown = [a for a in args.arms if a not in spec["arms"]]
        if unknown:
            parser.error(f"unknown arm(s) {unknown}; the experiment has {arm_names}")
        arm_names = [a for a in arm_names if a in args.arms]
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1])
    cores = os.cpu_count() or 1
    parallel = args.parallel or (2 if cores >= 2 else 1)
    threads = args.threads or max(1, cores // parallel)

    base_config = out / "base_config.yaml"
    base_config.write_text(yaml.safe_dump(base, sort_keys=False))
    work = Path(tempfile.mkdtemp(prefix="klppo-compare-"))

    # Validate every arm with train.py's parser before anything runs (a typo fails here, not after an hour).
    parsed = {}
    for arm in arm_names:
        try:
            parsed[arm] = parse(
                train_argv(base_config, arm_overrides(base, spec["arms"][arm]), seeds[0], str(work / "check"))
            )
        except (ValueError, TypeError) as err:
            print(f"error: arm {arm!r}: {err}", file=sys.stderr)
            return 2
    _, training_args, model_args = parsed[arm_names[0]]
    target = training_args.kl_target
    if target is None:
        print("error: the experiment needs a kl_target (fixed arms are measured against it).", file=sys.stderr)
        return 2

    jobs = []
    for seed in seeds:  # seed-major: an interrupted experiment still has whole seeds
        for arm in arm_names:
            fields = spec["arms"][arm]
            name = f"{arm}-seed{seed}"
            record = out / "runs" / f"{name}.json"
            fp = fingerprint(base, fields, seed, resolved_settings(parsed[arm][1]))
            if record_is_done(record, fp):
                print(f"  {name}: already done, kept", flush=True)
                continue
            jobs.append(
                {
                    "name": name,
                    "arm": arm,
                    "seed": seed,
                    "fields": fields,
                    "fingerprint": fp,
                    "threads": threads,
                    "record": str(record),
                    "argv": train_argv(base_config, arm_overrides(base, fields), seed, str(work / name)),
                }
            )
    failed = []
    if jobs and not args.summarize:
        print(f"{len(jobs)} run(s) to train, {parallel} at a time with {threads} thread(s) each", flush=True)
        failed = run_all(jobs, parallel, out)
    shutil.rmtree(work, ignore_errors=True)

    records: dict[str, list[dict]] = {}
    for arm in arm_names:
        for seed in seeds:
            path = out / "runs" / f"{arm}-seed{seed}.json"
            if path.is_file():
                records.setdefault(arm, []).append(json.loads(path.read_text()))
    if not records:
        print("error: no finished runs to summarise.", file=sys.stderr)
        return 1
    one = next(iter(records.values()))[0]
    meta = {
        "name": out.name,
        "command": command,
        "machine": machine_text(),
        "model": model_args.model_name_or_path,
        "updates": max(len(r["updates"]) for runs in records.values() for r in runs),
        "sequences_per_update": one["sequences_per_update"],
        "seeds": sorted({r["seed"] for runs in records.values() for r in runs}),
        "kl_target": target,
        "kl_target_unit": training_args.kl_target_unit,
        "kl_estimator": training_args.kl_estimator,
        # what the runs read (records older than `kl_statistic` read their estimator, `k1` in every shipped run)
        "kl_statistic": ", ".join(
            sorted({r.get("kl_statistic", training_args.kl_estimator) for runs in records.values() for r in runs})
        ),
        "kl_mode": training_args.kl_mode,
        "band": spec["band"],
        "final_window": spec["final_window"],
        "parallel": parallel,
        "threads_per_run": threads,
        "runs_run_this_invocation": 0 if args.summarize else len(jobs),
        "wall_seconds_invocation": time.time() - start,
        "invocations": [],
        "run_wall_seconds_sum": sum(r["wall_seconds"] for runs in records.values() for r in runs),
        "failed_runs": [job["name"] for job, _ in failed],
    }
    summary = {"experiment": meta, "arms": summarize(records, spec, target)}
    summary["plots"] = make_plots(records, target, spec["band"], training_args.kl_target_unit, out)
    meta["wall_seconds_invocation"] = time.time() - start
    # every invocation is appended to invocations.json, so the wall time of the one that trained the runs
    # survives a later --summarize or an interrupted-and-resumed experiment
    log_path = out / "invocations.json"
    invocations = json.loads(log_path.read_text()) if log_path.is_file() else []
    invocations.append(
        {
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)),
            "command": command,
            "runs_trained": meta["runs_run_this_invocation"],
            "failed": meta["failed_runs"],
            "parallel": parallel,
            "threads_per_run": threads,
            "wall_seconds": meta["wall_seconds_invocation"],
        }
    )
    write_json(log_path, invocations)
    meta["invocations"] = invocations
    write_json(out / "summary.json", _clean(summary))
    write_markdown(summary, out)
    print((out / "summary.md").read_text(), flush=True)
    if failed:
        for job, reason in failed:
            log_path = out / "logs" / f"{job['name']}.log"
            log = log_path.read_text() if log_path.is_file() else ""
            print(f"\n{job['name']} failed ({reason}); end of its log:\n{log[-3000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
