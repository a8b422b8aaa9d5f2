"""The KL controller across reference resets: the one-token bandit of `klppo.testing.bandit` at the speed grid's
slowest and fastest corners (`lab.controller_grid`), trained with a KL target for two or more segments, the
reference reset to the policy at the start of each (`ref_reset_steps`). From the repository root:

    python -m lab.reset_corners --seeds 31 32 --out results/reset_corners/runs.jsonl
    python -m lab.reset_corners --table results/reset_corners/runs.jsonl

Each segment has the same target: the KL of the beta = 1 optimum of the first (0.12 nats). A target must be
reachable in every segment: after a reset the reference already puts more mass on the rewarded tokens, and with a
0/1 reward no policy that is a tilt of it lies further than `-log(its mass on them)` (the grid's target, the KL of
the beta = 0.5 optimum, 0.47 nats, is past that bound in the second segment). After a reset the KL to the new
reference starts again from 0. Per segment, the table gives the second-half tracking error and the peak reading
over the target (`klppo.kl.tracking`), as mean and standard error over seeds, for each corner, start (beta over the
target's coefficient) and KL configuration; the bar is a second-half tracking error <= 0.2 and a peak <= 2x in every segment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from klppo.kl.tracking import mean_and_standard_error, tracking_stats
from klppo.utils import atomic_path

CORNERS = {  # as the speed grid's: updates per segment at each corner
    "slow": dict(learning_rate=3e-4, per_device_train_batch_size=32, num_mini_batches=1, segment=400),
    "fast": dict(learning_rate=3e-3, per_device_train_batch_size=32, num_mini_batches=4, segment=120),
}
KL_SETTINGS = {
    "k1-reward": dict(kl_mode="reward", kl_estimator="k1"),
    "k2-loss": dict(kl_mode="loss", kl_estimator="k2"),
}
STARTS = (0.2, 5.0)
TARGET_BETA = 1.0  # the target is the KL of this coefficient's optimum in the first segment
BOUNDS = {"error": 0.2, "peak": 2.0}


def run(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from klppo.models import TINY_MODEL, resolve_model_path
    from klppo.testing.bandit import bandit_trainer, kl, one_token_state, tilted

    if job.get("plugin"):  # a module that registers a controller of its own
        from lab import import_plugin

        import_plugin(job["plugin"])
    tiny = resolve_model_path(TINY_MODEL)
    corner = dict(CORNERS[job["corner"]])
    controller = {"kl_controller": job["controller"]} if job.get("controller") else {}
    if job.get("experimental"):
        controller["experimental"] = job["experimental"]
    segment = corner.pop("segment")
    with tempfile.TemporaryDirectory() as tmp:
        state = one_token_state(bandit_trainer(tiny, Path(tmp), max_steps=1))
        target = kl(tilted(state["ref"], state["reward"], TARGET_BETA), state["ref"])
        trainer = bandit_trainer(
            tiny,
            Path(tmp),
            kl_target=target,
            kl_coef=job["start"] * TARGET_BETA,
            seed=job["seed"],
            rollout_forward_batch_size=128,
            max_steps=segment * job["segments"],
            ref_reset_steps=segment,
            **KL_SETTINGS[job["setting"]],
            **corner,
            **controller,
        )
        trainer.train()
    logs = [h for h in trainer.state.log_history if "kl/value" in h]
    return {
        **job,
        "target": target,
        "segment_updates": segment,
        "controller": trainer.args.kl_controller,
        "kl": [h["kl/value"] for h in logs],
        "beta": [h["kl/coef"] for h in logs],
        "resets": [int(h["kl/reference_resets"]) for h in logs],
    }


def segments(record: dict) -> list[dict]:
    """Per segment: `tracking_stats` of its readings against the target."""
    out = []
    for index in sorted(set(record["resets"])):
        readings = [k for k, r in zip(record["kl"], record["resets"]) if r == index]
        stats = tracking_stats(readings, record["target"])
        out.append({"segment": index + 1, "error": stats.error, "peak": stats.peak_ratio})
    return out


def table(records: list[dict]) -> str:
    lines = [
        "| KL | corner | start (beta / 1.0) | segment | seeds | tracking error, 2nd half | peak / target | within bounds |",
        "|" + " --- |" * 8,
    ]
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        for seg in segments(record):
            key = (f"{record['setting']} ({record['controller']})", record["corner"], record["start"], seg["segment"])
            groups.setdefault(key, []).append(seg)
    passed = 0
    for (setting, corner, start, segment), rows in sorted(groups.items()):
        error, error_se = mean_and_standard_error([r["error"] for r in rows])
        peak, peak_se = mean_and_standard_error([r["peak"] for r in rows])
        ok = all(r["error"] <= BOUNDS["error"] and r["peak"] <= BOUNDS["peak"] for r in rows)
        passed += ok
        lines.append(
            f"| {setting} | {corner} | {start:g} | {segment} | {len(rows)} | {error:.3f} ± {error_se:.3f} | "
            f"{peak:.2f} ± {peak_se:.2f} | {'yes' if ok else 'no'} |"
        )
    lines.append(
        f"\n{passed} of {len(groups)} (KL, corner, start, segment) groups within bounds on every seed "
        f"(second-half tracking error <= {BOUNDS['error']}, peak <= {BOUNDS['peak']}x)."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[31, 32])
    parser.add_argument("--segments", type=int, default=2)
    parser.add_argument("--kl", nargs="+", default=list(KL_SETTINGS), choices=list(KL_SETTINGS))
    parser.add_argument("--corners", nargs="+", default=list(CORNERS), choices=list(CORNERS))
    parser.add_argument("--starts", type=float, nargs="+", default=list(STARTS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--controller", default=None, help="kl_controller for every run (default: klppo's default)")
    parser.add_argument("--plugin", default=None, help="a module to import first (one that registers a controller)")
    parser.add_argument(
        "--experimental",
        type=json.loads,
        default=None,
        help="JSON: experimental settings for every run, e.g. '{\"kl_guard\": true}'",
    )
    parser.add_argument("--out", default=None, help="JSONL of the runs")
    parser.add_argument("--table", default=None, help="print the table of a JSONL instead of running")
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]))
        return
    jobs = [
        {
            "setting": k,
            "corner": c,
            "start": s,
            "seed": seed,
            "segments": args.segments,
            "controller": args.controller,
            "plugin": args.plugin,
            "experimental": args.experimental,
        }
        for k, c, s, seed in itertools.product(args.kl, args.corners, args.starts, args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        records = list(pool.map(run, jobs))
    if args.out:
        with atomic_path(args.out) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(table(records))


if __name__ == "__main__":
    main()
