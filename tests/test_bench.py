"""`scripts/bench.py --quick`: the klppo side of the benchmark runs and reports finite figures.

The peer (TRL 1.12 in a virtual environment of its own) is left out: installing it takes minutes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# time/score_policy and time/score_value may be 0: generation gives the old log-probs (and a shared
# critic's values), so those forward passes are skipped.
PHASES = ["time/generation", "time/score_ref", "time/reward", "time/optimise", "time/update"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_quick_bench_writes_finite_figures(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tiny-quick.json").read_text())
    assert (tmp_path / "tiny-quick.md").read_text().startswith("# klppo vs TRL 1.12 PPO")

    assert report["model"] == "tiny"
    assert report["command"].startswith("python scripts/bench.py")
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"]
    assert set(report["workloads"]) == {"a", "b"}
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

    kl = report["kl_memory"]["variants"]
    assert set(kl) == {"chunked", "dense", "naive"}
    for variant in kl.values():
        assert positive(variant["seconds"]) and math.isfinite(variant["kl_mean"])
        extra = variant.get("peak_extra_cuda_mb") or variant["peak_extra_rss_mb"]
        assert extra is None or math.isfinite(extra)
