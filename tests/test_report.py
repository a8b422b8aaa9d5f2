"""The end-of-run verdict and the PPO health monitor: exact figures on hand-made series."""

from __future__ import annotations

import math

import pytest

from klppo.ppo.safety.health import HEALTH_RANGES, PPOHealthMonitor
from klppo.report import format_verdict, learning_verdict


def test_learning_verdict_figures():
    rewards = [0.1, 0.2, 0.1, 0.2, 0.1] + [0.3] * 5 + [0.6, 0.7, 0.6, 0.7, 0.6]
    kls = [0.0] * 8 + [3.0, 5.0, 4.0, 4.0, 3.0, 5.0, 4.0]  # second half: the last 8 values
    v = learning_verdict(rewards, kls, 4.0, perplexity_before=20.0, perplexity_after=22.0)
    # first five: mean 0.14, sample std sqrt(0.012 / 4 ... ): se = std / sqrt(5)
    se_first = math.sqrt(sum((r - 0.14) ** 2 for r in rewards[:5]) / 4 / 5)
    se_last = math.sqrt(sum((r - 0.64) ** 2 for r in rewards[-5:]) / 4 / 5)
    assert v["reward_rise"] == pytest.approx(0.5)
    assert v["reward_rise_se"] == pytest.approx(0.5 / math.hypot(se_first, se_last))
    assert v["learned"]
    second = kls[7:]
    assert v["kl_second_half_mean"] == pytest.approx(sum(second) / 8)
    assert v["kl_tracking_error"] == pytest.approx(sum(abs(k - 4) for k in second) / 8 / 4)
    assert v["kl_in_band"] == pytest.approx(3 / 8)  # only the three 4.0s: 3.0 and 5.0 are 25% off, 0.0 is out
    assert v["kl_held"] is (abs(v["kl_second_half_ratio"] - 1) <= 0.25)
    assert v["perplexity_change"] == pytest.approx(0.1) and v["perplexity_kept"]
    line = format_verdict(v)
    assert line.startswith("verdict: ") and "SE" in line and "+10.0%" in line


def test_learning_verdict_fails_on_a_flat_reward_and_a_drifting_kl():
    rewards = [0.2, 0.3, 0.1, 0.25, 0.15] * 4
    v = learning_verdict(rewards, [10.0] * 20, 4.0, 20.0, 26.0)
    assert not v["learned"] and not v["kl_held"] and not v["perplexity_kept"]
    assert format_verdict(v).startswith("verdict: FAIL")
    short = learning_verdict([0.1, 0.9], [1.0, 1.0], None, None, None)
    assert not short["learned"] and "kl_held" not in short  # too few updates to judge
    assert format_verdict(short).startswith("verdict: not judged: 2 updates")


def test_health_monitor_warns_once_per_excursion_naming_the_fix():
    monitor = PPOHealthMonitor(patience=3)
    healthy = {"policy/approxkl": 0.005, "policy/clipfrac": 0.05, "policy/entropy": 3.0, "val/clipfrac": 0.1}
    assert monitor.update(healthy) == []
    hot = dict(healthy, **{"policy/approxkl": 0.2})
    assert monitor.update(hot) == [] and monitor.update(hot) == []
    messages = monitor.update(hot)
    assert len(messages) == 1 and "policy/approxkl" in messages[0] and "lower learning_rate" in messages[0]
    assert monitor.update(hot) == []  # once per excursion
    monitor.update(healthy)
    for _ in range(2):
        assert monitor.update(hot) == []
    assert len(monitor.update(hot)) == 1  # a new excursion warns again
    # entropy is judged against its first value: half of it is the limit
    low = dict(healthy, **{"policy/entropy": 1.4})
    out = [monitor.update(low) for _ in range(3)]
    assert out[:2] == [[], []] and "policy/entropy" in out[2][0] and "kl_coef" in out[2][0]


def test_health_monitor_state_round_trip():
    a = PPOHealthMonitor(patience=2)
    a.update({"policy/clipfrac": 0.5, "policy/entropy": 2.0})
    b = PPOHealthMonitor(patience=2)
    b.load_state_dict(a.state_dict())
    assert b.update({"policy/clipfrac": 0.5}) == a.update({"policy/clipfrac": 0.5})
    assert {r.metric for r in HEALTH_RANGES} == {"policy/approxkl", "policy/clipfrac", "policy/entropy", "val/clipfrac"}


def test_tracking_stats_on_a_run_worked_by_hand():
    """Second half of [10, 0, 2, 3, 5, 4.4] against 4: |3-4|/4, |5-4|/4, |4.4-4|/4 = 0.25, 0.25, 0.1 (mean 0.2);
    only 4.4 within 20%; mean reading 12.4 / 3 = 4.133 (1.0333x); the peak, 10, comes from the first half. A NaN
    reading is left out."""
    from klppo.kl.tracking import mean_and_standard_error, tracking_stats

    stats = tracking_stats([10, 0, 2, 3, 5, 4.4], 4.0)
    assert stats.readings == 3
    assert stats.error == pytest.approx(0.2) and stats.in_band == pytest.approx(1 / 3)
    assert stats.mean_ratio == pytest.approx(12.4 / 12) and stats.peak_ratio == 2.5
    with_nan = tracking_stats([10, 0, 2, 3, 5, float("nan")], 4.0)
    assert with_nan.readings == 2 and with_nan.error == pytest.approx(0.25) and with_nan.in_band == 0
    mean, se = mean_and_standard_error([1.0, 2.0, 3.0])
    assert mean == 2.0 and se == pytest.approx(1 / 3**0.5)
    with pytest.raises(ValueError):
        tracking_stats([1.0], 0.0)
