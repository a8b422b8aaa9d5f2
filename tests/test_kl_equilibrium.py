import math

import pytest
import torch

from klppo.kl.controllers import EquilibriumKLController, equilibrium_log_coef, optimum_kl


def _tilt(ref, r, beta):
    return torch.log_softmax(ref + r / beta, dim=0)


def _kl(logp, logq):
    return float((logp.exp() * (logp - logq)).sum())


def _exact_sample(logp, n):
    """Outcome indices in proportion to exp(logp) (probabilities are multiples of 1/n)."""
    counts = (logp.exp() * n).round().long()
    assert int(counts.sum()) == n
    return torch.repeat_interleave(torch.arange(len(logp)), counts)


@pytest.mark.parametrize("beta", [0.2, 0.5, 2.0])
def test_optimum_kl_is_exact_on_a_sample_that_is_the_distribution(beta):
    # pi and ref on 4 outcomes with probabilities in 1/16ths: a 16-sequence "sample" in proportion is pi itself
    pi = torch.tensor([8, 4, 3, 1], dtype=torch.float64).div(16).log()
    ref = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).log()
    r = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    idx = _exact_sample(pi, 16)
    got = optimum_kl(1 / beta, r[idx], (pi - ref)[idx])
    assert got == pytest.approx(_kl(_tilt(ref, r, beta), ref), rel=1e-12, abs=1e-12)


def test_at_the_optimum_the_estimate_is_the_mean_log_ratio():
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64).log()
    r = torch.tensor([0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    beta = 0.7
    opt = _tilt(ref, r, beta)
    idx = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(0))  # any draw: weights are equal
    l = (opt - ref)[idx]
    assert optimum_kl(1 / beta, r[idx], l) == pytest.approx(float(l.mean()), abs=1e-12)


def test_the_estimate_rises_as_beta_falls():
    g = torch.Generator().manual_seed(1)
    r, l = torch.randn(64, generator=g, dtype=torch.float64), 0.3 * torch.randn(64, generator=g, dtype=torch.float64)
    values = [optimum_kl(inv, r, l) for inv in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a < b for a, b in zip(values, values[1:]))


def test_solved_coefficient_is_the_one_whose_optimum_has_the_target_kl():
    pi = torch.tensor([8, 4, 3, 1], dtype=torch.float64).div(16).log()
    ref = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).log()
    r = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    idx = _exact_sample(pi, 16)
    log_beta = equilibrium_log_coef(r[idx], (pi - ref)[idx], 0.3, math.log(1e-4), math.log(1e4))
    assert _kl(_tilt(ref, r, math.exp(log_beta)), ref) == pytest.approx(0.3, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# the controller


def _batch(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g).double(), 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
            torch.full((n,), 12.0, dtype=torch.float64))


def test_one_step_moves_log_beta_by_the_effective_sample_size_share_of_the_way():
    r, d, lengths = _batch()
    c = EquilibriumKLController(0.1, target=0.3)
    c.observe_sequences(r, d, lengths)
    new = c.update(0.05, 64)
    b = equilibrium_log_coef(r, d, 0.3, math.log(1e-4), math.log(10.0))
    w = torch.softmax(math.exp(-b) * r - d, dim=0)
    ess = float(1 / (w * w).sum()) / 64
    assert c.estimate == pytest.approx(b) and c.ess == pytest.approx(ess) and 0 < ess <= 1
    assert math.log(c.coef) == pytest.approx(math.log(0.1) + ess * (b - math.log(0.1)))
    assert new == pytest.approx(c.coef * (0.05 / 0.3) ** 0.75)  # the approach: the KL has not reached the target


def test_the_approach_scales_beta_until_the_first_reading_at_the_target_then_leaves_it():
    """Below the target the coefficient in force is the equilibrium one times (kl / target) ** approach_power; from
    the first reading at or above the target on it is the equilibrium one, whatever later readings are."""
    c = EquilibriumKLController(0.1, target=0.3, approach_power=2.0)
    got = [c.update(kl, 64) for kl in (0.0, -0.1, 0.15, 0.3, 0.15, 0.0)]
    assert got[:2] == [1e-4, 1e-4]  # no KL yet (k1 can read below 0): coef_min
    assert got[2] == pytest.approx(0.1 * 0.5**2)
    assert got[3:] == [0.1, 0.1, 0.1] and c.coef == 0.1 and c.arrived  # no sequences observed: coef stays
    off = EquilibriumKLController(0.1, target=0.3, approach_power=0.0)
    assert off.arrived and [off.update(kl, 64) for kl in (0.0, 0.15)] == [0.1, 0.1]


def test_a_per_token_target_becomes_a_per_sequence_one_by_the_mean_length():
    r, d, lengths = _batch()
    a, b = EquilibriumKLController(0.1, target=0.025), EquilibriumKLController(0.1, target=0.3)
    a.observe_sequences(r, d, lengths, unit="token")
    b.observe_sequences(r, d, lengths)
    a.update(0.01, 64), b.update(0.01, 64)
    assert a.coef == pytest.approx(b.coef) and a.coef != 0.1


def test_beta_stays_without_sequences_or_with_a_batch_that_tells_nothing():
    r, d, lengths = _batch()
    c = EquilibriumKLController(5.0, target=0.3, approach_power=0.0)
    assert c.update(0.01, 64) == 5.0  # no sequences observed
    for scores, ratios in ((r[:0], d[:0]), (torch.full_like(r, math.nan), d), (r, torch.full_like(d, math.inf)),
                           (torch.zeros_like(r), d)):  # empty, non-finite, every score equal (no tilt)
        c.observe_sequences(scores, ratios, lengths[: len(scores)])
        assert c.update(0.01, 64) == 5.0
    assert c.estimate is None
    c.observe_sequences(r, d, lengths)
    assert c.update(0.01, 64) < 5.0  # and a batch that tells something moves it


def test_state_round_trip_continues_identically():
    import json

    a, b = EquilibriumKLController(0.1, target=0.3), EquilibriumKLController(0.1, target=0.3)
    for seed in range(3):
        a.observe_sequences(*_batch(seed))
        a.update(0.1, 64)
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    for seed in range(3, 6):
        for c in (a, b):
            c.observe_sequences(*_batch(seed))
            c.update(0.1, 64)
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("kwargs, param", [({"target": 0.0}, "target"),
                                           ({"coef_min": 2.0, "coef_max": 1.0}, "coef_min"),
                                           ({"approach_power": -1.0}, "approach_power")])
def test_constructor_rejects_bad_values(kwargs, param):
    with pytest.raises(ValueError, match=param):
        EquilibriumKLController(0.1, **{"target": 0.3, **kwargs})


def test_the_default_with_a_target_is_equilibrium_for_k1_in_the_reward_and_tracking_otherwise(tmp_path):
    from klppo import KLPPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", kl_target=4.0)
    c = KLPPOConfig(**base)
    assert (c.kl_controller, c.kl_guard) == ("equilibrium", True)
    c = KLPPOConfig(**base, kl_mode="loss", kl_estimator="k2")
    assert (c.kl_controller, c.kl_guard) == ("tracking", True)
    with pytest.raises(ValueError, match="k3 in kl_mode='reward'.*kl_controller='tracking'"):
        KLPPOConfig(**base, kl_estimator="k3", kl_controller="equilibrium")
    # the tilt is the optimum of an undiscounted, unclamped penalty only
    assert KLPPOConfig(**base, gamma=0.9).kl_controller == "tracking"
    assert KLPPOConfig(**base, kl_value_clamp=10.0).kl_controller == "tracking"
    with pytest.raises(ValueError, match="gamma=0.9.*needs gamma 1"):
        KLPPOConfig(**base, gamma=0.9, kl_controller="equilibrium")


def test_only_k1_in_the_reward_has_the_sequence_level_tilt_as_its_fixed_point():
    from klppo.kl import follows_sequence_tilt

    assert follows_sequence_tilt("reward", "k1")
    for mode, estimator in (("reward", "k3"), ("reward", "k2"), ("both", "k1"), ("loss", "k2"), ("none", "k1"),
                            ("reward", "no_such_estimator")):
        assert not follows_sequence_tilt(mode, estimator), (mode, estimator)


def test_the_estimate_stays_finite_and_ordered_at_extreme_coefficients():
    r = torch.tensor([3000.0, -2000.0, 0.5, 1.0], dtype=torch.float64)
    d = torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=torch.float64)
    values = [optimum_kl(inv, r, d) for inv in (0.0, 1e-6, 1.0, 1e6, 1e13)]
    assert all(math.isfinite(v) for v in values)
    assert all(a <= b + 1e-9 for a, b in zip(values, values[1:]))
    log_beta = equilibrium_log_coef(r, d, 0.5, -700.0, 700.0)  # coef_min = 0: the search stays where r / beta is finite
    assert math.isfinite(log_beta) and -30.0 <= log_beta <= 30.0


def test_a_state_saved_before_the_approach_existed_resumes_at_its_beta_without_the_approach():
    state = EquilibriumKLController(0.1, target=0.3).state_dict()
    for key in ("coef", "arrived"):
        del state[key]
    state["value"] = 0.4
    c = EquilibriumKLController(0.1, target=0.3)
    c.load_state_dict(state)
    assert (c.value, c.coef, c.arrived) == (0.4, 0.4, True)
    assert c.update(0.01, 64) == 0.4  # a low reading no longer scales it
