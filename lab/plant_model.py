"""How well can any beta controller hold the KL? A plant model fitted to compare runs, and the floor it implies.

    python -m lab.plant_model --runs 'OUT/runs/*.json' --target 4 --out plant_model.json

(from the repository root) where OUT is a `lab/compare.py` results folder that kept its per-update run records
(`runs/`).

Each run record of `lab/compare.py` holds, per update t, the coefficient beta_t that update used and the KL
its rollout read (the controller's statistic, `kl/full` where logged, else `kl/k1`). From update `--start` on
(once the policy has left the reference), the model is a first-order lag in log space:

    log KL_{t+1} - log KL_t = a + b * log KL_t + c * log beta_t + eps_t,    eps_t ~ N(0, sigma^2)

fitted by least squares over all runs. `-c / b` is the steady-state sensitivity d log KL / d log beta, `1 + b`
the share of a KL deviation still there one update later, and `sigma` the part of each update's KL change that
beta does not explain: the policy's own step noise plus the reading's noise.

With x = log(KL / target), the fixed-beta and best-controller floors follow (Astrom, "Introduction to
Stochastic Control Theory", 1970, ch. 6: minimum-variance control of a process with a delay):

- fixed beta at the model's equilibrium: x is AR(1), stationary sd sigma / sqrt(1 - (1 + b)^2);
- a controller that sets beta_t after reading KL_t (one update of delay): sd sigma;
- klppo's order (the rollout's reading updates beta after that update's rewards are formed, so beta_t knows
  KL_{t-1}: two updates of delay): sd sigma * sqrt(1 + (1 + b)^2).

Each floor is reported as the mean of |KL / target - 1| and the share inside the +-band, for x ~ N(0, sd^2). It
is a floor for any controller acting on beta alone; a guard that stops an update's remaining mini-batches acts
inside the update and is not bound by it. Finally the model is simulated, for `--updates` updates from a
start-up ramp, with klppo's tracking controller under a list of settings (with and without the guard, modelled
as stopping the update at the first of `--mini-batches` mini-batch checks whose reading, with `--guard-noise`
relative noise, passes the bound while the step raises the KL, or, for the guard's low side once a reading has
reached its bound, falls below that bound while the step lowers the KL): this ranks settings before spending
real runs on them. The model's fit is a fact about the runs it was given; its predictions are checked by real runs.
Its limits: the runs are closed-loop (beta followed the KL), so lags beyond one update that the model leaves out
can bias `c` (the residuals' lag-1 autocorrelation is reported as a check); the guard is modelled as scaling the
update's whole change, noise included, and the optimizer's momentum, which carries a push into the next update,
is not modelled at all.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import sys

import numpy as np

from klppo.kl.controllers import TrackingKLController
from klppo.kl.tracking import tracking_stats
from lab.tracking import whole_run_stats


def load_series(patterns: list[str]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    series = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            updates = json.load(open(path))["updates"]
            kl = np.array([u["kl/full"] if "kl/full" in u else u["kl/k1"] for u in updates], dtype=float)
            beta = np.array([u["kl/coef"] for u in updates], dtype=float)
            series.append((path, kl, beta))
    if not series:
        raise SystemExit(f"no run records match {patterns}; point --runs at a compare output's runs/*.json")
    return series


def fit(series, start: int) -> dict:
    rows, ys = [], []
    for _, kl, beta in series:
        for t in range(start, len(kl) - 1):
            if kl[t] > 0 and kl[t + 1] > 0:
                rows.append([1.0, math.log(kl[t]), math.log(beta[t])])
                ys.append(math.log(kl[t + 1]) - math.log(kl[t]))
    x, y = np.array(rows), np.array(ys)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    # lag-1 autocorrelation of the residuals within each run: near 0 if one update of lag explains the dynamics
    lagged, start_row = [], 0
    for _, kl, _ in series:
        n = sum(1 for t in range(start, len(kl) - 1) if kl[t] > 0 and kl[t + 1] > 0)
        r = resid[start_row : start_row + n]
        start_row += n
        lagged += list(zip(r[:-1], r[1:]))
    pairs = np.array(lagged)
    autocorr = float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) if len(pairs) > 2 else float("nan")
    dof = len(y) - x.shape[1]
    sigma = float(math.sqrt(resid @ resid / dof))
    se = np.sqrt(np.diag(np.linalg.inv(x.T @ x)) * sigma**2)
    a, b, c = (float(v) for v in coef)
    return {
        "a": a,
        "b": b,
        "c": c,
        "se": [float(v) for v in se],
        "sigma": sigma,
        "n": len(y),
        "r2": float(1 - resid.var() / y.var()),
        "sensitivity": -c / b,
        "persistence": 1 + b,
        "residual_autocorrelation": autocorr,
    }


def floor(sd: float, band: float, n: int = 200_000) -> dict:
    """Tracking error and share in band of `n` readings `target * exp(x)`, x ~ N(0, sd^2) (a stationary KL)."""
    x = np.random.default_rng(0).standard_normal(n) * sd
    stats = whole_run_stats(np.exp(x).tolist(), 1.0, band)
    return {"sd_log": sd, "tracking_error": stats.error, "in_band": stats.in_band}


def simulate(
    model: dict,
    target: float,
    settings: dict,
    guard,
    updates: int,
    seed: int,
    mini_batches: int,
    guard_noise: float,
    reading_noise: float,
    kl_coef: float,
    ramp: float,
    band: float,
    same_update: bool = False,
    low=None,
) -> tuple:
    """One simulated run: the first updates ramp the KL up linearly whatever beta is (the policy leaving the
    reference), then the fitted model; returns (tracking error, share in band, share of mini-batch steps taken)
    over the second half. ``same_update``: beta is set from the reading before that update's step (one update
    of delay) instead of after it (klppo's order, two updates of delay). ``low``: the margin of the guard's low
    side below the target (klppo's guard has it at the target itself, 0), armed once a reading reaches
    ``target * (1 - low)``; None: off."""
    rng = np.random.default_rng(seed)
    ctl = TrackingKLController(kl_coef, target, **settings)
    a, b, c, sigma = model["a"], model["b"], model["c"], model["sigma"]
    ramp_updates = max(2, int(math.ceil(0.5 * target / ramp)))
    kls, x, steps, armed = [], None, [], False
    for t in range(updates):
        beta = ctl.value
        if x is None:
            kl = ramp * t * (1 + 0.1 * rng.standard_normal())
        else:
            kl = math.exp(x)
        kls.append(kl)
        ctl.update(kl * (1 + reading_noise * rng.standard_normal()), 1)
        if same_update:
            beta = ctl.value
        armed = armed or (low is not None and kl >= target * (1 - low))
        if t + 1 >= ramp_updates:
            now = math.log(max(kl, 1e-3))
            change = a + b * now + c * math.log(beta) + sigma * rng.standard_normal()
            taken = 1.0
            up, down = guard is not None and change > 0, armed and change < 0
            for j in range(1, mini_batches if up or down else 1):
                seen = now + guard_noise * rng.standard_normal() + j / mini_batches * change
                if (up and seen > math.log(target * (1 + guard))) or (down and seen < math.log(target * (1 - low))):
                    taken = j / mini_batches
                    break
            steps.append(taken)
            x = now + taken * change
    stats = tracking_stats(kls, target, band)
    return stats.error, stats.in_band, float(np.mean(steps)) if steps else 1.0


SETTINGS = {
    "tracking defaults": ({}, None),
    "defaults, guard 0.25": ({}, 0.25),
    "defaults, guard 0.1": ({}, 0.1),
    "defaults, guard 0": ({}, 0.0),
    "defaults, guard 0 on both sides (the guard's low side at the target)": ({}, 0.0, 0.0),
    "defaults, guard 0, low side at 0.8x the target": ({}, 0.0, 0.2),
    "lower gains (kp 0.15, ki 0.05, lookahead 1)": ({"kp": 0.15, "ki": 0.05, "lookahead": 1.0}, None),
    "no smoothing, no lookahead": ({"smoothing": 1.0, "lookahead": 0.0}, None),
    "no smoothing, no lookahead, guard 0.1": ({"smoothing": 1.0, "lookahead": 0.0}, 0.1),
    "no smoothing, no lookahead, guard 0": ({"smoothing": 1.0, "lookahead": 0.0}, 0.0),
    "no smoothing, no lookahead, ki 0.3, guard 0.1": ({"smoothing": 1.0, "lookahead": 0.0, "ki": 0.3}, 0.1),
}


def grid(model: dict, args) -> list[dict]:
    """Every combination of the tracking controller's gains in ``GRID``, with the guard at the target and
    without it, in klppo's order and with beta set from the same update's reading (the start-up integral kept
    at the shipped 0.075 per update, since the ramp does not model the start-up): mean second-half tracking
    error and share in band over ``args.sims`` simulated runs each, best first."""
    rows = []
    for same_update in (False, True):
        for kp, ki, lookahead, smoothing, guard in itertools.product(*GRID.values()):
            settings = dict(kp=kp, ki=ki, lookahead=lookahead, smoothing=smoothing, startup_rate=0.075 / ki)
            results = np.array(
                [
                    simulate(
                        model,
                        args.target,
                        settings,
                        guard,
                        args.updates,
                        seed,
                        args.mini_batches,
                        args.guard_noise,
                        args.reading_noise,
                        args.kl_coef,
                        args.ramp,
                        args.band,
                        same_update,
                    )
                    for seed in range(args.sims)
                ]
            )
            rows.append(
                {
                    "kp": kp,
                    "ki": ki,
                    "lookahead": lookahead,
                    "smoothing": smoothing,
                    "guard_margin": guard,
                    "same_update": same_update,
                    "tracking_error": float(results[:, 0].mean()),
                    "in_band": float(results[:, 1].mean()),
                }
            )
    return sorted(rows, key=lambda r: r["tracking_error"])


# --grid: the tracking controller's gains (the shipped ones are kp 0.3, ki 0.1, lookahead 2, smoothing 0.3, guard 0)
GRID = {
    "kp": (0.1, 0.3, 0.5),
    "ki": (0.05, 0.1, 0.2),
    "lookahead": (0.0, 1.0, 2.0),
    "smoothing": (0.3, 0.6, 1.0),
    "guard": (0.0, None),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="globs of compare run records (runs/*.json)")
    parser.add_argument("--target", type=float, required=True, help="the runs' kl_target (their statistic's unit)")
    parser.add_argument("--start", type=int, default=8, help="first update fitted (default 8)")
    parser.add_argument("--band", type=float, default=0.2)
    parser.add_argument("--updates", type=int, default=36, help="simulated run length (default 36)")
    parser.add_argument("--sims", type=int, default=300, help="simulated runs per setting (default 300)")
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument(
        "--guard-noise",
        type=float,
        default=0.05,
        help="relative noise of the guard's KL estimate (default 0.05: the rollout's `full` reading "
        "plus a change measured on the same tokens; 0.24 models k1 over 8 sequences alone)",
    )
    parser.add_argument(
        "--reading-noise",
        type=float,
        default=0.0,
        help="relative noise added to the simulated readings (default 0: sigma was fitted on readings, "
        "so it already holds their noise, about 0.04 for `full` over 32 sequences)",
    )
    parser.add_argument("--kl-coef", type=float, default=0.07, help="initial beta of the simulated runs")
    parser.add_argument("--ramp", type=float, default=0.25, help="start-up KL rise per update, nats (default 0.25)")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="also simulate every combination of gains in GRID, in both orders (see grid())",
    )
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)

    model = fit(load_series(args.runs), args.start)
    phi = model["persistence"]
    floors = {
        "fixed beta at equilibrium": floor(model["sigma"] / math.sqrt(max(1e-9, 1 - phi**2)), args.band),
        "any controller, beta set after reading the same update (1 update of delay)": floor(model["sigma"], args.band),
        "any controller, klppo's order (2 updates of delay)": floor(model["sigma"] * math.sqrt(1 + phi**2), args.band),
    }
    sims = {}
    for name, (settings, guard, *low) in SETTINGS.items():
        results = np.array(
            [
                simulate(
                    model,
                    args.target,
                    settings,
                    guard,
                    args.updates,
                    seed,
                    args.mini_batches,
                    args.guard_noise,
                    args.reading_noise,
                    args.kl_coef,
                    args.ramp,
                    args.band,
                    low=low[0] if low else None,
                )
                for seed in range(args.sims)
            ]
        )
        mean, se = results.mean(0), results.std(0, ddof=1) / math.sqrt(len(results))
        sims[name] = {
            "settings": settings,
            "guard_margin": guard,
            "guard_low_margin": low[0] if low else None,
            "tracking_error": float(mean[0]),
            "tracking_error_se": float(se[0]),
            "in_band": float(mean[1]),
            "steps_taken": float(mean[2]),
        }

    print(
        f"fit over {model['n']} update pairs: dlogKL = {model['a']:.3f} {model['b']:+.3f} logKL "
        f"{model['c']:+.3f} log beta  (SE {', '.join(f'{s:.3f}' for s in model['se'])}), "
        f"sigma {model['sigma']:.3f}, R^2 {model['r2']:.2f}"
    )
    print(
        f"sensitivity dlogKL/dlog beta = {model['sensitivity']:.2f}; persistence per update = {phi:.2f}; "
        f"lag-1 autocorrelation of the residuals {model['residual_autocorrelation']:+.2f}"
    )
    print("\nfloors (second-half mean |KL/target - 1|, share in band):")
    for name, f in floors.items():
        print(f"  {name}: sd {f['sd_log']:.3f} -> error {f['tracking_error']:.3f}, in band {f['in_band']:.0%}")
    print(f"\nsimulated {args.updates}-update runs ({args.sims} each):")
    for name, s in sims.items():
        print(
            f"  {name}: error {s['tracking_error']:.3f} +- {s['tracking_error_se']:.3f}, in band "
            f"{s['in_band']:.0%}, mini-batch steps taken {s['steps_taken']:.0%}"
        )
    swept = grid(model, args) if args.grid else None
    if swept:
        print(f"\ngrid ({len(swept)} settings, {args.sims} runs each), best 5 and the shipped gains, in each order:")
        for same_update in (False, True):
            rows = [r for r in swept if r["same_update"] == same_update]
            shipped = [
                r
                for r in rows
                if (r["kp"], r["ki"], r["lookahead"], r["smoothing"], r["guard_margin"]) == (0.3, 0.1, 2.0, 0.3, 0.0)
            ]
            print(f"  {'beta set from the same update' if same_update else 'klppo order'}:")
            for r in rows[:5] + shipped:
                print(
                    f"    kp {r['kp']}, ki {r['ki']}, lookahead {r['lookahead']}, smoothing {r['smoothing']}, guard "
                    f"{r['guard_margin']}: error {r['tracking_error']:.3f}, in band {r['in_band']:.0%}"
                    + ("  (shipped gains)" if r in shipped else "")
                )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        report = {
            "command": "python -m lab.plant_model " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": model,
            "floors": floors,
            "simulated": sims,
            "grid": swept,
            "settings": {k: v for k, v in vars(args).items() if k not in ("runs", "out")},
            "runs": args.runs,
        }
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
