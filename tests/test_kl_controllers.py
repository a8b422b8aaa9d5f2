"""KL coefficient controllers: closed-form steps, bounds, checkpoints, bad inputs, simulated plants."""

import json
import math
import random
from types import SimpleNamespace

import pytest

from klppo.kl import (
    AdaptiveKLController,
    EquilibriumKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    PIDKLController,
    TrackingKLController,
    build_kl_controller,
    get_kl_controller,
    kl_controllers,
    register_kl_controller,
    unregister_kl_controller,
)

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

KL_CONTROLLERS = ("fixed", "adaptive", "exponential", "pid", "tracking", "equilibrium")


def _all_kinds():
    return [
        FixedKLController(0.1),
        AdaptiveKLController(0.1, target=6.0, horizon=10000),
        ExponentialKLController(0.1, target=0.05),
        PIDKLController(0.1, target=0.05),
        TrackingKLController(0.1, target=0.05),
        EquilibriumKLController(0.1, target=0.05),  # reads only observed sequences: readings alone leave beta
    ]


def test_names():
    assert kl_controllers() == KL_CONTROLLERS
    assert tuple(c.name for c in _all_kinds()) == KL_CONTROLLERS


def test_register_and_unregister_a_controller_through_the_public_api():
    @register_kl_controller("halving")
    class Halving(KLController):
        """beta *= factor whenever kl exceeds target."""

        def __init__(self, kl_coef, target, factor=0.5):
            super().__init__(kl_coef)
            self.target, self.factor = target, factor

        def next_coef(self, kl, n_steps):
            return self._value / self.factor if kl > self.target else self._value

    try:
        assert "halving" in kl_controllers() and get_kl_controller("halving") is Halving
        assert Halving.constants == {"factor": 0.5}  # the constructor's keyword parameters, less the target
        c = build_kl_controller(
            SimpleNamespace(kl_controller="halving", kl_coef=0.1, kl_target=1.0, kl_controller_kwargs={"factor": 0.25})
        )
        assert c.update(2.0, 8) == pytest.approx(0.4) and c.name == "halving"
        with pytest.raises(ValueError, match="already registered"):
            register_kl_controller("halving")(Halving)
        # the config accepts it by name and builds it
        from klppo import KLPPOConfig

        args = KLPPOConfig(output_dir="/tmp/unused", kl_controller="halving", kl_target=1.0, report_to="none")
        assert isinstance(build_kl_controller(args), Halving)
    finally:
        unregister_kl_controller("halving")
    assert "halving" not in kl_controllers()
    with pytest.raises(ValueError, match="halving"):
        get_kl_controller("halving")


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


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedKLController(0.1),
        lambda: AdaptiveKLController(0.1, target=0.3, horizon=100),
        lambda: ExponentialKLController(0.1, target=0.3, rate=0.5),
        lambda: PIDKLController(0.1, target=0.3, kd=0.1),
        lambda: TrackingKLController(0.1, target=0.3, window=5),
        lambda: EquilibriumKLController(0.1, target=0.3),
    ],
    ids=KL_CONTROLLERS,
)
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


@pytest.mark.parametrize(
    "make, param",
    [
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
        (lambda: TrackingKLController(0.0, 1.0), "kl_coef"),
        (lambda: TrackingKLController(0.1, 0.0), "target"),
        (lambda: TrackingKLController(0.1, 1.0, ki=-1.0), "ki"),
        (lambda: TrackingKLController(0.1, 1.0, window=2), "window"),
        (lambda: TrackingKLController(0.1, 1.0, lookahead=-1.0), "lookahead"),
    ],
)
def test_constructor_rejects_bad_values(make, param):
    with pytest.raises(ValueError, match=param):
        make()


def test_initial_coefficient_is_clamped_into_bounds():
    assert ExponentialKLController(50.0, 1.0).value == 10.0
    assert PIDKLController(1e-6, 1.0).value == 1e-4


def test_build_kl_controller():
    base = dict(kl_coef=0.05, kl_target=6.0)
    c = build_kl_controller(SimpleNamespace(kl_controller="fixed", **base))
    assert isinstance(c, FixedKLController) and c.value == 0.05
    c = build_kl_controller(SimpleNamespace(kl_controller="fixed", kl_controller_kwargs={}, **base))
    assert isinstance(c, FixedKLController) and c.value == 0.05
    c = build_kl_controller(SimpleNamespace(kl_controller="adaptive", kl_controller_kwargs={"error_clip": 0.3}, **base))
    assert isinstance(c, AdaptiveKLController) and c.error_clip == 0.3 and c.coef_min == 0.0 and c.horizon == 10000
    assert c.target == 6.0  # the target comes from kl_target, not from the mapping
    c = build_kl_controller(SimpleNamespace(kl_controller="adaptive", kl_controller_kwargs=None, **base))
    assert c.horizon == 10000 and c.error_clip == 0.2  # None: the constructor's defaults
    c = build_kl_controller(
        SimpleNamespace(
            kl_controller="exponential", **base, kl_controller_kwargs=dict(rate=0.2, coef_min=1e-3, coef_max=5.0)
        )
    )
    assert isinstance(c, ExponentialKLController) and (c.rate, c.coef_min, c.coef_max) == (0.2, 1e-3, 5.0)
    c = build_kl_controller(SimpleNamespace(kl_controller="pid", kl_controller_kwargs=dict(kp=0.5, kd=0.01), **base))
    assert isinstance(c, PIDKLController) and (c.kp, c.ki, c.kd) == (0.5, 0.3, 0.01)
    c = build_kl_controller(SimpleNamespace(kl_controller="tracking", kl_controller_kwargs={"ki": 0.2}, **base))
    assert isinstance(c, TrackingKLController) and (c.ki, c.kp, c.window) == (0.2, 0.3, 10)
    with pytest.raises(ValueError, match="fixed, adaptive, exponential, pid, tracking"):
        build_kl_controller(SimpleNamespace(kl_controller="lagrangian", **base))
    with pytest.raises(ValueError, match="kl_target"):
        build_kl_controller(SimpleNamespace(kl_controller="pid", kl_coef=0.05, kl_target=None))


def test_the_constants_are_the_constructors_keyword_parameters():
    assert get_kl_controller("fixed").constants == {}
    assert get_kl_controller("adaptive").constants == dict(
        horizon=10000, error_clip=0.2, coef_min=0.0, coef_max=math.inf
    )
    assert get_kl_controller("exponential").constants == dict(rate=0.1, coef_min=1e-4, coef_max=10.0)
    assert {"kp", "ki", "kd", "coef_min", "coef_max", "integral_limit", "error_clip"} == set(
        get_kl_controller("pid").constants
    )
    assert {"kp", "ki", "lookahead", "window", "arm_fraction", "startup_rate", "coef_min", "coef_max"} == set(
        get_kl_controller("tracking").constants
    )
    for kind in kl_controllers():
        assert "target" not in get_kl_controller(kind).constants  # kl_target supplies it


def test_an_unknown_constant_is_refused_with_the_valid_ones():
    base = dict(kl_coef=0.05, kl_target=6.0)
    # a key of another controller (the PID's gain on the adaptive one), or an old config field's name
    with pytest.raises(ValueError, match=r"'adaptive' has no constant 'kp'.*horizon \(default 10000\).*error_clip"):
        build_kl_controller(SimpleNamespace(kl_controller="adaptive", kl_controller_kwargs={"kp": 0.1}, **base))
    with pytest.raises(ValueError, match="'tracking' has no constant 'kl_track_kp'.*kp .*ki .*lookahead"):
        build_kl_controller(SimpleNamespace(kl_controller="tracking", kl_controller_kwargs={"kl_track_kp": 1}, **base))
    with pytest.raises(ValueError, match="'fixed' has no constant 'horizon'.*none"):
        build_kl_controller(SimpleNamespace(kl_controller="fixed", kl_controller_kwargs={"horizon": 64}, **base))
    with pytest.raises(ValueError, match="has no constant 'target'"):  # the target is kl_target's
        build_kl_controller(SimpleNamespace(kl_controller="pid", kl_controller_kwargs={"target": 1.0}, **base))
    with pytest.raises(ValueError, match="kl_controller_kwargs must be a mapping"):
        build_kl_controller(SimpleNamespace(kl_controller="pid", kl_controller_kwargs=[("kp", 1.0)], **base))
    # a constant's own check still applies to a value given through the mapping
    with pytest.raises(ValueError, match="window"):
        build_kl_controller(SimpleNamespace(kl_controller="tracking", kl_controller_kwargs={"window": 2}, **base))


def test_klppoconfig_takes_the_constants_as_a_mapping_or_a_json_string(tmp_path):
    import dataclasses

    from klppo import KLPPOConfig

    def config(**kw):
        return KLPPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)

    args = config(kl_controller="adaptive", kl_target=6.0, kl_controller_kwargs={"horizon": 64})
    assert build_kl_controller(args).horizon == 64
    # from a command line: a JSON string, parsed once (a resolved config resolves to itself)
    args = config(kl_controller="pid", kl_target=1.0, kl_controller_kwargs='{"kp": 0.5, "integral_limit": 3.0}')
    assert args.kl_controller_kwargs == {"kp": 0.5, "integral_limit": 3.0}
    c = build_kl_controller(args)
    assert isinstance(c, PIDKLController) and (c.kp, c.integral_limit) == (0.5, 3.0)
    assert dataclasses.replace(args).kl_controller_kwargs == {"kp": 0.5, "integral_limit": 3.0}
    assert config(kl_target=1.0, kl_controller_kwargs='{"coef_min": 0.001}').kl_controller_kwargs == {"coef_min": 0.001}
    with pytest.raises(ValueError, match="kl_controller_kwargs.*JSON"):
        config(kl_controller="pid", kl_target=1.0, kl_controller_kwargs="{kp: 0.5")
    with pytest.raises(ValueError, match="has no constant 'horizon'.*integral_limit"):
        config(kl_controller="pid", kl_target=1.0, kl_controller_kwargs='{"horizon": 64}')
    with pytest.raises(ValueError, match="has no constant 'horizon'"):
        config(kl_controller="tracking", kl_target=1.0, kl_controller_kwargs={"horizon": 64})


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
    tail = history[-len(history) // 3 :]
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


# ---------------------------------------------------------------------------------------------
# the tracking controller


def test_tracking_single_steps_closed_form():
    c = TrackingKLController(0.1, target=2.0, kp=0.3, ki=0.1, lookahead=2.0, window=5)
    # first reading: the policy is still the reference; e = clip(log(max(0, 2/e) / 2)) = -1, held
    assert c.update(0.0, 8) == pytest.approx(0.1 * math.exp(-0.3))
    assert c.integral == 0.0 and c.holding
    # a reading above: no trend from fewer than 3 readings, so p = 1.5 and e = log(1.5 / 2) < 0; the reading
    # is below arm_fraction * target (1.6): held, and beta may not rise above its last value
    e = math.log(0.75)
    assert c.update(1.5, 8) == pytest.approx(0.1 * math.exp(-0.3))
    assert c.last_error == pytest.approx(e) and not c.armed and c.integral == pytest.approx(-0.3 - 0.3 * e)
    # a reading past the target arms the controller: slope of [0, 1.5, 3] is 1.5 -> p = 3 + 2 * 1.5 = 6,
    # e = min(log(6 / 2), 1) = 1; I = -0.3 - 0.3 e + 0.1
    c.update(3.0, 8)
    assert c.armed and c.slope == pytest.approx(1.5) and c.last_error == 1.0
    assert c.value == pytest.approx(0.1 * math.exp(0.3 - 0.3 - 0.3 * e + 0.1))
    # at the target with a flat trend: e = 0, beta = beta0 * exp(I)
    c = TrackingKLController(0.1, target=2.0, lookahead=0.0)
    for _ in range(5):
        c.update(2.0, 8)
    assert c.last_error == 0.0 and c.value == pytest.approx(0.1)


def test_tracking_start_up_hold_tells_on_course_from_levelled_off():
    target = 4.0
    # rising steadily toward the target, fast enough to arrive within the window (20 x 0.25 = 5 nats): the
    # integral only keeps the P term's fading cut, so beta stays where the P term's first cut put it
    rising = TrackingKLController(0.1, target=target, window=20)
    for t in range(13):
        rising.update(0.25 * t, 8)  # reaches 3 after 12 updates, short of arm_fraction * target
        assert rising.holding and rising.integral <= 0.0
    assert rising.value == pytest.approx(0.1 * math.exp(-rising.kp))
    # levelled off at a tenth of the target: once the trend shows it, the integral falls and beta with it,
    # at startup_rate * ki per update (e = -1) until the KL has first come near the target
    flat = TrackingKLController(0.1, target=target, window=10)
    for t in range(60):
        flat.update(0.4 * (1 - math.exp(-t)), 8)
    assert not flat.holding and not flat.armed
    rate = flat.startup_rate * flat.ki
    assert -rate * 60 <= flat.integral < -rate * 40 and flat.value < 0.1 * math.exp(-flat.kp - rate * 40)
    # a raw integrator (the PID controller) cuts beta while the KL is still rising
    pid = PIDKLController(0.1, target=target)
    for t in range(15):
        pid.update(0.25 * t, 8)
    assert pid.value < rising.value / 3


def test_tracking_start_up_never_raises_beta_while_the_kl_climbs_below_the_target():
    """Before the KL first nears the target, a reading short of it never raises beta. The P term's cut shrinks as
    the KL climbs; the integral keeps what the P term gives back. Without that, beta would rise by
    exp(kp * (e_now - e_first)) on a KL that has not arrived yet."""
    target = 4.0
    c = TrackingKLController(0.07, target=target, window=10, lookahead=0.0)
    readings = [0.0, 0.2, 0.5, 0.9, 1.4, 1.9, 2.2, 2.3, 2.5, 2.6, 2.8, 2.9]
    values = []
    for kl in readings:
        values.append(c.update(kl, 8))
        assert c.last_error < 0 and not c.armed
    assert all(b <= a * (1 + 1e-12) for a, b in zip(values, values[1:]))
    first = 0.07 * math.exp(-c.kp)  # e = -1 on the first readings
    assert c.value == pytest.approx(first)
    # what the P term alone would give now (the integral held at 0): 17% above, the rise this rule removes
    assert 0.07 * math.exp(c.kp * c.last_error) > 1.15 * c.value
    # a reading that has come near the target (arm_fraction * target = 3.2) arms the controller: the fading cut
    # then acts again and brakes the approach
    c.update(3.4, 8)
    assert c.last_error < 0 and c.armed and c.value > values[-1]
    # once the prediction passes the target, beta rises further (error > 0 is never held)
    for _ in range(3):
        c.update(5.0, 8)
    assert c.last_error > 0 and c.value > values[-1]


def test_tracking_start_up_hold_cuts_beta_for_a_kl_that_creeps_too_slowly():
    """A KL that rises significantly but would need far more than the window to reach the target is held
    back too hard: the integral falls (a test of "rising" alone would hold beta for the whole run)."""
    target = 4.0
    creeping = TrackingKLController(0.1, target=target, window=10)
    for t in range(40):
        creeping.update(1.0 + 0.03 * t + 0.01 * (-1) ** t, 8)  # 1 -> 2.2 nats: 0.3 per window, gap ~2
        assert creeping.slope * creeping.window < creeping.arm_fraction * target - creeping.readings[-1]
    assert not creeping.holding and not creeping.armed
    assert creeping.integral < -20 * creeping.startup_rate * creeping.ki * 0.3
    # the same creep at ten times the speed is on course: it would arrive within the window, no cut
    fast = TrackingKLController(0.1, target=target, window=10)
    for t in range(6):
        fast.update(1.0 + 0.3 * t + 0.01 * (-1) ** t, 8)
    assert fast.holding and fast.value == pytest.approx(0.1 * math.exp(-fast.kp))  # only the P term's first cut


def test_tracking_hold_keeps_beta_while_a_never_negative_statistic_reads_a_tiny_floor():
    """`full` is never negative and has little noise: a steady reading of a thousandth of the target is
    significantly above zero, but it is not a policy on its way (a numerical floor, or a move too small to
    matter). The hold keeps the integral; only the proportional term acts."""
    c = TrackingKLController(0.1, target=4.0)
    for t in range(15):
        c.update(4e-3 * (1 + 0.05 * (-1) ** t), 8)
        assert c.holding and c.integral == 0.0
    assert c.value == pytest.approx(0.1 * math.exp(-c.kp))


def test_tracking_hold_ends_once_the_target_was_approached():
    c = TrackingKLController(0.1, target=1.0, window=10)
    for kl in [0.2, 0.5, 0.9, 1.0, 1.0, 1.0]:  # a reading passes 0.8 at the third
        c.update(kl, 8)
    assert c.armed and not c.holding
    before = c.integral
    c.update(0.5, 8)  # now a low reading is integrated, whatever the trend
    assert c.integral < before


def test_tracking_anti_windup_keeps_output_on_the_bound():
    c = TrackingKLController(1.0, target=1.0, coef_max=2.0, lookahead=0.0)
    for _ in range(50):
        c.update(100.0, 8)
    assert c.value == 2.0
    # the integral sits where the output is exactly on the bound (I = log 2 - kp * 1): it has not wound
    # up, so a reading at the target (e = 0, no P term) gives beta = 2 * exp(-kp) at once
    assert c.integral == pytest.approx(math.log(2.0) - 0.3)
    c.update(1.0, 8)
    assert c.value == pytest.approx(2.0 * math.exp(-0.3))


@pytest.mark.parametrize("lag", [1.0, 0.3])
@pytest.mark.parametrize("start", [0.2, 5.0])
def test_tracking_on_simulated_plants(lag, start):
    target, beta_star = 4.0, 0.1
    c = target * beta_star
    history = _simulate(TrackingKLController(beta_star * start, target), c, lag=lag)
    mean, rms = _tracking(history, target)
    assert abs(mean - 1) < 0.05 and rms < 0.1


def test_a_guard_whose_check_predates_change_sq_is_called_without_it():
    """`KLGuard.check` gained `change_sq` (for `low_significance`); a registered guard that overrides `check` with
    the four arguments it had before is still called, with those four."""
    import torch

    from klppo.ppo.safety.kl_guard import KLGuard
    from klppo.ppo.safety.step_checks import GuardSample, StepChecks

    calls = []

    class OldGuard(KLGuard):
        def check(self, kl_sum, kl_count, kl_rollout, reading):
            calls.append((kl_sum, kl_count, kl_rollout, reading))
            return "guard"

    class NewGuard(KLGuard):
        def check(self, kl_sum, kl_count, kl_rollout, reading, change_sq=None):
            calls.append(change_sq)
            return None

    one = torch.tensor(1.0, dtype=torch.float64)
    for guard, expected in ((OldGuard(1.0), "guard"), (NewGuard(1.0), None)):
        checks = StepChecks("cpu")
        checks.add(torch.tensor(0.5), GuardSample(2 * one, one, 3 * one, 4 * one))
        assert checks.verdict(None, guard, 0.9, applied=1) == expected
    assert calls == [(2.0, 4.0, 1.0, 0.9), 3.0]
