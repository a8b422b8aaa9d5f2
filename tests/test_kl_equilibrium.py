import math
import re

import pytest
import torch

from klppo.kl import BUILTIN_KL_ESTIMATORS, KL_MODES, estimate_kl, get_kl_estimator_spec
from klppo.kl.controllers import EquilibriumKLController, equilibrium_log_coef, optimum_kl
from klppo.kl.optimum import FORWARD, REVERSE, KLOptimum, kl_optimum_of

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics


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
    log_ratio = (opt - ref)[idx]
    assert optimum_kl(1 / beta, r[idx], log_ratio) == pytest.approx(float(log_ratio.mean()), abs=1e-12)


def test_the_estimate_rises_as_beta_falls():
    g = torch.Generator().manual_seed(1)
    r, log_ratio = (
        torch.randn(64, generator=g, dtype=torch.float64),
        0.3 * torch.randn(64, generator=g, dtype=torch.float64),
    )
    values = [optimum_kl(inv, r, log_ratio) for inv in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
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
    return (
        torch.randint(0, 2, (n,), generator=g).double(),
        0.2 * torch.randn(n, generator=g, dtype=torch.float64),
        torch.full((n,), 12.0, dtype=torch.float64),
    )


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


def _by_hand_filtered_step(r, d, log_beta, variance, groups=4, drift=0.1, target=0.3):
    """One step of the filtered controller computed from the exact solve: the estimate b, its ESS share, the
    grouped jackknife variance V (sequence i in group i mod K, each group left out in turn), the gain min(share,
    P / (P + V)) with P = variance + drift^2, and the variance after it, (1 - g)^2 P + g^2 V."""
    lo, hi = math.log(1e-4), math.log(10.0)
    b = equilibrium_log_coef(r, d, target, lo, hi)
    w = torch.softmax(math.exp(-b) * r - d, dim=0)
    share = float(1 / (w * w).sum()) / len(r)
    k = torch.arange(len(r)) % groups
    left_out = [equilibrium_log_coef(r[k != j], d[k != j], target, lo, hi) for j in range(groups)]
    mean = sum(left_out) / groups
    spread = (groups - 1) / groups * sum((x - mean) ** 2 for x in left_out)
    prior = variance + drift**2
    gain = min(share, prior / (prior + spread))
    return log_beta + gain * (b - log_beta), (1 - gain) ** 2 * prior + gain**2 * spread, gain, share


def test_the_filtered_step_takes_the_smaller_of_the_share_and_the_kalman_gain():
    """``jackknife_groups``: far from the batch's beta* (few sequences back the estimate) the step is the ESS share,
    as without the filter; near it, where the share is close to 1, the Kalman gain of the filter's variance against
    the estimate's jackknife variance, so a run of noisy batches is averaged. Six updates checked by hand, both
    kinds of step among them."""
    c = EquilibriumKLController(5.0, target=0.3, approach_power=0.0, jackknife_groups=4, drift=0.1)
    log_beta, variance, kinds = math.log(5.0), 1.0, set()
    for seed in range(6):
        r, d, lengths = _batch(seed)
        c.observe_sequences(r, d, lengths)
        c.update(0.3, 64)
        log_beta, variance, gain, share = _by_hand_filtered_step(r, d, log_beta, variance)
        kinds.add("share" if gain == share else "kalman")
        assert math.log(c.coef) == pytest.approx(log_beta) and c.variance == pytest.approx(variance)
        assert c.gain == pytest.approx(gain) and c.ess == pytest.approx(share)
    assert kinds == {"share", "kalman"}
    c.reference_reset()
    assert c.variance == 1.0 and math.log(c.coef) == pytest.approx(log_beta)


def test_an_estimate_on_a_bound_takes_the_unfiltered_step():
    """An estimate on a coefficient bound says only that beta* lies beyond it: with the KL measured on that side of
    the target (above it for the upper bound, below for the lower) the step is the share, as without the filter (a
    target beyond the batch's reach moves beta toward the bound as far as the unfiltered controller does, on either
    side), and the filter takes no measurement from it: its variance grows by drift^2."""
    r, d, lengths = _batch()
    for target, coef_max, kl in ((1e-3, 1.0, 1e-2), (50.0, 10.0, 5.0)):  # beta* above the upper bound; below the lower
        filtered = EquilibriumKLController(
            0.5, target=target, coef_max=coef_max, approach_power=0.0, jackknife_groups=4, drift=0.1, hold_power=0.0
        )
        plain = EquilibriumKLController(0.5, target=target, coef_max=coef_max, approach_power=0.0, hold_power=0.0)
        for c in (filtered, plain):
            c.observe_sequences(r, d, lengths)
            c.update(kl, 64)
        assert filtered.estimate in (pytest.approx(math.log(coef_max)), pytest.approx(math.log(1e-4)))
        assert filtered.gain == pytest.approx(filtered.ess, rel=1e-4) and filtered.coef == pytest.approx(
            plain.coef, rel=1e-4
        )
        assert plain.gain == plain.ess and plain.coef != 0.5
        assert filtered.variance == pytest.approx(1.0 + 0.1**2)  # no measurement: the variance only grows


def test_an_estimate_on_a_bound_against_the_kl_measured_takes_no_step():
    """A batch whose estimate lies on the upper bound while the KL measured is at or below the target (or on the
    lower bound while it is at or above) cannot represent the optimum at the target: its importance weights are too
    noisy (on the one-token bandit, a batch from a policy at the target whose estimated KL of ``ref`` itself exceeds
    the target). It tells nothing, as a batch of equal scores: the equilibrium coefficient stays, with or without the
    filter, and the filter's variance is untouched."""
    r, d, lengths = _batch()
    for target, coef_max, kl in ((1e-3, 1.0, 1e-3), (1e-3, 1.0, 5e-4), (50.0, 10.0, 50.0), (50.0, 10.0, 80.0)):
        for groups in (0, 4):
            c = EquilibriumKLController(
                0.5,
                target=target,
                coef_max=coef_max,
                approach_power=0.0,
                jackknife_groups=groups,
                drift=0.1,
                hold_power=0.0,
            )
            c.observe_sequences(r, d, lengths)
            assert c.update(kl, 64) == 0.5 and c.coef == 0.5 and c.gain == 0.0 and c.variance == 1.0
            assert c.estimate in (pytest.approx(math.log(coef_max)), pytest.approx(math.log(1e-4)))


def test_the_approach_scales_beta_until_the_first_reading_at_the_target_then_leaves_it():
    """Below the target the coefficient in force is the equilibrium one times (kl / target) ** approach_power; from
    the first reading at or above the target on it is the equilibrium one, whatever later readings are (without the
    hold, `hold_power=0`)."""
    c = EquilibriumKLController(0.1, target=0.3, approach_power=2.0, hold_power=0.0)
    got = [c.update(kl, 64) for kl in (0.0, -0.1, 0.15, 0.3, 0.15, 0.0)]
    assert got[:2] == [1e-4, 1e-4]  # no KL yet (k1 can read below 0): coef_min
    assert got[2] == pytest.approx(0.1 * 0.5**2)
    assert got[3:] == [0.1, 0.1, 0.1] and c.coef == 0.1 and c.arrived  # no sequences observed: coef stays
    off = EquilibriumKLController(0.1, target=0.3, approach_power=0.0, hold_power=0.0)
    assert [off.update(kl, 64) for kl in (0.0, 0.15)] == [0.1, 0.1] and not off.arrived


def test_the_hold_scales_beta_by_the_reading_once_the_kl_has_arrived():
    """From the first reading at the target on, the coefficient in force is the equilibrium one times (kl / target)
    ** hold_power, the ratio within [1/e, e] (a reading at or below 0 counts as target / e); the equilibrium
    coefficient itself is not moved by it, and a reading at the target gives it exactly."""
    c = EquilibriumKLController(0.1, target=0.3, approach_power=2.0, hold_power=0.5)
    assert c.update(0.15, 64) == pytest.approx(0.1 * 0.5**2) and not c.arrived  # the approach, not the hold
    got = [c.update(kl, 64) for kl in (0.3, 0.6, 0.15, 3.0, 0.0, 0.3)]
    assert c.arrived and c.coef == 0.1  # no sequences observed: the equilibrium coefficient stays
    assert got == pytest.approx([0.1, 0.1 * 2**0.5, 0.1 * 0.5**0.5, 0.1 * math.e**0.5, 0.1 * math.e**-0.5, 0.1])
    high = EquilibriumKLController(9.0, target=0.3, approach_power=0.0, hold_power=2.0)
    assert high.update(0.15, 64) == 9.0 and not high.arrived  # no approach and no hold before the KL arrives
    assert high.update(3.0, 64) == 10.0 and high.update(0.3, 64) == pytest.approx(9.0)  # within the bounds
    low = EquilibriumKLController(2e-4, target=0.3, approach_power=0.0, hold_power=2.0)
    assert low.update(0.3, 64) == pytest.approx(2e-4) and low.update(0.0, 64) == 1e-4
    assert EquilibriumKLController(0.1, target=0.3, hold_power=1e4).update(3.0, 64) == 10.0  # no overflow


def test_a_reference_reset_re_arms_the_approach_and_keeps_the_equilibrium_coefficient():
    """After a reset the KL to the new reference starts from 0, as at the start of a run: the approach applies again
    until a reading reaches the target, from the equilibrium coefficient the first segment ended with."""
    c = EquilibriumKLController(0.1, target=0.3, approach_power=2.0, hold_power=0.0)
    assert c.update(0.3, 64) == 0.1 and c.arrived
    c.reference_reset()
    assert not c.arrived and c.coef == 0.1
    assert c.update(0.0, 64) == 1e-4 and c.update(0.15, 64) == pytest.approx(0.1 * 0.5**2)
    assert c.update(0.3, 64) == 0.1 and c.arrived
    off = EquilibriumKLController(0.1, target=0.3, approach_power=0.0, hold_power=0.0)
    off.reference_reset()
    assert off.update(0.0, 64) == 0.1 and not off.arrived


def test_a_per_token_target_becomes_a_per_sequence_one_by_the_mean_length():
    r, d, lengths = _batch()
    a, b = EquilibriumKLController(0.1, target=0.025), EquilibriumKLController(0.1, target=0.3)
    a.observe_sequences(r, d, lengths, unit="token")
    b.observe_sequences(r, d, lengths)
    a.update(0.01, 64), b.update(0.01, 64)
    assert a.coef == pytest.approx(b.coef) and a.coef != 0.1


def test_beta_stays_without_sequences_or_with_a_batch_that_tells_nothing():
    r, d, lengths = _batch()
    c = EquilibriumKLController(5.0, target=0.3, approach_power=0.0, hold_power=0.0)
    assert c.update(0.01, 64) == 5.0  # no sequences observed
    # empty, non-finite, every score equal (no tilt)
    for scores, ratios in (
        (r[:0], d[:0]),
        (torch.full_like(r, math.nan), d),
        (r, torch.full_like(d, math.inf)),
        (torch.zeros_like(r), d),
    ):
        c.observe_sequences(scores, ratios, lengths[: len(scores)])
        assert c.update(0.01, 64) == 5.0
    assert c.estimate is None
    c.observe_sequences(r, d, lengths)
    assert c.update(0.01, 64) < 5.0  # and a batch that tells something moves it


@pytest.mark.parametrize("kwargs", [{}, {"jackknife_groups": 8}])
def test_state_round_trip_continues_identically(kwargs):
    import json

    a, b = EquilibriumKLController(0.1, target=0.3, **kwargs), EquilibriumKLController(0.1, target=0.3, **kwargs)
    readings = [0.1, 0.35, 0.2, 0.5, 0.3, 0.25]  # arrives at the second: the approach, then the hold
    for seed in range(3):
        a.observe_sequences(*_batch(seed))
        a.update(readings[seed], 64)
    assert a.arrived
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    for seed in range(3, 6):
        for c in (a, b):
            c.observe_sequences(*_batch(seed))
            c.update(readings[seed], 64)
    assert a.state_dict() == b.state_dict() and a.value != a.coef


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"target": 0.0}, "target"),
        ({"coef_min": 2.0, "coef_max": 1.0}, "coef_min"),
        ({"approach_power": -1.0}, "approach_power"),
        ({"hold_power": -0.5}, "hold_power"),
        ({"jackknife_groups": 1}, "jackknife_groups"),
        ({"jackknife_groups": 2.5}, "jackknife_groups"),
        ({"jackknife_groups": math.inf}, "jackknife_groups"),
        ({"drift": 0.0}, "drift"),
    ],
)
def test_constructor_rejects_bad_values(kwargs, param):
    with pytest.raises(ValueError, match=param):
        EquilibriumKLController(0.1, **{"target": 0.3, **kwargs})


def test_the_default_with_a_target_is_equilibrium_where_the_optimum_is_known_and_tracking_otherwise(tmp_path, caplog):
    from klppo import KLPPOConfig
    from klppo.kl.controllers import build_kl_controller

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", kl_target=4.0)
    c = KLPPOConfig(**base)
    assert (c.kl_controller, c.experimental.kl_guard, c.kl_optimum()) == ("equilibrium", True, KLOptimum(REVERSE, 1.0))
    for mode, estimator, optimum in (
        ("loss", "k2", KLOptimum(REVERSE, 1.0, per_token=True)),
        ("loss", "k3", KLOptimum(FORWARD, 1.0, per_token=True)),
        ("both", "k1+", KLOptimum(REVERSE, 2.0, per_token=True)),
    ):
        c = KLPPOConfig(**base, kl_mode=mode, kl_estimator=estimator)
        assert (c.kl_controller, c.experimental.kl_guard, c.kl_optimum()) == ("equilibrium", True, optimum)
        assert build_kl_controller(c).optimum == optimum  # the controller learns it from the config
    # a loss weight that moves with the policy hides the optimum: tracking, with one warning saying why
    for extra, why in (
        ({"experimental": {"kl_loss_scale": "none"}}, "kl_loss_scale='none'"),
        ({"kl_loss_agg_mode": "seq-mean-token-sum"}, "kl_loss_agg_mode='seq-mean-token-sum'"),
        ({"whiten_rewards": True}, "whiten_rewards=True"),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="klppo.ppo.config"):
            c = KLPPOConfig(**base, kl_mode="loss", kl_estimator="k2", **extra)
        assert c.kl_controller == "tracking" and c.kl_optimum() is None
        warned = [r.getMessage() for r in caplog.records if "tracking controller" in r.getMessage()]
        assert len(warned) == 1 and why in warned[0], warned
        with pytest.raises(ValueError, match=f"{re.escape(why)}.*kl_controller='tracking'.*k2, an X\\+ estimator"):
            KLPPOConfig(**base, kl_mode="loss", kl_estimator="k2", kl_controller="equilibrium", **extra)
    # GRPO's loss follows the reward Delta * r: known in the loss; with the KL in the return too, divided by the groups'
    # spreads, not
    assert KLPPOConfig(**base, kl_mode="loss", kl_estimator="k3", advantage_estimator="grpo").kl_optimum() == KLOptimum(
        FORWARD, 1.0, per_token=True
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="klppo.ppo.config"):
        c = KLPPOConfig(**base, kl_mode="both", kl_estimator="k1+", advantage_estimator="grpo")
    assert c.kl_controller == "tracking" and "advantage_estimator='grpo' with kl_mode='both'" in caplog.text
    # seq-mean-token-sum weighs the KL by the responses' lengths, as without GRPO
    c = KLPPOConfig(
        **base, kl_mode="loss", kl_estimator="k2", advantage_estimator="grpo", kl_loss_agg_mode="seq-mean-token-sum"
    )
    assert c.kl_controller == "tracking" and c.kl_optimum() is None
    # without whitened advantages, kl_loss_scale='none' leaves beta as it is: the optimum is known
    c = KLPPOConfig(
        **base, kl_mode="loss", kl_estimator="k2", experimental={"kl_loss_scale": "none", "whiten_advantages": False}
    )
    assert c.kl_controller == "equilibrium"
    # fixed-length responses: a per-sequence sum of the KL weighs it by their length against the token-mean policy loss
    fixed = dict(base, kl_mode="loss", kl_estimator="k2", stop_token=None, response_length=3)
    assert KLPPOConfig(**fixed, kl_loss_agg_mode="seq-mean-token-sum").kl_optimum() == KLOptimum(REVERSE, 3.0, True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert KLPPOConfig(**fixed, kl_loss_agg_mode=agg).kl_optimum() == KLOptimum(REVERSE, 1.0, True)
    c = KLPPOConfig(**base, kl_mode="loss", kl_estimator="abs")
    assert c.kl_controller == "tracking"
    with pytest.raises(ValueError, match="k3 in kl_mode='reward'.*kl_controller='tracking'"):
        KLPPOConfig(**base, kl_estimator="k3", kl_controller="equilibrium")
    # the tilt is the optimum of an undiscounted, unclamped penalty only
    assert KLPPOConfig(**base, gamma=0.9).kl_controller == "tracking"
    assert KLPPOConfig(**base, kl_value_clamp=10.0).kl_controller == "tracking"
    with pytest.raises(ValueError, match="gamma=0.9.*needs gamma 1"):
        KLPPOConfig(**base, gamma=0.9, kl_controller="equilibrium")


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
    assert c.update(0.01, 64) == pytest.approx(0.4 * math.exp(-1.0))  # the hold's factor, not the approach's


# ---------------------------------------------------------------------------------------------
# every configuration's optimum, and the forward family's estimate (exact math on a one-token bandit)

# one token out of six: the policy's logits are free, so every expectation is a sum
_REF6 = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05], dtype=torch.float64).log()
_R6 = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, -0.5], dtype=torch.float64)


def _expected_ascent(mode, estimator, beta, logp, loss_weight=1.0):
    """The expected gradient, w.r.t. the logits, that the trainer's terms give at policy exp(logp) on the one-token
    bandit, exactly: the policy gradient of the score plus the KL rewards (their values detached, as in the return),
    minus loss_weight * beta times the on-policy gradient of the KL loss term (tokens drawn from the policy itself)."""
    theta = logp.clone().requires_grad_(True)
    lp = torch.log_softmax(theta, dim=-1)
    old = lp.detach()

    def estimate(name):
        if get_kl_estimator_spec(name).needs_logits:  # one position: the same value for every token
            return estimate_kl(name, logits=theta[None], ref_logits=_REF6[None]).expand(len(_R6))
        return estimate_kl(name, lp, _REF6, old_logp=old)

    places = KL_MODES[mode]
    returns = _R6 - beta * estimate(estimator).detach() if "reward" in places else _R6
    objective = (lp.exp() * returns).sum()  # its gradient is E[return * grad log pi]
    if "loss" in places:
        objective = objective - loss_weight * beta * (old.exp() * estimate(estimator)).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


@pytest.mark.parametrize("loss_weight", [1.0, 3.0])
@pytest.mark.parametrize("mode", ["reward", "loss", "both"])
def test_each_configuration_is_stationary_exactly_at_the_optimum_it_is_said_to_train_toward(mode, loss_weight):
    """`kl_optimum_of` against the exact expected gradient of every built-in estimator in every place: zero at the
    optimum it names (reverse or forward family, at its multiple of beta), and where it names none, zero at none of
    the candidates."""
    beta = 0.4
    for estimator in BUILTIN_KL_ESTIMATORS:
        optimum = kl_optimum_of(mode, estimator, loss_weight)
        if optimum is not None:
            grad = _expected_ascent(mode, estimator, beta, optimum.exact(_REF6, _R6, beta), loss_weight)
            assert float(grad.abs().max()) < 1e-9, (mode, estimator, optimum)
            other = KLOptimum(FORWARD if optimum.divergence == REVERSE else REVERSE, optimum.scale)
            grad = _expected_ascent(mode, estimator, beta, other.exact(_REF6, _R6, beta), loss_weight)
            assert float(grad.abs().max()) > 1e-3, (mode, estimator, "the other family")
            continue
        if get_kl_estimator_spec(estimator).base == "low_var_kl" and "loss" in KL_MODES[mode]:
            continue  # k3 where no token's output clamp binds (as here): refused for where it does
        for divergence in (REVERSE, FORWARD):
            for scale in (0.5, 1.0, 2.0, loss_weight, 1.0 + loss_weight):
                logp = KLOptimum(divergence, scale).exact(_REF6, _R6, beta)
                grad = _expected_ascent(mode, estimator, beta, logp, loss_weight)
                assert float(grad.abs().max()) > 1e-4, (mode, estimator, divergence, scale)


def test_the_exact_optima_are_the_closed_forms():
    beta = 0.4
    reverse = KLOptimum(REVERSE, 2.0).exact(_REF6, _R6, beta)
    assert torch.allclose(reverse, _tilt(_REF6, _R6, 0.8), atol=1e-14)
    forward = KLOptimum(FORWARD).exact(_REF6, _R6, beta).exp()
    assert float(forward.sum()) == pytest.approx(1.0, abs=1e-13)
    lam = _R6 + beta * _REF6.exp() / forward  # stationarity of E[r] - beta * KL(ref || pi): r + beta * ref / pi const
    assert float(lam.max() - lam.min()) < 1e-10


# pi and ref on 4 outcomes with probabilities in 1/16ths: a 16-sequence "sample" in proportion is pi itself
_PI4 = torch.tensor([8, 4, 3, 1], dtype=torch.float64).div(16).log()
_REF4 = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).log()
_R4 = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)


@pytest.mark.parametrize("divergence", [REVERSE, FORWARD])
@pytest.mark.parametrize("beta", [0.2, 0.5, 2.0])
def test_the_estimate_of_each_family_is_exact_on_a_sample_that_is_the_distribution(divergence, beta):
    """The forward family's lam comes from the normalisation estimated on the batch, mean(exp(-d) b / (lam - r)) = 1,
    which a sample that is pi itself makes exact: sum_y ref(y) b / (lam - r(y))."""
    idx = _exact_sample(_PI4, 16)
    optimum = KLOptimum(divergence)
    got = optimum.kl(math.log(beta), _R4[idx], (_PI4 - _REF4)[idx])
    assert got == pytest.approx(_kl(optimum.exact(_REF4, _R4, beta), _REF4), rel=1e-11, abs=1e-12)


@pytest.mark.parametrize("divergence", [REVERSE, FORWARD])
def test_at_the_optimum_the_weights_are_equal_and_the_estimate_is_the_mean_log_ratio(divergence):
    beta, optimum = 0.7, KLOptimum(divergence)
    opt = optimum.exact(_REF4, _R4, beta)
    idx = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(0))  # any draw that has the best score
    idx[0] = 3
    d = (opt - _REF4)[idx]
    assert optimum.kl(math.log(beta), _R4[idx], d) == pytest.approx(float(d.mean()), abs=1e-10)
    assert optimum.ess(math.log(beta), _R4[idx], d) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("seed", range(5))
def test_the_forward_estimate_falls_as_beta_grows(seed):
    g = torch.Generator().manual_seed(seed)
    r, d = torch.randn(64, generator=g, dtype=torch.float64), 0.5 * torch.randn(64, generator=g, dtype=torch.float64)
    values = [KLOptimum(FORWARD).kl(math.log(b), r, d) for b in (1e-3, 0.01, 0.1, 0.5, 2.0, 10.0, 100.0)]
    assert all(a > b for a, b in zip(values, values[1:])), values


@pytest.mark.parametrize(
    "optimum", [KLOptimum(REVERSE), KLOptimum(FORWARD), KLOptimum(REVERSE, 2.0), KLOptimum(FORWARD, 3.0)]
)
def test_the_solved_coefficient_is_the_one_whose_optimum_has_the_target_kl(optimum):
    idx = _exact_sample(_PI4, 16)
    log_beta = optimum.solve(_R4[idx], (_PI4 - _REF4)[idx], 0.3, math.log(1e-4), math.log(1e4))
    assert _kl(optimum.exact(_REF4, _R4, math.exp(log_beta)), _REF4) == pytest.approx(0.3, rel=1e-9)
    # out of the bounds' reach: the bound on that side
    assert optimum.solve(_R4[idx], (_PI4 - _REF4)[idx], 0.3, math.log(1e2), math.log(1e4)) == pytest.approx(
        math.log(1e2)
    )
    assert optimum.solve(_R4[idx], (_PI4 - _REF4)[idx], 0.3, math.log(1e-6), math.log(1e-5)) == pytest.approx(
        math.log(1e-5)
    )


def test_the_controller_solves_for_the_optimum_it_is_given():
    r, d, lengths = _batch()
    for optimum in (KLOptimum(FORWARD), KLOptimum(REVERSE, 2.0)):
        c = EquilibriumKLController(0.1, target=0.3, optimum=optimum, approach_power=0.0)
        c.observe_sequences(r, d, lengths)
        c.update(0.05, 64)
        b = optimum.solve(r, d, 0.3, math.log(1e-4), math.log(10.0))
        ess = optimum.ess(b + math.log(optimum.scale), r, d)
        assert c.estimate == pytest.approx(b) and c.ess == pytest.approx(ess) and 0 < ess <= 1
        assert math.log(c.coef) == pytest.approx(math.log(0.1) + ess * (b - math.log(0.1)))
    # the tilt at 2 beta is the tilt at beta with half the coefficient
    c1, c2 = EquilibriumKLController(0.1, target=0.3), EquilibriumKLController(0.1, 0.3, optimum=KLOptimum(REVERSE, 2))
    for c in (c1, c2):
        c.observe_sequences(r, d, lengths)
        c.update(0.05, 64)
    assert c2.estimate == pytest.approx(c1.estimate - math.log(2.0))
    assert "optimum" not in EquilibriumKLController.constants  # the config passes it; not a constant
    assert c2.state_dict()["hparams"]["optimum"] == KLOptimum(REVERSE, 2.0).describe()
