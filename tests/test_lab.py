"""The lab's runners on hand-made runs (no training): the guard variants of the ablations, chosen through
`experimental`; the controller grid's, the default-task sweep's and the GRPO runs' tracking figures; the reward at
equal KL of `lab.frontier`."""

from __future__ import annotations

import json
import math

import pytest

from klppo import KLPPOConfig
from klppo.ppo.safety.kl_guard import LOWER, UPPER, KLGuard, build_kl_guard, kl_guards
from lab import controller_grid, default_resets, default_task_lr, frontier, import_plugin
from lab.grpo_kl_control import summarize as grpo_summary

pytestmark = pytest.mark.lab


@pytest.fixture(autouse=True)
def registries_as_they_were():
    """What a test's plug-in registers (controllers, guards) is unregistered after it, and the plug-in forgotten, so
    that the other tests of the same process see klppo's own registries."""
    import sys

    from klppo.kl import kl_controllers, unregister_kl_controller
    from klppo.ppo.safety.kl_guard import unregister_kl_guard

    controllers, guards = set(kl_controllers()), set(kl_guards())
    yield
    for name in set(kl_controllers()) - controllers:
        unregister_kl_controller(name)
    for name in set(kl_guards()) - guards:
        unregister_kl_guard(name)
    sys.modules.pop("lab.controller_ablations", None)


# ---------------------------------------------------------------------------- guard variants
def guard_config(tmp_path, kl_guard) -> KLPPOConfig:
    return KLPPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        kl_controller="tracking",
        kl_target=1.0,
        experimental={"kl_guard": kl_guard},
    )


def test_a_plugin_is_imported_once_under_its_lab_name():
    ablations = import_plugin("controller_ablations")
    assert ablations.__name__ == "lab.controller_ablations"
    assert import_plugin("lab.controller_ablations") is ablations  # registering twice would raise
    assert {"no_low_side", "keeps_momentum"} <= set(kl_guards())


def test_the_guard_variants_change_one_piece_each(tmp_path):
    """`no_low_side` never fires below the target; `keeps_momentum` fires as the default guard does but leaves the
    optimizer's momentum; both are chosen through `experimental`, as klppo's own guard is."""
    import_plugin("controller_ablations")
    guards = {
        name: build_kl_guard(guard_config(tmp_path, name).experimental.kl_guard, 1.0)
        for name in ("default", "no_low_side", "keeps_momentum")
    }
    for guard in guards.values():
        guard.observe(1.5)  # a reading at the target arms the low side (where there is one)
    # 8 tokens, their KL 0.6 at the rollout and 0.4 now: the update pushed the KL further below the target
    below = dict(kl_sum=0.4, kl_count=8.0, kl_rollout=0.6, reading=0.7)
    above = dict(kl_sum=0.9, kl_count=8.0, kl_rollout=0.6, reading=1.1)
    assert [guards[n].check(**below) for n in guards] == [LOWER, None, LOWER]
    assert [guards[n].check(**above) for n in guards] == [UPPER, UPPER, UPPER]
    assert [guards[n].clears_momentum for n in guards] == [True, True, False]
    assert "kl/guard_low_fired" not in guards["no_low_side"].metrics(None)
    assert type(guards["default"]) is KLGuard


def test_the_trainer_runs_the_guard_that_experimental_names(tmp_path):
    from klppo.models import TINY_MODEL, resolve_model_path
    from klppo.testing.bandit import bandit_trainer

    ablations = import_plugin("controller_ablations")
    trainer = bandit_trainer(
        resolve_model_path(TINY_MODEL),
        tmp_path,
        max_steps=1,
        kl_target=0.5,
        kl_controller="tracking",
        experimental={"kl_guard": "keeps_momentum"},
    )
    assert type(trainer.kl_guard) is ablations.GuardKeepingMomentum


# ---------------------------------------------------------------------------- controller grid
def grid_run(kls, betas, seed=1, lr=1e-3):
    return {
        "start": 0.2,
        "lr": lr,
        "steps": 1,
        "batch": 32,
        "seed": seed,
        "target": 2.0,
        "beta_star": 0.5,
        "kl": kls,
        "beta": betas,
    }


def test_the_grid_summary_of_one_run_by_hand():
    # second half: 2.0, 3.0 -> errors 0 and 0.5; in band 1 of 2; peak 4.0 / 2; beta 0.5 and 2.0 -> geo-mean 1.0
    s = controller_grid.summarise(grid_run([0.5, 4.0, 2.0, 3.0], [0.1, 0.1, 0.5, 2.0]))
    assert s == {"tracking_error": pytest.approx(0.25), "in_band": 0.5, "peak": 2.0, "beta_ratio": pytest.approx(2.0)}
    assert not controller_grid.passes(s)  # beta 2x beta*
    assert controller_grid.passes({**s, "beta_ratio": 1.2})


def test_the_grid_table_and_the_paired_difference():
    good = [grid_run([1.0, 2.0, 2.0, 2.2], [0.5] * 4, seed=k) for k in (1, 2)]
    bad = [grid_run([1.0, 2.0, 2.0, 3.0], [0.5] * 4, seed=k) for k in (1, 2)]
    table = controller_grid.table(good)
    assert "| beta*/5 | 0.001 | 1 | 32 | 2 | 0.05 ± 0.00 |" in table and "1 of 1 cells" in table
    overview = controller_grid.overview({"good": good, "bad": bad})  # the strict bar: tracking error <= 0.2
    assert overview.splitlines()[2].endswith("| 1 of 1 | - |") and overview.splitlines()[3].endswith("| 0 of 1 | - |")
    paired = controller_grid.paired({"good": good, "bad": bad})
    assert "| bad | 2 | +0.200 ± 0.000 | -0.500 ± 0.000 |" in paired


def test_a_grid_run_records_its_distance_to_the_optimum_of_the_configured_kl():
    """With a learning rate too small to move the policy, one update leaves it at the reference, so the distance the
    grid records is KL(ref || pi*) of the configured KL's optimum at beta*: the forward-KL optimum for `k3` in the
    loss, the tilt for `k2`; none for a KL without a closed-form optimum."""
    import tempfile
    from pathlib import Path

    from klppo.kl.optimum import kl_optimum_of
    from klppo.models import TINY_MODEL, resolve_model_path
    from klppo.testing.bandit import bandit_trainer, kl, one_token_state

    with tempfile.TemporaryDirectory() as tmp:
        state = one_token_state(bandit_trainer(resolve_model_path(TINY_MODEL), Path(tmp), max_steps=1))
    distances = {}
    for estimator in ("k3", "k2"):
        job = dict(
            start=1.0,
            lr=1e-12,
            steps=1,
            batch=8,
            seed=0,
            updates=1,
            config={"kl_mode": "loss", "kl_estimator": estimator},
        )
        distances[estimator] = controller_grid.run_cell(job)["kl_to_optimum"]
        optimum = kl_optimum_of("loss", estimator).exact(state["ref"], state["reward"], controller_grid.BETA_STAR)
        assert distances[estimator] == pytest.approx(kl(state["ref"], optimum), rel=1e-3)
    assert abs(distances["k3"] - distances["k2"]) > 0.01  # the two optima differ
    no_closed_form = dict(
        start=1.0, lr=1e-12, steps=1, batch=8, seed=0, updates=1, config={"kl_mode": "loss", "kl_estimator": "k1"}
    )
    assert controller_grid.run_cell(no_closed_form)["kl_to_optimum"] is None


def test_the_bound_proportional_variant_steps_toward_a_bound_by_the_kl_error_at_most():
    """A batch whose estimated KL of `ref` itself (`-log mean exp(-d)` = 0.5) exceeds the target 0.3 puts the estimate
    of beta* on the upper bound (10): klppo steps by the share (about 1) to nearly 10 with the KL measured 1.1x the
    target; the variant steps log beta by log(1.1) at most."""
    import math

    from klppo.kl import get_kl_controller
    from klppo.kl.controllers import EquilibriumKLController

    import_plugin("controller_ablations")
    r, d = [1.0] * 28 + [0.0] * 4, [0.5] * 32
    coefs = {}
    for name, cls in (
        ("shipped", EquilibriumKLController),
        ("variant", get_kl_controller("equilibrium_bound_proportional")),
    ):
        c = cls(0.5, target=0.3, approach_power=0.0, hold_power=0.0)
        c.arrived, c.last_error = True, 0.0
        c.observe_sequences(r, d, [1] * 32)
        coefs[name] = c.update(0.33, 1)
        assert math.exp(c.estimate) == pytest.approx(10.0)
    assert coefs["shipped"] > 9.0
    assert coefs["variant"] == pytest.approx(0.5 * 1.1)


def test_the_converged_bar_checks_the_last_beta_only_where_the_policy_has_converged():
    far = grid_run([1.0, 2.0, 2.0, 2.2], [0.5, 0.5, 0.5, 1.0])  # last beta 2x beta*, tracking error 0.05
    assert controller_grid.meets_converged_bar(far) is None  # recorded without KL(pi || pi*)
    assert not controller_grid.meets_strict(far)
    assert controller_grid.meets_converged_bar({**far, "kl_to_optimum": 0.06})  # still on its way: beta not checked
    assert not controller_grid.meets_converged_bar({**far, "kl_to_optimum": 0.05})  # converged: 2x is outside x/1.5
    assert controller_grid.meets_converged_bar({**far, "beta": [0.5] * 4, "kl_to_optimum": 0.01})
    late = grid_run([1.0, 2.0, 2.0, 1.0], [0.5] * 4)  # tracking error 0.25, peak 1x
    assert not controller_grid.meets_converged_bar({**late, "kl_to_optimum": 0.5})
    high = grid_run([5.0, 2.0, 2.0, 2.2], [0.5] * 4)  # tracking error 0.05, peak 2.5x
    assert not controller_grid.meets_converged_bar({**high, "kl_to_optimum": 0.5})
    assert controller_grid.meets_converged_bar({**far, "kl_to_optimum": None}) is None  # no closed-form optimum
    runs = [{**far, "seed": 1, "kl_to_optimum": 0.2}, {**far, "seed": 2, "kl_to_optimum": 0.01}]
    assert controller_grid.overview({"v": runs}).splitlines()[2].endswith("| 0 of 1 | 0 of 1 |")
    assert controller_grid.overview({"v": runs[:1]}).splitlines()[2].endswith("| 0 of 1 | 1 of 1 |")


def test_the_envelope_bounds_the_tracking_error_and_a_run_is_set_beside_its_own_cell_and_seed():
    # second half 1.0 and 3.0 against 2.0: deficits 0.5 and 0 (the excess above the target is not counted)
    fixed = grid_run([0.0, 0.0, 1.0, 3.0], [0.005] * 4)
    assert controller_grid.tracking_error_bound(fixed) == pytest.approx(0.25)
    # the first reading at 0.8 * 2 is update 4's (update 3's 1.0 is below it)
    assert controller_grid.envelope([fixed]).splitlines()[2] == "| 0.001, 1, 32 | 1 | 4 | 0.250 |"
    assert controller_grid.tracking_error_bound({**fixed, "kl": [0.0, 0.0, float("nan"), 1.5]}) == pytest.approx(0.25)
    other_cell = grid_run([0.0, 0.0, 2.0, 2.0], [0.005] * 4, lr=2e-3)  # bound 0 at lr 2e-3
    slow = grid_run([0.0, 0.0, 1.0, 1.5], [0.5] * 4)  # tracking error (0.5 + 0.25) / 2
    other_seed = {**slow, "seed": 2}
    longer = {**slow, "kl": [0.0] * 4 + slow["kl"], "beta": [0.5] * 8}  # 8 updates: not bounded by a 4-update envelope
    held = grid_run([0.0, 0.0, 2.0, 2.0], [0.5] * 4)  # within the strict bar: listed as such
    rows = controller_grid.against_envelope([other_cell, fixed], [slow, other_seed, longer, held]).splitlines()
    assert rows[2] == "| 0.001, 1, 32 | beta*/5 | 1 | 0.375 | 0.250 | +0.125 | **no** |"
    assert rows[3] == "| 0.001, 1, 32 | beta*/5 | 1 | 0.000 | 0.250 | -0.250 | yes |"
    assert len(rows) == 6 and rows[5].startswith("2 run(s) above 0.2")  # seed 2, and the longer run
    # a run with a lower target (k3 in the loss) is set beside the bound against its own target: deficit 0.8 / 1.8
    lower = {**slow, "target": 1.8}  # tracking error (0.8 / 1.8 + 0.3 / 1.8) / 2 = 0.306; bound 0.444 / 2
    row = controller_grid.against_envelope([fixed], [lower]).splitlines()[2]
    assert row.endswith("| 0.306 | 0.222 | +0.083 | **no** |")
    # a run of the other cell is set beside that cell's bound (0), not this one's
    moved = {**slow, "lr": 2e-3}
    row = controller_grid.against_envelope([fixed, other_cell], [moved]).splitlines()[2]
    assert row.endswith("| 0.375 | 0.000 | +0.375 | **no** |")


# ---------------------------------------------------------------------------- default task across learning rates
def write_default_run(folder, kls, betas, passed=True):
    folder.mkdir(parents=True)
    history = [
        {"step": i + 1, "kl/value": k, "kl/coef": b, "kl/target": 4.0} for i, (k, b) in enumerate(zip(kls, betas))
    ]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    verdict = {"learned": passed, "kl_held": True, "perplexity_kept": True, "reward_rise": 0.2}
    (folder / "summary.json").write_text(json.dumps({"verdict": verdict}))


def test_the_default_task_table_by_hand(tmp_path):
    write_default_run(tmp_path / "lr5e-4_seed1", [1.0, 4.0, 4.0, 5.0], [0.1, 0.1, 0.05, 0.2])
    write_default_run(tmp_path / "lr5e-4_seed2", [1.0, 4.0, 4.0, 4.0], [0.1, 0.1, 0.1, 0.1], passed=False)
    s = default_task_lr.summarise(tmp_path / "lr5e-4_seed1")
    assert s["tracking_error"] == pytest.approx(0.125) and s["in_band"] == 0.5 and s["peak"] == 1.25
    assert s["beta"] == pytest.approx(0.1) and s["passed"]
    table = default_task_lr.table(tmp_path, [1, 2])
    assert "| 5e-4 | 2 | 0.0625 ± 0.062 | 0.75 ± 0.25 |" in table and table.rstrip().endswith("| 1/2 |")
    assert "| 5e-4 | 1 |" in default_task_lr.table(tmp_path, [1])
    write_default_run(tmp_path / "lr2.5e-4_seed1", [4.0, 4.0], [0.1, 0.1])
    assert "| 2.5e-4 | 1 |" in default_task_lr.table(tmp_path, [1]) and "| 5e-4 |" in default_task_lr.table(
        tmp_path, [1]
    )
    only = default_task_lr.table(tmp_path, [1], ["2.5e-4"])
    assert "| 2.5e-4 | 1 |" in only and "| 5e-4 |" not in only


def test_the_reset_runs_by_segment_and_paired(tmp_path):
    """Two segments of 4 updates: the scores and KL of each, the KL to the starting model at the end (`kl/initial`
    with resets, `kl/k3` without), and the paired difference."""
    for arm, initial in (("none", "kl/k3"), ("reset4", "kl/initial")):
        for seed, shift in ((1, 0.0), (2, 1.0)):
            history = [
                {
                    "kl/value": 4.0 + (i >= 6),
                    "kl/target": 4.0,
                    "objective/scores": i + shift,
                    initial: 2.0 * (arm == "reset4") + i,
                }
                for i in range(8)
            ]
            folder = tmp_path / arm / f"lr5e-4_seed{seed}"
            folder.mkdir(parents=True)
            (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
            verdict = {"learned": True, "kl_held": seed == 1, "perplexity_kept": True, "perplexity_change": 0.1}
            (folder / "summary.json").write_text(json.dumps({"verdict": verdict}))
    s = default_resets.summarise(tmp_path / "none" / "lr5e-4_seed1", segment=4)
    assert (s["reward_first5_1"], s["reward_last5_1"], s["reward_first5_2"]) == (1.5, 1.5, 5.5)
    assert s["kl_ratio_1"] == 1.0 and s["kl_ratio_2"] == 1.25 and s["kl_initial_end"] == 5.0 and s["passed"]
    table = default_resets.table(tmp_path / "none", tmp_path / "reset4", segment=4)
    assert "| none | 2 | 2 ± 0.5 |" in table and "| 1/2 |" in table
    assert "| reset4 minus none, paired | 2 | +0 ± 0 |" in table and "| +2 ± 0 | +0 ± 0 | |" in table


# ---------------------------------------------------------------------------- GRPO runs
def test_a_grpo_runs_row_against_the_target():
    summary = {
        "kl": [0.0, 0.06, 0.03, 0.033],
        "reward_last5": 0.1,
        "ppl_before": 10.0,
        "ppl_after": 11.0,
        "beta": [0.5, 0.6],
        "seconds_per_update": 1.0,
    }
    r = grpo_summary.row(summary)
    assert r["tracking_error"] == pytest.approx(0.05) and r["in_band"] == 1.0
    assert r["kl_half"] == pytest.approx(0.0315) and r["ppl_change"] == pytest.approx(0.1) and r["beta_end"] == 0.6
    assert r["peak"] == pytest.approx(2.0)
    short = grpo_summary.row({**summary, "reward": [0.0, 0.2, 0.4, 0.6]}, first=2)  # a run of the first 2 updates
    assert short["kl_half"] == pytest.approx(0.06) and short["reward_last5"] == pytest.approx(0.1)
    assert short["beta_end"] == 0.6 and short["peak"] == pytest.approx(2.0)


# ---------------------------------------------------------------------------- reward at equal KL
def test_the_fixed_frontier_is_read_at_the_controlled_arms_kl(tmp_path, capsys):
    assert frontier.reward_at([(2.0, 0.2), (4.0, 0.4)], 3.0) == pytest.approx(0.3)
    assert frontier.reward_at([(2.0, 0.2), (4.0, 0.4)], 5.0) == pytest.approx(0.5)  # extended past the end
    per_seed = {
        "fixed-a": {"1": {"final_kl_k1": 2.0, "final_reward": 0.2}, "2": {"final_kl_k1": 2.0, "final_reward": 0.1}},
        "fixed-b": {"1": {"final_kl_k1": 4.0, "final_reward": 0.4}, "2": {"final_kl_k1": 4.0, "final_reward": 0.3}},
        "tracking": {
            "1": {"final_kl_k1": 3.0, "final_reward": 0.35},
            "2": {"final_kl": 3.0, "final_kl_k1": None, "final_reward": 0.25},
        },
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"arms": {arm: {"per_seed": seeds} for arm, seeds in per_seed.items()}}))
    frontier.main(["--arm", f"{path}:tracking", "--fixed", f"{path}:fixed-a,fixed-b"])
    out = capsys.readouterr().out
    # seed 1: 0.35 - 0.3 = +0.05; seed 2: 0.25 - 0.2 = +0.05 (its KL read from final_kl)
    assert "tracking minus fixed at equal KL: +0.050 +- 0.000 (SE, 2 seeds)" in out
    assert math.isclose(float(out.split("difference ")[1].split()[0]), 0.05)


def test_the_lab_uses_no_private_name_of_klppo():
    """The lab extends klppo through its public hooks (a controller's `next_coef`, a guard's class attributes and
    `check`, the registries): no `from klppo... import _name`, and no call of a private klppo method on a klppo
    object it did not define itself."""
    import ast
    from pathlib import Path

    lab = Path(__file__).resolve().parents[1] / "lab"
    offenders = []
    for path in lab.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("klppo"):
                offenders += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders


def test_the_integral_variants_of_the_equilibrium_controller():
    """`equilibrium_integral` lowers beta by `approach_integral` x the running sum of log(KL / target) until the KL
    arrives, then gives the equilibrium coefficient alone; `equilibrium_pi` multiplies it by exp(I), I the sum of
    `integral_gain` x log(KL / target), each term clipped at 2. (No batch is observed, so the equilibrium coefficient
    stays at its start, 0.5.)"""
    import math

    from klppo.kl import get_kl_controller

    import_plugin("controller_ablations")
    approach = get_kl_controller("equilibrium_integral")(0.5, target=1.0, approach_integral=0.1)
    factor = 0.5**0.75  # the shipped approach at KL = target / 2
    assert approach.update(0.5, 1) == pytest.approx(0.5 * factor * math.exp(0.1 * math.log(0.5)))
    assert approach.update(0.5, 1) == pytest.approx(0.5 * factor * math.exp(0.2 * math.log(0.5)))
    assert approach.update(1.0, 1) == pytest.approx(0.5) and approach.approach_sum == 0.0  # arrived: dropped
    pi = get_kl_controller("equilibrium_pi")(0.5, target=1.0, integral_gain=0.05, approach_power=0.0, hold_power=0.0)
    assert pi.update(2.0, 1) == pytest.approx(0.5 * math.exp(0.05 * math.log(2.0)))
    assert pi.update(math.e**5, 1) == pytest.approx(0.5 * math.exp(0.05 * math.log(2.0) + 0.05 * 2.0))
    assert pi.update(0.5, 1) == pytest.approx(0.5 * math.exp(0.05 * (math.log(2.0) + 2.0 + math.log(0.5))))


def test_the_window_variant_steps_toward_the_mean_of_its_recent_estimates():
    """`equilibrium_window` steps log beta, by the effective-sample-size gain, toward the mean of the last `window`
    estimates of log beta* weighted by their effective sample sizes. A stub optimum gives the estimates 1, 4, 4 with
    a full gain: beta goes 0.5 -> 1 -> 2 (the mean of log 1 and log 4) -> 4."""
    import math

    from klppo.kl import get_kl_controller
    from klppo.kl.optimum import KLOptimum

    estimates = iter([0.0, math.log(4.0), math.log(4.0)])

    class Stub(KLOptimum):
        def solve(self, r, d, target, lo, hi):
            return next(estimates)

        def ess(self, b, r, d):
            return 1.0

    import_plugin("controller_ablations")
    window = get_kl_controller("equilibrium_window")(0.5, target=1.0, approach_power=0.0, optimum=Stub(), window=2)
    for expected in (1.0, 2.0, 4.0):
        window.observe_sequences([0.0, 1.0], [0.1, 0.2], [1, 1])
        assert window.update(1.0, 1) == pytest.approx(expected)


def _mean_log_ratio_optimum():
    """A stub optimum for the Kalman variants' hand computations: its estimate of log beta* is the mean log-ratio of
    the sequences it is given (within the bounds), backed by the whole batch."""
    import torch

    from klppo.kl.optimum import KLOptimum

    class MeanLogRatio(KLOptimum):
        def solve(self, r, d, target, lo, hi):
            return min(max(float(torch.as_tensor(d).mean()), lo), hi)

        def ess(self, b, r, d):
            return 1.0

    return MeanLogRatio()


def test_the_kalman_variant_weighs_an_estimate_by_its_jackknife_variance():
    """`equilibrium_kalman` by hand: a stub optimum whose estimate of log beta* is the mean log-ratio of the
    sequences it is given, 8 sequences in 4 groups; the measurement variance is the grouped jackknife's, the gain
    prior / (prior + variance) with prior = 1 + drift^2, and the state's variance shrinks by (1 - gain). A batch whose
    estimate sits on a coefficient bound is no measurement: beta stays and the variance grows by drift^2."""
    import math

    import torch

    from klppo.kl import get_kl_controller

    import_plugin("controller_ablations")
    c = get_kl_controller("equilibrium_kalman")(
        0.5, target=1.0, approach_power=0.0, optimum=_mean_log_ratio_optimum(), drift=0.1, groups=4
    )
    scores, d = [0.0, 1.0] * 4, torch.tensor([0.1, 0.3, 0.2, 0.9, 0.5, 0.4, 0.0, 0.6], dtype=torch.float64)
    c.observe_sequences(scores, d.tolist(), [1] * 8)
    groups = torch.arange(8) % 4
    left_out = [float(d[groups != k].mean()) for k in range(4)]
    mean = sum(left_out) / 4
    variance = 3 / 4 * sum((b - mean) ** 2 for b in left_out)
    prior = 1.0 + 0.1**2
    gain = prior / (prior + variance)
    expected = math.exp(math.log(0.5) + gain * (float(d.mean()) - math.log(0.5)))
    assert c.update(1.0, 1) == pytest.approx(expected)
    assert c.variance == pytest.approx((1 - gain) * prior)
    before, variance_before = c.value, c.variance
    c.observe_sequences(scores, [20.0] * 8, [1] * 8)  # an estimate on the upper bound, log 10
    assert c.update(1.0, 1) == pytest.approx(before) and c.variance == pytest.approx(variance_before + 0.01)


def test_the_adaptive_kalman_variant_opens_its_variance_to_innovations_on_one_side():
    """`equilibrium_kalman_adaptive` by hand, with the stub optimum above: 8 sequences in 4 groups spread the same
    way around an estimate that keeps falling. The process variance is the median over the window of the
    innovation's square less the filter's variance and the measurement's (the grouped jackknife's), floored at
    drift^2. Innovations that stay on one side keep it above the floor, so the filter follows the estimate, where the
    plain filter's variance closes and beta lags behind."""
    import math
    import statistics

    import torch

    from klppo.kl import get_kl_controller

    import_plugin("controller_ablations")
    kwargs = dict(target=1.0, approach_power=0.0, optimum=_mean_log_ratio_optimum(), drift=0.05, groups=4)
    adaptive = get_kl_controller("equilibrium_kalman_adaptive")(1.0, window=3, **kwargs)
    plain = get_kl_controller("equilibrium_kalman")(1.0, **kwargs)
    spread = torch.tensor([0.4, -0.2, 0.1, -0.5, 0.3, 0.2, -0.1, -0.2], dtype=torch.float64)
    groups = torch.arange(8) % 4
    left_out = [float(spread[groups != k].mean()) for k in range(4)]
    measurement = 3 / 4 * sum((b - sum(left_out) / 4) ** 2 for b in left_out)
    excess, variance, log_beta = [], 1.0, 0.0
    for step in range(12):
        estimate = -0.2 * step  # log beta* keeps falling
        for c in (adaptive, plain):
            c.observe_sequences([0.0, 1.0] * 4, (estimate + spread).tolist(), [1] * 8)
            c.update(1.0, 1)
        innovation = estimate - log_beta
        excess = [*excess, innovation**2 - variance - measurement][-3:]
        prior = variance + max(0.05**2, statistics.median(excess))
        gain = prior / (prior + measurement)
        variance, log_beta = (1 - gain) * prior, log_beta + gain * innovation
        assert adaptive.variance == pytest.approx(variance) and math.log(adaptive.value) == pytest.approx(log_beta)
    lag, plain_lag = estimate - math.log(adaptive.value), estimate - math.log(plain.value)
    assert -0.5 < lag < 0 and plain_lag < 2 * lag  # both behind the falling estimate, the plain filter twice as far


def test_one_batch_estimate_of_beta_star_is_consistent():
    """`lab.estimate_noise`: batches drawn from the optimum at beta* give estimates of log beta* that close in on
    it as the batch grows (4,000 sequences: within 0.05 on every one of 5 batches), and spread more at 32."""
    from lab.estimate_noise import estimates

    large, small = estimates(4000, 5), estimates(32, 40)
    assert float(large.abs().max()) < 0.05
    assert float(small.std()) > 3 * float(large.std())


def test_the_constant_gain_ablations_step_by_their_constant():
    """`equilibrium_full_step` goes straight to the batch's estimate of log beta*, `equilibrium_ema` 0.3 of the way
    (not the effective-sample-size share the shipped controller takes)."""
    import torch

    from lab.controller_ablations import Ema, FullStep

    g = torch.Generator().manual_seed(0)
    r, d = torch.randint(0, 2, (64,), generator=g).double(), 0.2 * torch.randn(64, generator=g, dtype=torch.float64)
    for cls, constant in ((FullStep, 1.0), (Ema, 0.3)):
        c = cls(0.5, target=0.3, approach_power=0.0, hold_power=0.0)
        c.observe_sequences(r, d, torch.full((64,), 12.0))
        new = c.update(0.3, 64)
        assert c.gain == constant and c.ess == constant
        assert math.log(new) == pytest.approx(math.log(0.5) + constant * (c.estimate - math.log(0.5)))


def test_the_list_task_table_by_hand(tmp_path):
    """`lab.lists.summarize` reads klppo's printed logs and TRL's log.jsonl alike, with each run's held-out yardstick,
    and gives each arm's mean and standard error over seeds (one run: no standard error)."""
    from lab.lists import summarize

    runs = tmp_path / "runs"

    def heldout(folder, reward, kl):
        folder.mkdir(parents=True)
        (folder / "heldout.json").write_text(json.dumps(dict(reward=reward, kl_sequence=kl, response_length=50.0)))

    for seed, (r1, r2) in {1: (0.2, 0.8), 2: (0.4, 1.0)}.items():
        folder = runs / f"ppo-{seed}"
        heldout(folder, r2, 8.0 + seed)
        lines = [
            str(
                {
                    "objective/scores": str(r),
                    "kl/value": str(kl),
                    "kl/coef": "0.05",
                    "objective/response_length": "40",
                    "time/update": "60",
                }
            )
            for r, kl in ((r1, 2.0), (r2, 8.0 + seed))
        ]
        (folder / "train.log").write_text("noise\n" + "\n".join(lines) + "\n")
        (folder / "summary.json").write_text(json.dumps({"wall_seconds": 600.0 * seed}))
    folder = runs / "grpo-1"
    heldout(folder, 0.9, 7.0)
    (folder / "log.jsonl").write_text(
        json.dumps(
            {
                "step": 1,
                "reward": 0.5,
                "kl/value": 9.0,
                "kl/coef": 0.1,
                "completions/mean_length": 70.0,
                "step_time": 50.0,
            }
        )
        + "\n"
        + json.dumps({"step": 1, "train_runtime": 50.0})
        + "\n"
    )
    (folder / "summary.json").write_text(json.dumps({"seconds": 50.0}))
    heldout(runs / "base-0", 0.2, 0.0)
    (runs / "rloo-1").mkdir()  # a run still going: no held-out figures yet, left out
    summarize.main([str(runs), str(tmp_path / "out")])
    table = json.loads((tmp_path / "out" / "summary.json").read_text())["arms"]
    assert set(table) == {"ppo", "grpo"} and table["ppo"]["seeds"] == [1, 2]
    assert table["ppo"]["heldout_reward"] == pytest.approx([0.9, 0.1])  # mean of 0.8 and 1.0, SE 0.1
    assert table["ppo"]["kl_second_half"] == pytest.approx([9.5, 0.5])
    assert table["ppo"]["wall_seconds"] == pytest.approx([900.0, 300.0])
    assert table["grpo"]["reward_last5"][0] == pytest.approx(0.5) and table["grpo"]["heldout_kl"][0] == 7.0
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| 0.900 ± 0.100 |" in md and "| 0.900 | 7.00 |" in md
