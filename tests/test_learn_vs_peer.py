"""benchmarks/learn_vs_peer.py: the reward slope and the paired ratio, on hand-made runs (no training)."""

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.lab  # the benchmarks' code, beside the lab's: not part of the installed package

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script():
    spec = importlib.util.spec_from_file_location(
        "klppo_learn_vs_peer", os.path.join(ROOT, "benchmarks", "learn_vs_peer.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slope_per_1000_sequences_by_hand():
    lvp = load_script()
    # +0.01 reward per update of 32 sequences = 0.3125 per 1,000 sequences, whatever the offset
    assert lvp.slope_per_1000([0.5 + 0.01 * i for i in range(10)]) == pytest.approx(0.3125)
    # x = 32, 64, 96, 128: sxy = -6.4, sxx = 5120, slope -0.00125 per sequence
    assert lvp.slope_per_1000([0.2, 0.0, 0.2, 0.0]) == pytest.approx(-1.25)


def write_runs(runs, side, lr, seed, rewards, kl=1.0):
    name = f"{side}_lr{lr:g}_s{seed}"
    if side == "klppo":
        keys = ("kl/value", "policy/approxkl", "policy/clipfrac")
        path = runs / name / "trainer_state.json"
        path.parent.mkdir(parents=True)
    else:
        keys = ("objective/kl", "policy/approxkl_avg", "policy/clipfrac_avg")
        path = runs / f"{name}.json"
    history = [{"objective/scores": r, keys[0]: kl, keys[1]: 0.01, keys[2]: 0.1} for r in rewards]
    history.append({"eval/perplexity": 10.0})  # other log entries are ignored
    path.write_text(json.dumps({"log_history": history}))


def test_best_rate_on_the_sweep_seed_and_paired_ratio(tmp_path):
    lvp = load_script()
    runs = tmp_path / "runs"
    steep, flat = [0.02 * i for i in range(10)], [0.01 * i for i in range(10)]
    write_runs(runs, "klppo", 5e-4, 0, steep)
    write_runs(runs, "klppo", 1e-3, 0, flat)
    write_runs(runs, "klppo", 5e-4, 1, steep)
    write_runs(runs, "peer", 5e-4, 0, flat)
    write_runs(runs, "peer", 5e-4, 1, flat)
    args = lvp.parse_args(
        ["report", "--runs", str(runs), "--klppo-lrs", "5e-4", "1e-3", "--peer-lrs", "5e-4", "--seeds", "0", "1"]
    )
    result = lvp.analyse(args)
    assert result["best_lr"] == {"klppo": 5e-4, "peer": 5e-4}
    assert result["ratio_per_seed"] == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}
    assert result["ratio"]["mean"] == pytest.approx(2.0) and result["ratio"]["n"] == 2
    assert "**Ratio klppo / peer: 2.00 ± 0.00**" in lvp.summary_markdown(result)
