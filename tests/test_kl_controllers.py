"""KL coefficient controllers: closed-form steps, bounds, checkpoints, bad inputs, simulated plants."""

import json
import math
import random
from types import SimpleNamespace

import pytest

from klppo.kl import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    PIDKLController,
    build_kl_controller,
)


def _all_kinds():
    return [
        FixedKLController(0.1),
        AdaptiveKLController(0.1, target=6.0, horizon=10000),
        ExponentialKLController(0.1, target=0.05),
        PIDKLController(0.1, target=0.05),
    ]


def test_names():
    assert KL_CONTROLLERS == ("fixed", "adaptive", "exponential", "pid")
    assert tuple(c.name for c in _all_kinds()) == KL_CONTROLLERS


# ---------------------------------------------------------------------------------------------
# closed-form single steps


def test_fixed_never_changes():
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 1e6, -3.0):
        assert c.update(kl, 64) == 0.05
    assert c.value == 0.05 and c.n_updates == 4
    assert FixedKLController(0.0).update(5.0, 1) == 0.0


def test_adaptive_ziegler_step():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # within the clip: e = 6.6 / 6 - 1 = 0.1
    assert c.update(6.6, 512) == pytest.approx(0.1 * (1 + 0.1 * 512 / 10000))
    # clipped above: e = 0.2
    before = c.value
    assert c.update(600.0, 256) == pytest.approx(before * (1 + 0.2 * 256 / 10000))
    # clipped below: e = -0.2 (also for a negative KL reading)
    before = c.value
    assert c.update(-5.0, 1000) == pytest.approx(before * (1 - 0.2 * 1000 / 10000))
    # n_steps scales the step linearly; n_steps = 0 is no step
    a = AdaptiveKLController(0.1, target=1.0, horizon=100)
    b = AdaptiveKLController(0.1, target=1.0, horizon=100)
    a.update(1.1, 10)
    b.update(1.1, 20)
    assert (a.value / 0.1 - 1) * 2 == pytest.approx(b.value / 0.1 - 1)
    assert AdaptiveKLController(0.1, 1.0, 100).update(5.0, 0) == 0.1
    assert c.last_error == pytest.approx(-0.2)


def test_adaptive_custom_error_clip_and_bounds():
    c = AdaptiveKLController(0.1, target=1.0, horizon=10, error_clip=0.5, coef_min=0.05, coef_max=0.12)
    assert c.update(10.0, 1) == pytest.approx(min(0.1 * (1 + 0.5 / 10), 0.12))
    assert c.update(10.0, 10) == 0.12  # capped
    for _ in range(50):
        c.update(0.0, 10)
    assert c.value == 0.05  # floored


def test_adaptive_multiplier_floor_when_n_steps_exceeds_horizon():
    """Pure Ziegler with n_steps / horizon = 10 and e = -0.2 gives a multiplier of -1: beta < 0."""
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    new = c.update(0.0, 1000)
    assert new > 0
    assert new == pytest.approx(0.1 * AdaptiveKLController.MIN_MULTIPLIER)
    # upward steps are not limited by the floor
    assert c.update(10.0, 1000) == pytest.approx(new * (1 + 0.2 * 10))


def test_exponential_step_and_bounds():
    c = ExponentialKLController(0.1, target=0.05, rate=0.1)
    assert c.update(0.25, 1) == pytest.approx(0.1 * math.exp(0.1 * 0.2))
    assert c.last_error == pytest.approx(0.2)
    before = c.value
    assert c.update(0.0, 1) == pytest.approx(before * math.exp(-0.005))
    hi = ExponentialKLController(5.0, target=1.0, rate=1.0, coef_min=0.01, coef_max=10.0)
    assert hi.update(2.0, 1) == 10.0  # 5 * e = 13.6 -> capped
    assert hi.update(-100.0, 1) == 0.01  # 10 * e^-101 -> floored
    # huge readings saturate instead of overflowing, for any rate
    big = ExponentialKLController(0.1, target=0.05, rate=100.0, coef_max=math.inf)
    assert math.isfinite(big.update(1e300, 1)) and big.value > 1e300


def test_pid_single_steps():
    c = PIDKLController(0.1, target=0.1, kp=0.2, ki=0.3, kd=0.05)
    # e = (0.15 - 0.1) / 0.1 = 0.5; first step has no derivative
    assert c.update(0.15, 1) == pytest.approx(0.1 * math.exp(0.2 * 0.5 + 0.3 * 0.5))
    assert c.integral == pytest.approx(0.15)
    # e = -0.5: integral 0.15 - 0.15 = 0, derivative -1
    assert c.update(0.05, 1) == pytest.approx(0.1 * math.exp(0.2 * -0.5 + 0.0 + 0.05 * -1.0))
    # on target: the proportional and integral terms vanish, the derivative reacts to the change
    assert c.update(0.1, 1) == pytest.approx(0.1 * math.exp(0.05 * 0.5))
    # the relative error is clipped (default error_clip = 1)
    d = PIDKLController(0.1, target=0.1, kp=0.1, ki=0.3, kd=0.0)
    assert d.update(1e6, 1) == pytest.approx(0.1 * math.exp(0.4))
    assert d.last_error == 1.0


def test_pid_bounds_and_anti_windup():
    c = PIDKLController(0.1, target=0.1, kp=0.0, ki=0.5, coef_min=0.01, coef_max=0.2)
    for _ in range(100):  # KL far above target for a long time: beta saturates at the max
        c.update(1.0, 1)
    assert c.value == 0.2
    assert c.integral == pytest.approx(math.log(0.2 / 0.1))  # the integral did not wind up
    c.update(0.0, 1)  # as soon as the KL drops below target, beta leaves the bound
    assert c.value == pytest.approx(0.2 * math.exp(-0.5))
    # with a proportional term the output saturates before the integral reaches its own bound;
    # the integral is then held where the output sits exactly on the bound
    p = PIDKLController(0.1, target=0.1, kp=0.5, ki=0.5, coef_max=0.2)
    for _ in range(20):
        p.update(1.0, 1)  # e = 1 (clipped)
    assert p.value == 0.2 and p.integral == pytest.approx(math.log(2.0) - 0.5)
    p.update(0.0, 1)  # e = -1: log beta = log 0.1 - 0.5 + (log 2 - 0.5 - 0.5)
    assert p.value == pytest.approx(0.2 * math.exp(-1.5))  # without anti-windup: 0.2 * exp(-1)
    # integral_limit bounds the integral on its own as well
    lim = PIDKLController(0.1, target=0.1, kp=0.0, ki=1.0, coef_max=1e9, integral_limit=2.0)
    for _ in range(20):
        lim.update(1.0, 1)
    assert lim.integral == pytest.approx(2.0) and lim.value == pytest.approx(0.1 * math.exp(2.0))


@pytest.mark.parametrize("ctrl", _all_kinds(), ids=KL_CONTROLLERS)
def test_bounds_hold_under_random_readings(ctrl):
    rng = random.Random(0)
    lo = getattr(ctrl, "coef_min", 0.0)
    hi = getattr(ctrl, "coef_max", math.inf)
    for _ in range(300):
        kl = rng.choice([0.0, 1e-3, 0.05, 1.0, 50.0, 1e12, -2.0]) * rng.random()
        v = ctrl.update(kl, rng.choice([1, 64, 4096]))
        assert lo <= v <= hi and math.isfinite(v) and v >= 0


# ---------------------------------------------------------------------------------------------
# bad readings


@pytest.mark.parametrize("ctrl", _all_kinds(), ids=KL_CONTROLLERS)
def test_non_finite_and_huge_readings(ctrl):
    start = ctrl.value
    for bad in (math.nan, math.inf, -math.inf, float("nan"), 10**400):
        assert ctrl.update(bad, 64) == start
    assert ctrl.skipped_updates == 5 and ctrl.n_updates == 0
    v = ctrl.update(1e30, 64)
    assert math.isfinite(v) and v >= 0 and ctrl.n_updates == 1
    v = ctrl.update(-1e30, 64)
    assert math.isfinite(v) and v >= 0
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(0.1, -1)
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(0.1, 2.5)


def test_tensor_readings_are_accepted():
    torch = pytest.importorskip("torch")
    c = AdaptiveKLController(0.1, target=1.0, horizon=10)
    assert c.update(torch.tensor(1.1, dtype=torch.float64), torch.tensor(2)) == pytest.approx(0.1 * (1 + 0.1 * 0.2))
    assert c.update(torch.tensor(float("nan")), 2) == c.value and c.skipped_updates == 1


# ---------------------------------------------------------------------------------------------
# checkpoints


def _drive(ctrl, readings):
    return [ctrl.update(kl, 64) for kl in readings]


@pytest.mark.parametrize("make", [
    lambda: FixedKLController(0.1),
    lambda: AdaptiveKLController(0.1, target=0.3, horizon=100),
    lambda: ExponentialKLController(0.1, target=0.3, rate=0.5),
    lambda: PIDKLController(0.1, target=0.3, kd=0.1),
], ids=KL_CONTROLLERS)
def test_state_dict_json_round_trip_continues_identically(make):
    rng = random.Random(1)
    readings = [rng.uniform(0.0, 1.0) for _ in range(20)]
    a = make()
    _drive(a, readings[:10] + [math.nan])
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state["class"] == type(a).__name__ and state["skipped_updates"] == 1
    b = make()
    b.load_state_dict(state)
    assert b.value == a.value
    assert _drive(b, readings[10:]) == _drive(a, readings[10:])
    assert b.state_dict() == a.state_dict()


def test_adaptive_default_state_is_strict_json():
    c = AdaptiveKLController(0.1, target=1.0, horizon=10)  # coef_max = inf
    text = json.dumps(c.state_dict(), allow_nan=False)
    assert '"inf"' in text


def test_load_into_wrong_kind_raises():
    state = AdaptiveKLController(0.1, target=1.0, horizon=10).state_dict()
    with pytest.raises(ValueError, match="AdaptiveKLController"):
        PIDKLController(0.1, target=1.0).load_state_dict(state)
    with pytest.raises(ValueError):
        FixedKLController(0.1).load_state_dict({"value": 0.2})


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("make, param", [
    (lambda: FixedKLController(-0.1), "kl_coef"),
    (lambda: FixedKLController(math.nan), "kl_coef"),
    (lambda: AdaptiveKLController(0.0, 1.0, 10), "kl_coef"),
    (lambda: AdaptiveKLController(0.1, 0.0, 10), "target"),
    (lambda: AdaptiveKLController(0.1, -1.0, 10), "target"),
    (lambda: AdaptiveKLController(0.1, 1.0, 0), "horizon"),
    (lambda: AdaptiveKLController(0.1, 1.0, 10, error_clip=0.0), "error_clip"),
    (lambda: AdaptiveKLController(0.1, 1.0, 10, coef_min=1.0, coef_max=0.5), "coef_min"),
    (lambda: AdaptiveKLController(0.1, 1.0, 10, coef_min=-1.0), "coef_min"),
    (lambda: ExponentialKLController(-0.1, 1.0), "kl_coef"),
    (lambda: ExponentialKLController(0.1, 0.0), "target"),
    (lambda: ExponentialKLController(0.1, 1.0, rate=0.0), "rate"),
    (lambda: ExponentialKLController(0.1, 1.0, rate=-1.0), "rate"),
    (lambda: ExponentialKLController(0.1, 1.0, coef_min=2.0, coef_max=1.0), "coef_min"),
    (lambda: PIDKLController(0.0, 1.0), "kl_coef"),
    (lambda: PIDKLController(0.1, -1.0), "target"),
    (lambda: PIDKLController(0.1, 1.0, kp=-0.1), "kp"),
    (lambda: PIDKLController(0.1, 1.0, ki=-0.1), "ki"),
    (lambda: PIDKLController(0.1, 1.0, kd=-0.1), "kd"),
    (lambda: PIDKLController(0.1, 1.0, integral_limit=0.0), "integral_limit"),
    (lambda: PIDKLController(0.1, 1.0, coef_min=1.0, coef_max=0.1), "coef_min"),
])
def test_constructor_rejects_bad_values(make, param):
    with pytest.raises(ValueError, match=param):
        make()


def test_initial_coefficient_is_clamped_into_bounds():
    assert ExponentialKLController(50.0, 1.0).value == 10.0
    assert PIDKLController(1e-6, 1.0).value == 1e-4


def test_build_kl_controller():
    base = dict(kl_coef=0.05, kl_target=6.0, kl_horizon=10000)
    c = build_kl_controller(SimpleNamespace(kl_controller="fixed", **base))
    assert isinstance(c, FixedKLController) and c.value == 0.05
    c = build_kl_controller(SimpleNamespace(kl_controller="adaptive", kl_error_clip=0.3, kl_coef_min=None, **base))
    assert isinstance(c, AdaptiveKLController) and c.error_clip == 0.3 and c.coef_min == 0.0 and c.horizon == 10000
    c = build_kl_controller(SimpleNamespace(kl_controller="exponential", kl_controller_rate=0.2,
                                            kl_coef_min=1e-3, kl_coef_max=5.0, **base))
    assert isinstance(c, ExponentialKLController) and (c.rate, c.coef_min, c.coef_max) == (0.2, 1e-3, 5.0)
    c = build_kl_controller(SimpleNamespace(kl_controller="pid", kl_pid_kp=0.5, kl_pid_ki=None, kl_pid_kd=0.01, **base))
    assert isinstance(c, PIDKLController) and (c.kp, c.ki, c.kd) == (0.5, 0.3, 0.01)
    with pytest.raises(ValueError, match="fixed, adaptive, exponential, pid"):
        build_kl_controller(SimpleNamespace(kl_controller="lagrangian", **base))
    with pytest.raises(ValueError, match="kl_target"):
        build_kl_controller(SimpleNamespace(kl_controller="pid", kl_coef=0.05, kl_target=None))


# ---------------------------------------------------------------------------------------------
# simulated plants


def _simulate(ctrl, c, steps=300, lag=1.0, sigma=0.1, seed=0):
    """kl responds to beta as c / beta (lag=1), or relaxes toward it by a fraction `lag` per update;
    the controller reads kl with multiplicative noise. Returns the noise-free kl per update."""
    rng = random.Random(seed)
    kl = c / ctrl.value
    history = []
    for _ in range(steps):
        kl += lag * (c / ctrl.value - kl)
        history.append(kl)
        ctrl.update(kl * math.exp(rng.gauss(0.0, sigma)), 64)
    return history


def _tracking(history, target):
    """Mean of the last third relative to target, and RMS relative error over the last third."""
    tail = history[-len(history) // 3:]
    mean = sum(tail) / len(tail) / target
    rms = math.sqrt(sum((x / target - 1) ** 2 for x in tail) / len(tail))
    return mean, rms


@pytest.mark.parametrize("lag", [1.0, 0.3])
@pytest.mark.parametrize("start", [0.1, 10.0])  # initial beta relative to the one that hits target
def test_pid_tracks_target_per_token(lag, start):
    target, beta_star = 0.05, 0.05
    c = target * beta_star
    pid = _simulate(PIDKLController(beta_star * start, target), c, lag=lag)
    exp = _simulate(ExponentialKLController(beta_star * start, target), c, lag=lag)
    pid_mean, pid_rms = _tracking(pid, target)
    exp_mean, exp_rms = _tracking(exp, target)
    assert abs(pid_mean - 1) < 0.1 and pid_rms < 0.1
    # with a per-token target, the exponential rule's effective gain rate * target = 0.005 per
    # update is too small to reach the target in 300 updates
    assert abs(exp_mean - 1) > 0.3 and pid_rms < exp_rms / 3
    # no sustained oscillation: after settling, consecutive errors do not keep flipping sign
    tail = [x / target - 1 for x in pid[-100:]]
    flips = sum(1 for a, b in zip(tail, tail[1:]) if a * b < 0)
    assert flips < 70


def test_pid_and_exponential_on_a_per_sequence_target():
    """At 6 nats / sequence the exponential rule's gain (0.6) is adequate: both track; reported as is."""
    target, beta_star = 6.0, 0.05
    c = target * beta_star
    for start in (0.1, 10.0):
        pid_mean, pid_rms = _tracking(_simulate(PIDKLController(beta_star * start, target), c), target)
        exp_mean, exp_rms = _tracking(_simulate(ExponentialKLController(beta_star * start, target), c), target)
        assert abs(pid_mean - 1) < 0.1 and pid_rms < 0.1
        assert abs(exp_mean - 1) < 0.1 and exp_rms < 0.15
