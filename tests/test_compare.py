"""lab/compare.py: the metrics on a hand-made record, the arms of the shipped comparisons, and `--quick` end to end
on the tiny model (runs in the process pool, resumed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab import compare

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("reward.png", "kl.png", "coef.png", "perplexity.png", "eval_reward.png")


def fake_record(kl_values, scores, ppl=(10.0, 12.0), coef_final=0.3):
    return {
        "seed": 0,
        "kl_coef_final": coef_final,
        "updates": [
            {"step": i + 1, "kl/value": kl, "objective/scores": s, "time/update": 1.0}
            for i, (kl, s) in enumerate(zip(kl_values, scores))
        ],
        "evals": [
            {"step": 0, "eval/perplexity": ppl[0], "eval/scores": 0.1},
            {"step": len(kl_values), "eval/perplexity": ppl[1], "eval/scores": 0.4},
        ],
    }


def test_run_metrics_by_hand():
    # target 4, band 20% = [3.2, 4.8]; second half = the last 3 of 6 updates
    record = fake_record([0.0, 2.0, 4.0, 4.4, 8.0, 3.0], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    m = compare.run_metrics(record, target=4.0, band=0.2, window=2)
    assert m["final_reward"] == pytest.approx(0.45)
    assert m["final_kl"] == pytest.approx(5.5)
    assert m["tracking_error"] == pytest.approx((0.1 + 1.0 + 0.25) / 3)
    assert m["in_band_second_half"] == pytest.approx(1 / 3)
    assert m["in_band_all"] == pytest.approx(2 / 6)
    assert m["perplexity_change_pct"] == pytest.approx(20.0)
    assert m["final_coef"] == 0.3
    # a NaN reading (skipped update) is left out, not propagated
    record = fake_record([4.0, float("nan"), 4.0, 4.0], [0.0] * 4)
    m = compare.run_metrics(record, target=4.0, band=0.2, window=2)
    assert m["tracking_error"] == 0.0 and m["in_band_all"] == 1.0
    # the whole run's figures count every finite reading, the first half's too
    record = fake_record([0.0, 4.0, 4.0, 4.0], [0.0] * 4)
    m = compare.run_metrics(record, target=4.0, band=0.2, window=2)
    assert m["tracking_error_all"] == pytest.approx(0.25) and m["in_band_all"] == pytest.approx(0.75)
    assert m["tracking_error"] == 0.0


def test_spread():
    s = compare.spread([1.0, 3.0, float("nan")])
    assert s == {"mean": 2.0, "std": pytest.approx(math.sqrt(2.0)), "min": 1.0, "max": 3.0, "n": 2}
    assert compare.spread([float("nan")])["mean"] is None


def test_an_arms_mapping_reaches_the_parser_as_json(tmp_path):
    """An arm's `kl_controller_kwargs` is passed to train.py's parser as JSON, which KLPPOConfig reads back."""
    from klppo.cli import parse

    base, spec = compare.load_experiment(None, quick=True)
    assert base["kl_controller_kwargs"] is None  # tiny.yaml's adaptive constants are not the fixed arm's
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    fields = {"kl_controller": "adaptive", "kl_controller_kwargs": {"horizon": 32, "error_clip": 0.1}}
    argv = compare.train_argv(config, fields, 0, str(tmp_path / "out"))
    assert argv[argv.index("--kl_controller_kwargs") + 1] == '{"horizon": 32, "error_clip": 0.1}'
    _, args, _ = parse(argv)
    assert args.kl_controller_kwargs == {"horizon": 32, "error_clip": 0.1}
    assert compare.resolved_settings(args) == {"kl_controller": "adaptive", "kl_statistic": "full", "kl_guard": False}
    for arm, fields in spec["arms"].items():  # every quick arm parses over the quick base
        parse(compare.train_argv(config, fields, 0, str(tmp_path / arm)))


@pytest.mark.parametrize("name", ["compare_default.yaml", "compare_long_words.yaml"])
def test_every_arm_of_the_shipped_comparisons_parses(tmp_path, name):
    """Each arm of a shipped comparison is valid for train.py's parser over its base experiment (what `compare.py`
    checks before it runs anything), without loading models."""
    from klppo.cli import parse

    base, spec = compare.load_experiment(ROOT / "lab" / "configs" / name, quick=False)
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    resolved = {}
    for arm, fields in spec["arms"].items():
        _, args, _ = parse(compare.train_argv(config, compare.arm_overrides(base, fields), 0, str(tmp_path / arm)))
        resolved[arm] = (args.kl_controller, args.experimental.kl_guard)
    assert resolved["equilibrium"] == ("equilibrium", True)
    assert resolved["tracking"] == ("tracking", True) and resolved["tracking-no-guard"] == ("tracking", False)
    assert resolved["adaptive"] == ("adaptive", False)
    if "tracking-detached-critic" in spec["arms"]:
        _, args, _ = parse(compare.train_argv(config, spec["arms"]["tracking-detached-critic"], 0, str(tmp_path / "d")))
        assert args.experimental.shared_critic_detach is True


def test_an_arms_experimental_settings_are_added_to_the_base_experiments(tmp_path):
    """An arm's `experimental` mapping reaches the parser merged with the base experiment's, not in its place."""
    from klppo.cli import parse

    base, _ = compare.load_experiment(None, quick=True)
    base["experimental"] = {"kl_statistic": "k3"}
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    fields = {"kl_controller": "tracking", "kl_target": 1.0, "experimental": {"kl_guard": False}}
    _, args, _ = parse(compare.train_argv(config, compare.arm_overrides(base, fields), 0, str(tmp_path / "out")))
    assert (args.experimental.kl_statistic, args.experimental.kl_guard) == ("k3", False)
    assert compare.arm_overrides({}, fields) == fields


def test_a_failing_run_is_reported_with_its_log_and_leaves_no_record(tmp_path):
    """A run that raises in its pool process is reported failed, its traceback in its log; the others go on."""
    job = {
        "name": "broken-seed0",
        "arm": "broken",
        "seed": 0,
        "fields": {},
        "fingerprint": "x",
        "threads": 1,
        "record": str(tmp_path / "runs" / "broken-seed0.json"),
        "argv": ["--config", str(tmp_path / "no-such-config.yaml"), "--output_dir", str(tmp_path / "out")],
    }
    failed = compare.run_all([job], 1, tmp_path)
    assert [(j["name"], "no-such-config" in reason) for j, reason in failed] == [("broken-seed0", True)]
    assert "Traceback" in (tmp_path / "logs" / "broken-seed0.log").read_text()
    assert not (tmp_path / "runs" / "broken-seed0.json").exists()


def run_quick(out) -> subprocess.CompletedProcess:
    """`python -m lab.compare --quick` from the repository root, as the docstring shows it."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "lab.compare", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_quick_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "compare"
    proc = run_quick(out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("started ") == 2 and "FAILED" not in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"fixed-0.05", "adaptive"}
    for arm, entry in summary["arms"].items():
        assert entry["seeds"] == [0]
        for name in (
            "final_reward",
            "tracking_error",
            "in_band_second_half",
            "in_band_all",
            "perplexity_change_pct",
            "final_coef",
            "final_kl",
        ):
            stat = entry["metrics"][name]
            for key in ("mean", "std", "min", "max"):
                assert stat[key] is not None and math.isfinite(stat[key]), (arm, name, key, stat)
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000, name
    assert "| adaptive |" in (out / "summary.md").read_text()

    record = json.loads((out / "runs" / "adaptive-seed0.json").read_text())
    assert [u["step"] for u in record["updates"]] == [1, 2]
    assert [e["step"] for e in record["evals"]] == [0, 1, 2]  # step 0 included
    assert all(math.isfinite(u["kl/coef"]) for u in record["updates"])
    assert record["kl_controller"] == "adaptive"
    # each run wrote its own log, from its own process
    for arm in ("fixed-0.05", "adaptive"):
        assert (out / "logs" / f"{arm}-seed0.log").is_file()
    invocations = json.loads((out / "invocations.json").read_text())
    assert invocations[-1]["runs_trained"] == 2 and invocations[-1]["command"].startswith("python -m lab.compare")

    # findings written into summary.md survive; finished runs are not trained again
    text = (out / "summary.md").read_text().replace("(not written yet)", "hand-written reading")
    (out / "summary.md").write_text(text)
    mtime = (out / "runs" / "adaptive-seed0.json").stat().st_mtime_ns
    assert compare.main(["--quick", "--out", str(out)]) == 0  # in process: nothing left to train
    stdout = capsys.readouterr().out
    assert "already done" in stdout and "started" not in stdout
    assert (out / "runs" / "adaptive-seed0.json").stat().st_mtime_ns == mtime
    assert "hand-written reading" in (out / "summary.md").read_text()
