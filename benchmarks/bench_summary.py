"""The figures of `bench.py` from its runs: per side the medians over the measured updates of all repeats (time per
update, phases, memory), the ratios klppo / peer, and the growth report's log-log slopes."""

from __future__ import annotations

import math
import statistics

PHASE_ROWS = [
    ("generation", "time/generation", "time/generation"),
    ("score: policy log-probs", "time/score_policy", "time/score_policy"),
    ("score: reference log-probs", "time/score_ref", "time/score_ref"),
    ("score: values", "time/score_value", "time/score_value"),
    ("reward", "time/reward", "time/reward"),
    ("KL (peer: KL + rewards + GAE window)", "time/kl", "time/kl_rewards_gae"),
    ("advantages (klppo: GAE and whitening)", "time/advantages", "time/advantages"),
    ("undo copy for a non-finite step (klppo, LoRA)", "time/rollback_snapshot", "time/rollback_snapshot"),
    ("optimise (PPO epochs)", "time/optimise", "time/optimise"),
    ("explicit gc.collect() (peer only)", "time/gc", "time/gc"),
]


WALL = {"klppo": "time/update_wall", "peer": "time/update"}


def summarise_side(runs: list[dict], side: str) -> dict:
    """Pool the measured updates of all repeats of one side: medians per update and per phase."""
    measured = [u for r in runs for u in r["per_update"][r["warmup"] :]]
    wall = WALL[side]
    time_per_update = statistics.median(u[wall] for u in measured)
    phases = {}
    for label, klppo_key, peer_key in PHASE_ROWS:
        key = klppo_key if side == "klppo" else peer_key
        phases[key] = statistics.median(u.get(key, 0.0) for u in measured)
    phases["time/other"] = statistics.median(
        u[wall] - sum(u.get(k if side == "klppo" else p, 0.0) for _, k, p in PHASE_ROWS) for u in measured
    )
    if side == "klppo":
        phases["time/update"] = statistics.median(u["time/update"] for u in measured)
    phases[wall] = time_per_update
    settings = runs[0]["settings"]
    summary = {
        "implementation": runs[0]["implementation"],
        "layout": runs[0]["layout"],
        "time_per_update_s": time_per_update,
        "time_per_update_per_repeat_s": [r["time_per_update_s"] for r in runs],
        "phases_s": phases,
        "tokens_per_s": settings["batch_size"] * settings["response_length"] / time_per_update,
        # apart from the measured updates: the first update (lazy initialisation, kernel selection) and setup
        "first_update_s": median_of(runs, "first_update_s"),
        # the whole run's updates, the first (compilation, warm-up) included: what a run of this length costs
        "all_updates_s": statistics.median(sum(u[wall] for u in r["per_update"]) for r in runs),
        "setup_s": median_of(runs, "setup_s"),
        "process_s": median_of(runs, "process_s"),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "peak_rss_per_repeat_mb": [r["peak_rss_mb"] for r in runs],
        "peak_rss_above_start_mb": statistics.median(r["peak_rss_mb"] - r["rss_at_start_mb"] for r in runs),
        # reports written before these fields existed had `cuda_peak_mb` (allocated)
        "cuda_peak_allocated_mb": median_of(runs, "cuda_peak_allocated_mb", "cuda_peak_mb"),
        "cuda_peak_reserved_mb": median_of(runs, "cuda_peak_reserved_mb"),
        "trainable_parameters": runs[0]["trainable_parameters"],
        "measured_updates": len(measured),
        "versions": runs[0]["versions"],
    }
    if side == "klppo":
        summary["kl_share"] = statistics.median(u.get("time/kl", 0.0) / u["time/update"] for u in measured)
        # how generation decoded, and what each update compiled and recorded (reports before these fields lack them)
        summary["decoding"] = runs[0].get("decoding")
        summary["compiles_per_update"] = [r.get("compiles_per_update") for r in runs]
    else:
        summary["kl_window_share"] = statistics.median(u.get("time/kl_rewards_gae", 0.0) / u[wall] for u in measured)
    return summary


def median_of(runs: list[dict], key: str, fallback: str | None = None):
    """Median over runs of `key` (or of `fallback` where a run lacks it); None when no run has either."""
    values = [r.get(key, r.get(fallback) if fallback else None) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio_of(a, b):
    return a / b if a is not None and b else None


def compare(klppo: dict, peer: dict) -> dict:
    paired = [k / p for k, p in zip(klppo["time_per_update_per_repeat_s"], peer["time_per_update_per_repeat_s"])]
    return {
        "time_ratio_klppo_over_peer": klppo["time_per_update_s"] / peer["time_per_update_s"],
        "time_ratio_per_repeat": paired,
        "throughput_ratio_peer_time_over_klppo_time": peer["time_per_update_s"] / klppo["time_per_update_s"],
        "first_update_ratio_klppo_over_peer": ratio_of(klppo.get("first_update_s"), peer.get("first_update_s")),
        "setup_ratio_klppo_over_peer": ratio_of(klppo.get("setup_s"), peer.get("setup_s")),
        "peak_rss_ratio_klppo_over_peer": klppo["peak_rss_mb"] / peer["peak_rss_mb"],
        "peak_rss_above_start_ratio_klppo_over_peer": klppo["peak_rss_above_start_mb"]
        / peer["peak_rss_above_start_mb"],
        "cuda_peak_allocated_ratio_klppo_over_peer": ratio_of(
            klppo.get("cuda_peak_allocated_mb"), peer.get("cuda_peak_allocated_mb")
        ),
        "cuda_peak_reserved_ratio_klppo_over_peer": ratio_of(
            klppo.get("cuda_peak_reserved_mb"), peer.get("cuda_peak_reserved_mb")
        ),
    }


def summarise_workload(runs: dict[str, list[dict]]) -> dict:
    result = {side: summarise_side(side_runs, side) for side, side_runs in runs.items()}
    if "peer" in result:
        result["ratios"] = compare(result["klppo"], result["peer"])
    result["runs"] = runs
    return result


def _slope(xs, ys) -> float:
    """Least-squares slope of log(ys) against log(xs); NaN when it is undefined (a y <= 0, or a single x)."""
    if min(ys) <= 0 or len(set(xs)) < 2:
        return math.nan
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def growth_slopes(points: list[dict], sides: list[str]) -> dict:
    """Log-log slopes of time per update (and of klppo's generation and PPO epochs) against response length at
    the smallest batch, and against the batch at the shortest length: 1 = linear, 2 = quadratic."""
    out = {}
    for axis, fixed, vary in (
        ("response_length", "batch_size", "response_length"),
        ("batch_size", "response_length", "batch_size"),
    ):
        base = min(p[fixed] for p in points)
        line = sorted((p for p in points if p[fixed] == base), key=lambda p: p[vary])
        if len(line) < 2:
            continue
        xs = [p[vary] for p in line]
        out[axis] = {f"{side} time/update": _slope(xs, [p[side]["time_per_update_s"] for p in line]) for side in sides}
        for phase in ("time/generation", "time/optimise"):
            out[axis][f"klppo {phase}"] = _slope(xs, [p["klppo"]["phases_s"][phase] for p in line])
        out[axis]["klppo peak RSS above start"] = _slope(xs, [p["klppo"]["peak_rss_above_start_mb"] for p in line])
    return out
