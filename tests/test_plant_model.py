"""lab/plant_model.py: the fit recovers a known first-order plant, and the simulation's floors and orders."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lab import plant_model as pm

pytestmark = pytest.mark.lab


def synthetic_runs(tmp_path, a, b, c, sigma, runs=40, updates=36, seed=0):
    """Run records of the plant log KL_{t+1} - log KL_t = a + b log KL_t + c log beta_t + N(0, sigma^2), with beta
    wandering at random (open loop, so the fit is unbiased)."""
    rng = np.random.default_rng(seed)
    for r in range(runs):
        log_kl, log_beta, ups = 0.0, math.log(0.05), []
        for _ in range(updates):
            ups.append({"kl/full": math.exp(log_kl), "kl/coef": math.exp(log_beta)})
            log_kl = log_kl + a + b * log_kl + c * log_beta + sigma * rng.standard_normal()
            log_beta = math.log(0.05) + 0.3 * rng.standard_normal()
        (tmp_path / f"run{r}.json").write_text(json.dumps({"updates": ups}))
    return [str(tmp_path / "run*.json")]


def test_the_fit_recovers_a_known_plant(tmp_path):
    a, b, c, sigma = -0.8, -0.25, -0.3, 0.2
    model = pm.fit(pm.load_series(synthetic_runs(tmp_path, a, b, c, sigma)), start=2)
    for name, true in (("a", a), ("b", b), ("c", c)):
        se = model["se"]["abc".index(name)]
        assert abs(model[name] - true) < 4 * se, (name, model[name], true, se)
    assert model["sigma"] == pytest.approx(sigma, rel=0.1)
    assert model["sensitivity"] == pytest.approx(-c / b, rel=0.25)
    assert abs(model["residual_autocorrelation"]) < 0.1


def test_floors_and_the_order_of_the_controller_update():
    """The floor of a log-normal deviation is its exact mean |exp(x) - 1|; setting beta from the same update's
    reading (one update of delay) tracks at least as well as klppo's order on the same plant and noise."""
    sd = 0.3
    f = pm.floor(sd, 0.2)
    # E|exp(x) - 1| for x ~ N(0, sd^2): exact, from the log-normal's partial moments
    from statistics import NormalDist

    phi = NormalDist().cdf
    exact = math.exp(sd**2 / 2) * (2 * phi(sd) - 1)
    assert f["tracking_error"] == pytest.approx(exact, abs=3e-3)
    assert f["in_band"] == pytest.approx(phi(math.log(1.2) / sd) - phi(math.log(0.8) / sd), abs=3e-3)

    model = {"a": -0.56, "b": -0.265, "c": -0.318, "sigma": 0.19}
    kw = dict(
        target=4.0,
        settings={},
        guard=None,
        updates=36,
        mini_batches=4,
        guard_noise=0.05,
        reading_noise=0.0,
        kl_coef=0.07,
        ramp=0.25,
        band=0.2,
    )
    late = np.mean([pm.simulate(model, seed=s, **kw)[0] for s in range(60)])
    early = np.mean([pm.simulate(model, seed=s, same_update=True, **kw)[0] for s in range(60)])
    assert early <= late + 0.01
