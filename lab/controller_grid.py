"""The KL controller across plant speeds: the one-token bandit of `klppo.testing.bandit`, whose equilibrium beta*
is known in closed form, trained with a KL target from beta*/5 and from 5 beta* at every combination of learning
rate, optimizer steps per update and batch size. The target is the KL of the optimum that the configured KL trains
toward at beta* (`klppo.kl.optimum.kl_optimum_of`: the tilt, or the forward-KL optimum of `k3` in the loss). From the
repository root:

    python -m lab.controller_grid --seeds 1 2 3 --out results/controller_grid/grid.jsonl
    python -m lab.controller_grid --table results/controller_grid/grid.jsonl
    python -m lab.controller_grid --overview shipped=a.jsonl no-guard=b.jsonl --paired
    python -m lab.controller_grid --envelope tiny_fixed_beta.jsonl [--against grid.jsonl]

Each run is one line of JSON: the cell, the seed, and per update the exact KL of the sampling policy (the `full`
statistic of a one-token response) and beta, and at the end the trained policy's exact KL(pi || pi*) to the optimum
at beta* (`kl_to_optimum`; null where the configured KL's optimum has no closed form). The table gives, per cell,
the second-half tracking error (mean |KL - target| / target), the peak KL over the target, and the second half's
geometric-mean beta over beta*, as mean and standard error over seeds (`klppo.kl.tracking`). `--kwargs` sets
`kl_controller_kwargs` (JSON), `--config` any other `KLPPOConfig` field (JSON; the experimental settings under
`experimental`, e.g. `'{"experimental": {"kl_guard": false}}'`, added to the grid's own `kl_statistic: full`), for
ablations;
`--plugin` imports a module that registers a controller or a guard of its own (`lab.controller_ablations`, or a
module of the lab by its short name); `--updates` runs every cell for that many updates instead of `updates_for(lr)`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import tempfile
from pathlib import Path

from klppo.kl.tracking import mean_and_standard_error, tracking_stats

STARTS = (0.2, 5.0)
LEARNING_RATES = (3e-4, 1e-3, 3e-3)
STEPS_PER_UPDATE = (1, 4)
BATCHES = (32, 64, 128)
BETA_STAR = 0.5
BOUNDS = {"tracking_error": 0.3, "peak": 3.0, "beta_ratio": 1.3}
# a stricter bar: second-half tracking error, peak KL over the target, and the last update's beta within x/1.5 of beta*
STRICT = {"tracking_error": 0.2, "peak": 2.0, "final_beta": 1.5}
# the policy has converged when it ends within this KL(pi || pi*) of the optimum at beta*; the converged bar asks the
# last beta to be within x/1.5 of beta* only then (a policy still on its way needs a beta away from beta*)
CONVERGED = 0.05


def updates_for(lr: float) -> int:
    """120 updates at lr 1e-3 and above; proportionally more below (400 at 3e-4), so that a fixed beta* reaches
    the target within the run at every speed."""
    return round(120 * max(1.0, 1e-3 / lr))


def run_cell(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from klppo.kl.optimum import KLOptimum, kl_optimum_of
    from klppo.models import TINY_MODEL, resolve_model_path
    from klppo.testing.bandit import bandit_trainer, kl, one_token_state
    from lab import import_plugin

    if job.get("plugin"):  # a module that registers a controller or a guard of its own
        import_plugin(job["plugin"])
    tiny = resolve_model_path(TINY_MODEL)
    config = dict(job.get("config") or {})
    # the optimum the configured KL trains toward (the reverse-KL tilt, or k3's forward-KL optimum in the loss)
    known = kl_optimum_of(config.get("kl_mode", "reward"), config.get("kl_estimator", "k1"))
    optimum = known or KLOptimum()
    with tempfile.TemporaryDirectory() as tmp:
        state = one_token_state(bandit_trainer(tiny, Path(tmp), max_steps=1))
        target = kl(optimum.exact(state["ref"], state["reward"], BETA_STAR), state["ref"])
        steps, batch = job["steps"], job["batch"]
        overrides = dict(
            kl_coef=job["start"] * BETA_STAR,
            max_steps=job.get("updates") or updates_for(job["lr"]),
            learning_rate=job["lr"],
            per_device_train_batch_size=batch // steps,
            num_mini_batches=steps,
            rollout_forward_batch_size=batch,
            seed=job["seed"],
        )
        if not job.get("fixed"):  # fixed jobs start at beta* (`cells((1.0,))`) and keep it
            overrides.update(kl_target=target)
            if job.get("kwargs"):
                overrides.update(kl_controller_kwargs=job["kwargs"])
        overrides.update(experimental={"kl_statistic": "full", **(config.pop("experimental", None) or {})})
        overrides.update(config)  # experimental settings named flat here are added to the mapping (`klppo_config`)
        trainer = bandit_trainer(tiny, Path(tmp), **overrides)
        trainer.train()
        end = one_token_state(trainer)
        # None where the configured KL's optimum has no closed form (the target above then falls back to the tilt's)
        to_optimum = kl(end["logp"], known.exact(end["ref"], end["reward"], BETA_STAR)) if known else None
    logs = [h for h in trainer.state.log_history if "kl/coef" in h]
    return {
        **job,
        "target": target,
        "beta_star": BETA_STAR,
        "optimum": optimum.describe(),
        "kl_to_optimum": to_optimum,
        "kl": [h["kl/value"] for h in logs],
        "beta": [h["kl/coef"] for h in logs],
        "guard": [h.get("kl/guard_fired", 0.0) for h in logs],
        "guard_low": [h.get("kl/guard_low_fired", 0.0) for h in logs],
    }


def summarise(run: dict) -> dict:
    kls, betas = run["kl"], run["beta"]
    stats = tracking_stats(kls, run["target"])
    logs = [math.log(b) for b in betas[len(kls) // 2 :]]
    return {
        "tracking_error": stats.error,
        "in_band": stats.in_band,
        "peak": stats.peak_ratio,
        "beta_ratio": math.exp(sum(logs) / len(logs)) / run["beta_star"],
    }


def start_label(start: float) -> str:
    """A run's first beta, as the tables name it (a multiple of beta*)."""
    return {0.2: "beta*/5", 5.0: "5 beta*", 1.0: "beta* (fixed)"}.get(start, f"{start:g} beta*")


def cells(starts=STARTS, lrs=LEARNING_RATES, batches=BATCHES):
    return [
        dict(start=s, lr=lr, steps=k, batch=b)
        for s, lr, k, b in itertools.product(starts, lrs, STEPS_PER_UPDATE, batches)
    ]


def passes(s: dict) -> bool:
    return (
        s["tracking_error"] <= BOUNDS["tracking_error"]
        and s["peak"] <= BOUNDS["peak"]
        and 1 / BOUNDS["beta_ratio"] <= s["beta_ratio"] <= BOUNDS["beta_ratio"]
    )


def meets_strict(run: dict) -> bool:
    """Whether a run is within `STRICT`."""
    s, final = summarise(run), run["beta"][-1] / run["beta_star"]
    return (
        s["tracking_error"] <= STRICT["tracking_error"]
        and s["peak"] <= STRICT["peak"]
        and 1 / STRICT["final_beta"] <= final <= STRICT["final_beta"]
    )


def meets_converged_bar(run: dict) -> bool | None:
    """`STRICT`, with the last beta checked only where the run ends within `CONVERGED` of the optimum at beta*
    (KL(pi || pi*), exact from the trained policy's logits); None for a run recorded without it, or with it null (the
    configured KL's optimum has no closed form)."""
    if run.get("kl_to_optimum") is None:
        return None
    s, final = summarise(run), run["beta"][-1] / run["beta_star"]
    beta_ok = run["kl_to_optimum"] > CONVERGED or 1 / STRICT["final_beta"] <= final <= STRICT["final_beta"]
    return s["tracking_error"] <= STRICT["tracking_error"] and s["peak"] <= STRICT["peak"] and beta_ok


def table(runs: list[dict]) -> str:
    """Markdown: one row per cell, mean +- standard error over seeds; a cell passes when every seed does."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run["start"], run["lr"], run["steps"], run["batch"])
        groups.setdefault(key, []).append(summarise(run))
    lines = [
        "| start | lr | steps/update | batch | seeds | tracking error | in band | peak KL / target "
        "| geo-mean beta / beta* | every seed within bounds |",
        "|" + " --- |" * 10,
    ]
    n_pass = 0
    for key in sorted(groups):
        rows = groups[key]
        ok = all(passes(r) for r in rows)
        n_pass += ok
        cols = []
        for name in ("tracking_error", "in_band", "peak", "beta_ratio"):
            mean, se = mean_and_standard_error([r[name] for r in rows])
            cols.append(f"{mean:.2f} ± {se:.2f}" if len(rows) > 1 else f"{mean:.2f}")
        start = start_label(key[0])
        lines.append(
            f"| {start} | {key[1]:g} | {key[2]} | {key[3]} | {len(rows)} | "
            + " | ".join(cols)
            + f" | {'yes' if ok else '**no**'} |"
        )
    worst = {name: max(summarise(r)[name] for r in runs) for name in ("tracking_error", "peak")}
    ratios = [summarise(r)["beta_ratio"] for r in runs]
    lines.append("")
    lines.append(
        f"{n_pass} of {len(groups)} cells within bounds on every seed (tracking error <= "
        f"{BOUNDS['tracking_error']}, peak <= {BOUNDS['peak']}x, beta within x/{BOUNDS['beta_ratio']} of "
        f"beta*). Worst run: tracking error {worst['tracking_error']:.2f}, peak {worst['peak']:.2f}x, beta "
        f"{min(ratios):.2f}-{max(ratios):.2f} beta*."
    )
    return "\n".join(lines) + "\n"


def overview(named: dict[str, list[dict]]) -> str:
    """Markdown: one row per variant (an ablation), over all its runs: cells within bounds on every seed, mean
    tracking error and share in band over the runs, the worst peak, the range of the geometric-mean beta, and cells
    within the strict bar (`STRICT`) on every seed, and within the converged bar (`meets_converged_bar`; "-" for runs
    recorded without KL(pi || pi*))."""
    lines = [
        "| variant | cells within bounds | mean tracking error | mean in band | worst peak KL / target "
        "| geo-mean beta / beta* | cells within the strict bar | cells within the converged bar |",
        "|" + " --- |" * 8,
    ]
    for name, runs in named.items():
        groups: dict[tuple, list[dict]] = {}
        for run in runs:
            groups.setdefault((run["start"], run["lr"], run["steps"], run["batch"]), []).append(run)
        rows = [summarise(r) for g in groups.values() for r in g]
        ok = sum(all(passes(summarise(r)) for r in g) for g in groups.values())
        strict = sum(all(meets_strict(r) for r in g) for g in groups.values())
        verdicts = [[meets_converged_bar(r) for r in g] for g in groups.values()]
        converged = (
            "-" if any(v is None for g in verdicts for v in g) else f"{sum(all(g) for g in verdicts)} of {len(groups)}"
        )
        ratios = [r["beta_ratio"] for r in rows]
        lines.append(
            f"| {name} | {ok} of {len(groups)} | {sum(r['tracking_error'] for r in rows) / len(rows):.3f} | "
            f"{sum(r['in_band'] for r in rows) / len(rows):.2f} | {max(r['peak'] for r in rows):.2f} | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | {strict} of {len(groups)} | {converged} |"
        )
    return "\n".join(lines) + "\n"


def paired(named: dict[str, list[dict]]) -> str:
    """Markdown: each variant against the first one named, paired by cell and seed: the mean and standard error of
    the difference in second-half tracking error and in share in band (variant minus the first), over the pairs."""

    def keyed(runs):
        return {(r["start"], r["lr"], r["steps"], r["batch"], r["seed"]): summarise(r) for r in runs}

    (base_name, base), *others = [(name, keyed(runs)) for name, runs in named.items()]
    lines = [
        f"| variant | pairs | tracking error minus {base_name}'s | in band minus {base_name}'s |",
        "|" + " --- |" * 4,
    ]
    for name, runs in others:
        keys = sorted(set(runs) & set(base))
        cols = []
        for metric in ("tracking_error", "in_band"):
            mean, se = mean_and_standard_error([runs[k][metric] - base[k][metric] for k in keys])
            cols.append(f"{mean:+.3f} ± {se:.3f}")
        lines.append(f"| {name} | {len(keys)} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def tracking_error_bound(run: dict, target: float | None = None) -> float:
    """For a run at a fixed, tiny beta (the fastest the KL can arrive), the least second-half tracking error any
    schedule of beta >= 0 could reach if the KL can rise no faster than in this run: the mean over the second half's
    finite readings of max(0, 1 - KL / target) (``target``: the run's own, or another's, e.g. the lower one of `k3` in
    the loss)."""
    kls, target = run["kl"], run["target"] if target is None else target
    second = [k for k in kls[len(kls) // 2 :] if math.isfinite(k)]
    return sum(max(0.0, 1 - k / target) for k in second) / len(second) if second else float("nan")


def envelope(runs: list[dict]) -> str:
    """Markdown: for runs at a fixed, tiny beta, per run the first update whose KL reaches 0.8x the target and
    `tracking_error_bound`."""
    lines = [
        "| cell (lr, steps, batch) | seed | first update at 0.8x the target | tracking error bound |",
        "|" + " --- |" * 4,
    ]
    for run in sorted(runs, key=lambda r: (r["lr"], r["steps"], r["batch"], r["seed"])):
        first = next((i + 1 for i, k in enumerate(run["kl"]) if k >= 0.8 * run["target"]), None)
        lines.append(
            f"| {run['lr']:g}, {run['steps']}, {run['batch']} | {run['seed']} | {first} "
            f"| {tracking_error_bound(run):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _envelope_key(run: dict) -> tuple:
    return run["lr"], run["steps"], run["batch"], run["seed"], len(run["kl"])


def against_envelope(envelope_runs: list[dict], runs: list[dict]) -> str:
    """Markdown: every run whose cell (learning rate, steps, batch), seed and number of updates the envelope ran, with
    its tracking error, the bound on that cell and seed against the run's own target, the run's excess over it (the
    part of its tracking error a controller could still remove) and whether it is within `STRICT`'s tracking error.
    Runs above that bar whose cell, seed or length the envelope lacks are counted below the table."""
    fixed = {_envelope_key(r): r for r in envelope_runs}
    lines = [
        "| cell (lr, steps, batch) | start | seed | tracking error | bound | excess | within "
        f"{STRICT['tracking_error']} |",
        "|" + " --- |" * 7,
    ]
    missing = 0
    for run in sorted(runs, key=lambda r: (r["lr"], r["steps"], r["batch"], r["start"], r["seed"])):
        error = summarise(run)["tracking_error"]
        within = error <= STRICT["tracking_error"]
        envelope_run = fixed.get(_envelope_key(run))
        if envelope_run is None:
            missing += not within
            continue
        bound = tracking_error_bound(envelope_run, run["target"])
        start = start_label(run["start"])
        lines.append(
            f"| {run['lr']:g}, {run['steps']}, {run['batch']} | {start} | {run['seed']} | {error:.3f} "
            f"| {bound:.3f} | {error - bound:+.3f} | {'yes' if within else '**no**'} |"
        )
    if missing:
        lines.append(
            f"\n{missing} run(s) above {STRICT['tracking_error']} in cells, seeds or lengths the envelope did not run."
        )
    return "\n".join(lines) + "\n"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kwargs", type=json.loads, default=None, help="kl_controller_kwargs, as JSON")
    parser.add_argument(
        "--config",
        type=json.loads,
        default=None,
        help="other KLPPOConfig fields, as JSON (experimental settings under `experimental`)",
    )
    parser.add_argument("--fixed", action="store_true", help="fixed beta* instead of a target (the reference)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=None, help="updates per run (default: updates_for(lr))")
    parser.add_argument("--plugin", help="import this module first (one that registers a controller or a guard)")
    parser.add_argument("--only", type=json.loads, default=None, help="run only the cells matching this JSON")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LEARNING_RATES), help="the grid's learning rates")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="the grid's rollout batches")
    parser.add_argument("--table", type=Path, nargs="+", help="print the table of finished grid files and exit")
    parser.add_argument(
        "--overview", nargs="+", metavar="NAME=FILE[,FILE]", help="print one row per named variant (ablations) and exit"
    )
    parser.add_argument(
        "--envelope", type=Path, nargs="+", help="print, for fixed tiny-beta runs, how soon the KL can arrive, and exit"
    )
    parser.add_argument(
        "--against",
        type=Path,
        nargs="+",
        help="with --envelope: each run of these grid files whose cell, seed and length the envelope "
        "ran, beside the bound on it",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="with --overview: also each variant against the first, paired by cell and seed",
    )
    args = parser.parse_args()
    if args.against and not args.envelope:
        parser.error("--against sets grid runs beside an envelope: give the envelope's runs with --envelope FILE")
    if args.table:
        print(table([run for path in args.table for run in _read(path)]), end="")
        return
    if args.envelope:
        fixed = [run for path in args.envelope for run in _read(path)]
        if args.against:
            print(against_envelope(fixed, [run for path in args.against for run in _read(path)]), end="")
        else:
            print(envelope(fixed), end="")
        return
    if args.overview:
        named = {}
        for item in args.overview:
            name, files = item.split("=", 1)
            named[name] = [
                run
                for f in files.split(",")
                for run in _read(Path(f))
                if all(run[k] == v for k, v in (args.only or {}).items())
            ]
        print(overview(named), end="")
        if args.paired:
            print("\n" + paired(named), end="")
        return
    jobs = [
        dict(
            cell,
            seed=seed,
            kwargs=args.kwargs,
            config=args.config,
            fixed=args.fixed,
            plugin=args.plugin,
            updates=args.updates,
        )
        for cell in cells((1.0,) if args.fixed else STARTS, args.lrs, args.batches)
        for seed in args.seeds
        if all(cell[k] == v for k, v in (args.only or {}).items())
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool, args.out.open("w") as f:
        for run in pool.imap_unordered(run_cell, jobs):
            f.write(json.dumps(run) + "\n")
            f.flush()
            runs.append(run)
    print(table(runs), end="")


if __name__ == "__main__":
    main()
