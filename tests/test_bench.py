"""`benchmarks/bench.py --quick`: the klppo side of the benchmark runs and reports finite figures.

The peer (TRL 1.12 in a virtual environment of its own) is left out: installing it takes minutes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab  # the benchmarks' code, beside the lab's: not part of the installed package

REPO_ROOT = Path(__file__).resolve().parents[1]
# time/score_policy and time/score_value may be 0: generation gives the old log-probs (and a shared
# critic's values), so those forward passes are skipped.
PHASES = ["time/generation", "time/score_ref", "time/reward", "time/optimise", "time/update"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_quick_bench_writes_finite_figures(tmp_path):
    done = subprocess.run(
        # workload a only: b runs in the growth test below
        [sys.executable, str(REPO_ROOT / "benchmarks" / "bench.py"), "--quick", "--profile", "--workloads", "a",
         "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tiny-quick.json").read_text())
    assert (tmp_path / "tiny-quick.md").read_text().startswith("# klppo vs TRL 1.12 PPO")

    assert report["model"] == "tiny"
    assert report["command"].startswith("python benchmarks/bench.py")
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"]
    assert set(report["workloads"]) == {"a"}
    for name, workload in report["workloads"].items():
        klppo = workload["klppo"]
        assert "peer" not in workload and "ratios" not in workload
        for key in ("time_per_update_s", "tokens_per_s", "peak_rss_mb", "trainable_parameters"):
            assert positive(klppo[key]), (name, key, klppo[key])
        for phase in PHASES:
            assert positive(klppo["phases_s"][phase]), (name, phase, klppo["phases_s"])
        assert math.isfinite(klppo["phases_s"]["time/kl"]) and klppo["phases_s"]["time/kl"] >= 0
        assert 0 <= klppo["kl_share"] < 1
        assert klppo["measured_updates"] == 1
        run = workload["runs"]["klppo"][0]
        assert run["generated_length"] == [24.0, 24.0]  # no stop token: every response is full length
        ranges = workload["profile"]["ranges_s"]  # --profile: the PPO epochs split into their parts
        for part in ("generation", "score_ref", "optimise", "forward", "backward", "clip_grad_norm", "optimizer_step"):
            assert positive(ranges[f"klppo/{part}"]), (name, part, ranges)
        parts = sum(ranges[f"klppo/{p}"] for p in ("forward", "backward", "clip_grad_norm", "optimizer_step"))
        assert parts <= ranges["klppo/optimise"] * 1.001
    assert "Where klppo's update goes" in (tmp_path / "tiny-quick.md").read_text()

    kl = report["kl_memory"]["variants"]
    assert set(kl) == {"chunked", "dense", "naive"}
    for variant in kl.values():
        assert positive(variant["seconds"]) and math.isfinite(variant["kl_mean"])
        extra = variant.get("peak_extra_cuda_mb") or variant["peak_extra_rss_mb"]
        assert extra is None or math.isfinite(extra)


@pytest.mark.slow
def test_quick_growth_writes_a_table_slopes_and_a_plot(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench.py"), "--quick", "--growth", "2x4,2x8,4x4", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "growth.json").read_text())
    assert [(p["batch_size"], p["response_length"]) for p in report["points"]] == [(2, 4), (2, 8), (4, 4)]
    assert all(positive(p["klppo"]["time_per_update_s"]) for p in report["points"])
    assert set(report["slopes"]) == {"response_length", "batch_size"}
    assert all(math.isfinite(v) for slopes in report["slopes"].values() for v in slopes.values())
    assert (tmp_path / "growth.png").stat().st_size > 0 and "| 4 x 4 |" in (tmp_path / "growth.md").read_text()


def test_growth_slopes_are_exact_on_power_laws(monkeypatch):
    """time = 0.01 * length^2 * batch: slope 2 against the length, 1 against the batch."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import bench

    def point(batch, length):
        t = 0.01 * length**2 * batch
        side = {"time_per_update_s": t, "phases_s": {"time/generation": t / 2, "time/optimise": t / 4},
                "peak_rss_above_start_mb": 100.0 * batch}  # fmt: skip
        return {"batch_size": batch, "response_length": length, "klppo": side}

    slopes = bench.growth_slopes([point(8, 24), point(8, 96), point(8, 256), point(32, 24)], ["klppo"])
    assert slopes["response_length"]["klppo time/update"] == pytest.approx(2.0)
    assert slopes["response_length"]["klppo peak RSS above start"] == pytest.approx(0.0, abs=1e-12)
    assert slopes["batch_size"]["klppo time/optimise"] == pytest.approx(1.0)
    assert slopes["batch_size"]["klppo peak RSS above start"] == pytest.approx(1.0)
