"""Exact math of the per-token KL estimators, the divergence table, and the full-vocabulary KL.

Everything runs in float64 on small categorical distributions enumerated exactly, except the
Gaussian Monte-Carlo check of Schulman's closed forms and the numerical-safety tests.
"""

import math

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from klppo.kl import (
    compute_kl,
    divergence_followed,
    estimate_kl,
    full_kl,
    get_kl_estimator,
    kl_estimators,
    kl_from_log_ratio,
)
from klppo.kl.divergence import FORWARD, NONE, REVERSE
from klppo.kl.estimators import BUILTIN_KL_ESTIMATORS, register_kl_estimator, unregister_kl_estimator

F64 = torch.float64
BASES = ("k1", "k2", "k3", "low_var_kl", "abs", "corrected_k3")
PER_TOKEN = BASES + tuple(b + "+" for b in BASES)
ALL = PER_TOKEN + ("full",)


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_names_and_order():
    assert kl_estimators() == list(ALL)
    assert BUILTIN_KL_ESTIMATORS == ALL
    assert kl_estimators() == kl_estimators()


@pytest.mark.parametrize("bad", ["k4", "K1", "", None])
def test_unknown_estimator_lists_every_name(bad):
    with pytest.raises(ValueError) as err:
        get_kl_estimator(bad)
    msg = str(err.value)
    for name in ALL:
        assert repr(name) in msg
    assert "register_kl_estimator" in msg
    with pytest.raises(ValueError):
        compute_kl(torch.zeros(2), torch.zeros(2), bad)


def test_full_is_a_logits_estimator_in_the_registry():
    assert kl_estimators(inputs="logits") == ["full"] and kl_estimators(inputs="logprobs") == list(PER_TOKEN)
    with pytest.raises(ValueError, match="takes logits"):
        compute_kl(torch.zeros(2), torch.zeros(2), "full")
    logits = torch.randn(3, 5, dtype=F64, requires_grad=True)
    ref = torch.randn(3, 5, dtype=F64)
    kl, clamped = estimate_kl("full", logits=logits, ref_logits=ref, return_clamped=True)
    assert torch.equal(kl, full_kl(logits, ref)) and not clamped.any()
    logp, ref_logp = logits.log_softmax(-1)[:, 0], ref.log_softmax(-1)[:, 0]
    assert torch.equal(estimate_kl("k3", logp, ref_logp), compute_kl(logp, ref_logp, "k3"))


def test_register_custom_estimator_and_twin():
    try:

        @register_kl_estimator("half_k1", formula="d / 2")
        def half(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
            return 0.5 * log_ratio

        logp = torch.tensor([0.3, -0.2], dtype=F64, requires_grad=True)
        ref = torch.tensor([0.1, 0.4], dtype=F64)
        assert torch.equal(compute_kl(logp, ref, "half_k1"), 0.5 * (logp - ref))
        twin = compute_kl(logp, ref, "half_k1+")
        assert torch.equal(twin, 0.5 * (logp - ref))
        (g,) = torch.autograd.grad(twin.sum(), logp)
        assert torch.allclose(g, (logp - ref).detach())
        assert "half_k1" in kl_estimators() and "half_k1+" in kl_estimators()
        assert divergence_followed("half_k1", "loss").divergence.startswith("unknown")
        with pytest.raises(ValueError, match="already registered"):
            register_kl_estimator("half_k1", formula="x")(half)
    finally:
        unregister_kl_estimator("half_k1")
    assert kl_estimators() == list(ALL)
    with pytest.raises(KeyError):
        unregister_kl_estimator("half_k1")


def test_get_kl_estimator_matches_compute_kl():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=F64)
    old = torch.tensor([-1.2, -2.5, -0.4], dtype=F64)
    for name in PER_TOKEN:
        assert torch.equal(get_kl_estimator(name)(logp - ref, logp - old), compute_kl(logp, ref, name, old_logp=old))


def test_an_estimate_from_the_log_ratios_equals_the_estimate_from_the_log_probs_with_its_gradient():
    """The rollout forms `logp - ref_logp` once and every estimate reads it; the loss forms the current log-ratio
    as the rollout's plus `logp - old_logp`. Both must give `compute_kl`'s value, clamp mask and gradient."""
    torch.manual_seed(0)
    ref, old = torch.randn(64, dtype=F64) * 3, torch.randn(64, dtype=F64) * 3
    for name in PER_TOKEN:
        logp = (torch.randn(64, dtype=F64) * 3).requires_grad_()
        expected, expected_clamped = compute_kl(logp, ref, name, old_logp=old, log_ratio_clamp=2.0, return_clamped=True)
        (expected_grad,) = torch.autograd.grad(expected.sum(), logp)
        old_log_ratio = logp - old
        log_ratio = (old - ref) + old_log_ratio  # the rollout's log-ratio plus the step since sampling
        kl, clamped = kl_from_log_ratio(log_ratio, name, old_log_ratio, log_ratio_clamp=2.0, return_clamped=True)
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.allclose(kl, expected, atol=1e-12) and torch.equal(clamped, expected_clamped), name
        assert torch.allclose(grad, expected_grad, atol=1e-12), name
        estimated = estimate_kl(
            name, log_ratio=log_ratio.detach(), old_log_ratio=old_log_ratio.detach(), log_ratio_clamp=2.0
        )
        assert torch.allclose(estimated, expected.detach(), atol=1e-12), name


def test_values_of_simple_tokens():
    d = torch.tensor([-1.0, 0.0, 0.5, 3.0], dtype=F64)
    ref = torch.zeros(4, dtype=F64)
    assert torch.allclose(compute_kl(d, ref, "k1"), d)
    assert torch.allclose(compute_kl(d, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(compute_kl(d, ref, "k3"), torch.exp(-d) - 1 + d)
    assert torch.allclose(compute_kl(d, ref, "abs"), d.abs())
    low = compute_kl(torch.tensor([-5.0, 1.0], dtype=F64), torch.zeros(2, dtype=F64), "low_var_kl")
    assert low[0] == 10.0 and torch.isclose(low[1], torch.tensor(math.exp(-1.0), dtype=F64))
    # shape broadcast, dtype kept, constants detached
    out = compute_kl(torch.zeros(2, 3), torch.zeros(3, requires_grad=True), "k3")
    assert out.shape == (2, 3) and out.dtype == torch.float32 and not out.requires_grad


# ---------------------------------------------------------------------------------------------
# exact enumeration on a small asymmetric categorical distribution


def _setup():
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=F64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.tensor([-0.5, 0.9, 0.2, -1.0, 0.6], dtype=F64), -1)
    mu_logp = torch.log_softmax(torch.tensor([1.0, 0.2, -0.7, 0.4, -0.3], dtype=F64), -1)
    return theta, ref_logp, mu_logp


def _grad(f, theta):
    (g,) = torch.autograd.grad(f, theta)
    return g


def _reverse_kl(theta, ref_logp):
    logp = torch.log_softmax(theta, -1)
    return (logp.exp() * (logp - ref_logp)).sum()


def _forward_kl(theta, ref_logp):
    logp = torch.log_softmax(theta, -1)
    return (ref_logp.exp() * (ref_logp - logp)).sum()


def _loss_grad(name, theta, ref_logp, sample_logp=None, old_logp=None):
    """sum_x q(x) * grad k(x), q = the sampling distribution (pi by default), weights constant."""
    logp = torch.log_softmax(theta, -1)
    weights = (logp if sample_logp is None else sample_logp).detach().exp()
    k = compute_kl(logp, ref_logp, name, old_logp=old_logp)
    return _grad((weights * k).sum(), theta)


def _reward_grad(name, theta, ref_logp):
    """sum_x pi(x) * k(x) * grad log pi(x): the estimator as a (detached) reward."""
    logp = torch.log_softmax(theta, -1)
    k = compute_kl(logp, ref_logp, name).detach()
    return _grad((logp.detach().exp() * k * logp).sum(), theta)


def test_expected_values():
    theta, ref_logp, mu_logp = _setup()
    logp = torch.log_softmax(theta, -1).detach()
    pi = logp.exp()
    kl = _reverse_kl(theta, ref_logp).detach()
    assert not torch.isclose(kl, _forward_kl(theta, ref_logp).detach())  # asymmetric pair
    e = {name: (pi * compute_kl(logp, ref_logp, name)).sum() for name in PER_TOKEN}
    assert torch.allclose(e["k1"], kl) and torch.allclose(e["k3"], kl)
    assert not torch.allclose(e["k2"], kl, atol=1e-3)  # k2 is biased
    assert torch.allclose(e["low_var_kl"], kl)  # no token reaches the clamp here
    for base in BASES:  # the twins keep the value exactly
        assert torch.equal(compute_kl(logp, ref_logp, base + "+"), compute_kl(logp, ref_logp, base))
    # corrected_k3 is an importance-weighted estimate under the sampling policy mu
    ck3 = compute_kl(logp, ref_logp, "corrected_k3", old_logp=mu_logp)
    assert torch.allclose((mu_logp.exp() * ck3).sum(), kl)
    assert not torch.allclose((mu_logp.exp() * compute_kl(logp, ref_logp, "k3")).sum(), kl, atol=1e-3)


def test_loss_mode_gradients_on_policy():
    theta, ref_logp, _ = _setup()
    reverse = _grad(_reverse_kl(theta, ref_logp), theta)
    forward = _grad(_forward_kl(theta, ref_logp), theta)
    assert not torch.allclose(reverse, forward, atol=1e-3)
    assert torch.allclose(_loss_grad("k2", theta, ref_logp), reverse)
    for name in PER_TOKEN:
        if name.endswith("+"):
            assert torch.allclose(_loss_grad(name, theta, ref_logp), reverse), name
    assert torch.allclose(_loss_grad("k1", theta, ref_logp), torch.zeros(5, dtype=F64), atol=1e-15)
    assert torch.allclose(_loss_grad("k3", theta, ref_logp), forward)
    assert torch.allclose(_loss_grad("low_var_kl", theta, ref_logp), forward)
    assert torch.allclose(_loss_grad("corrected_k3", theta, ref_logp), forward)  # no old_logp: k3
    logp_now = torch.log_softmax(theta, -1).detach()
    assert torch.allclose(_loss_grad("corrected_k3", theta, ref_logp, old_logp=logp_now), reverse)
    # abs follows the L1 distance sum_x |pi(x) - ref(x)| (twice total variation)
    l1 = (torch.softmax(theta, -1) - ref_logp.exp()).abs().sum()
    assert torch.allclose(_loss_grad("abs", theta, ref_logp), _grad(l1, theta))


def test_loss_mode_gradients_off_policy():
    theta, ref_logp, mu_logp = _setup()
    reverse = _grad(_reverse_kl(theta, ref_logp), theta)
    forward = _grad(_forward_kl(theta, ref_logp), theta)
    corrected = _loss_grad("corrected_k3", theta, ref_logp, sample_logp=mu_logp, old_logp=mu_logp)
    assert torch.allclose(corrected, reverse)
    for name in ("k2", "k3", "k2+", "k3+"):
        g = _loss_grad(name, theta, ref_logp, sample_logp=mu_logp, old_logp=mu_logp)
        assert not torch.allclose(g, reverse, atol=1e-3), name
        assert not torch.allclose(g, forward, atol=1e-3), name
    # stopgrad(w) * k2 is the other unbiased off-policy form
    logp = torch.log_softmax(theta, -1)
    w = (logp - mu_logp).exp().detach()
    surrogate = (mu_logp.exp() * w * compute_kl(logp, ref_logp, "k2")).sum()
    assert torch.allclose(_grad(surrogate, theta), reverse)


def test_reward_mode_gradients():
    theta, ref_logp, _ = _setup()
    reverse = _grad(_reverse_kl(theta, ref_logp), theta)
    forward = _grad(_forward_kl(theta, ref_logp), theta)
    assert torch.allclose(_reward_grad("k1", theta, ref_logp), reverse)
    assert torch.allclose(_reward_grad("k3", theta, ref_logp), reverse - forward)
    logp = torch.log_softmax(theta, -1)
    e_k2 = (logp.exp() * 0.5 * (logp - ref_logp) ** 2).sum()
    assert torch.allclose(_reward_grad("k2", theta, ref_logp), _grad(e_k2, theta) - reverse)


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("mode", ["reward", "loss"])
@pytest.mark.parametrize("name", PER_TOKEN)
def test_divergence_table_matches_exact_gradients(name, mode, off_policy):
    """divergence_followed's answer agrees with the exact expected gradient, for every entry."""
    theta, ref_logp, mu_logp = _setup()
    info = divergence_followed(name, mode, off_policy=off_policy)
    reverse = _grad(_reverse_kl(theta, ref_logp), theta)
    forward = _grad(_forward_kl(theta, ref_logp), theta)
    if mode == "reward":
        g = _reward_grad(name, theta, ref_logp)  # rewards are computed on-policy
    elif off_policy:
        g = _loss_grad(name, theta, ref_logp, sample_logp=mu_logp, old_logp=mu_logp)
    else:
        g = _loss_grad(name, theta, ref_logp, old_logp=torch.log_softmax(theta, -1).detach())
    assert torch.allclose(g, reverse) == info.unbiased, info
    if info.divergence == FORWARD:
        assert torch.allclose(g, forward)
    if info.divergence == NONE:
        assert torch.allclose(g, torch.zeros_like(g), atol=1e-15)
    assert info.message and "\n" not in info.message


def test_divergence_followed_validates_and_covers_full():
    assert divergence_followed("full", "loss").unbiased
    assert divergence_followed("full", "loss", off_policy=True).unbiased
    assert not divergence_followed("full", "reward").unbiased
    assert divergence_followed("k1", "reward").divergence == REVERSE
    with pytest.raises(ValueError, match="reward"):
        divergence_followed("k1", "both")
    with pytest.raises(ValueError, match="'k1'"):
        divergence_followed("k9", "loss")


# ---------------------------------------------------------------------------------------------
# sequence level (Tang & Munos 2025)


def _two_token_setup():
    g = torch.Generator().manual_seed(3)
    theta1 = torch.randn(3, generator=g, dtype=F64).requires_grad_()
    theta2 = torch.randn(3, 3, generator=g, dtype=F64).requires_grad_()  # row = first token
    ref1 = torch.randn(3, generator=g, dtype=F64)
    ref2 = torch.randn(3, 3, generator=g, dtype=F64)
    return theta1, theta2, ref1, ref2


def test_sequence_kl_reward_to_go_vs_per_token_loss():
    theta1, theta2, ref1, ref2 = _two_token_setup()
    params = (theta1, theta2)
    lp1 = torch.log_softmax(theta1, -1)[:, None].expand(3, 3)  # [x1, x2]
    lp2 = torch.log_softmax(theta2, -1)
    rl1 = torch.log_softmax(ref1, -1)[:, None].expand(3, 3)
    rl2 = torch.log_softmax(ref2, -1)
    prob = (lp1 + lp2).exp().detach()  # probability of each sequence, a constant weight
    seq_kl = ((lp1 + lp2).exp() * (lp1 + lp2 - rl1 - rl2)).sum()
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(seq_kl, params, retain_graph=True)])

    def grad(surrogate):
        return torch.cat([g.flatten() for g in torch.autograd.grad(surrogate, params, retain_graph=True)])

    # k1 in the reward, reward-to-go with gamma = 1: token t's score weighted by k1_t + k1_{t+1} + ...
    k1_1 = compute_kl(lp1, rl1, "k1").detach()
    k1_2 = compute_kl(lp2, rl2, "k1").detach()
    reward_to_go = (prob * (lp1 * (k1_1 + k1_2) + lp2 * k1_2)).sum()
    assert torch.allclose(grad(reward_to_go), exact)
    # without reward-to-go (each token sees only its own reward) the gradient is incomplete
    own_only = (prob * (lp1 * k1_1 + lp2 * k1_2)).sum()
    assert (grad(own_only) - exact).abs().max() > 1e-3
    # per-token loss terms (k2 loss, unbiased per token) miss the effect of token 1 on token 2
    k2_loss = (prob * (compute_kl(lp1, rl1, "k2") + compute_kl(lp2, rl2, "k2"))).sum()
    assert (grad(k2_loss) - exact).abs().max() > 1e-3

    # full-vocabulary KL: the reward path and the loss path are complementary halves
    kl_pos1 = full_kl(theta1, ref1)  # [] position 1
    kl_pos2 = full_kl(theta2, ref2)  # [3] position 2, per first token
    reward_part = (prob * (lp1 * (kl_pos1 + kl_pos2[:, None]).detach() + lp2 * kl_pos2[:, None].detach())).sum()
    loss_part = (prob * (kl_pos1 + kl_pos2[:, None])).sum()
    assert torch.allclose(grad(reward_part) + grad(loss_part), exact)
    assert (grad(loss_part) - exact).abs().max() > 1e-3
    assert (grad(reward_part) - exact).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Schulman's Gaussian example: q = N(0, 1) samples, p = N(mu, 1)


def _closed_forms(mu):
    kl = mu**2 / 2
    return {
        "k1_std": 2 / mu,
        "k2_bias": mu**2 / 4,
        "k2_std": math.sqrt(2 + mu**2),
        "k3_std": 2 * math.sqrt(math.exp(mu**2) - 1 - mu**2) / mu**2,
        "kl": kl,
    }


def test_closed_forms_match_reference_numbers():
    table = {0.1: (20, 0.0025, 1.418, 1.417), 1.0: (2, 0.25, 1.732, 1.695)}
    for mu, (k1_std, k2_bias, k2_std, k3_std) in table.items():
        c = _closed_forms(mu)
        assert c["k1_std"] == pytest.approx(k1_std, abs=5e-4)
        assert c["k2_bias"] == pytest.approx(k2_bias, abs=5e-5)
        assert c["k2_std"] == pytest.approx(k2_std, abs=5e-4)
        assert c["k3_std"] == pytest.approx(k3_std, abs=5e-4)


def _mean_std_se(x):
    """Sample mean and std with CLT standard errors (the std's from the 4th central moment)."""
    n = x.numel()
    mean = x.mean()
    centred = x - mean
    var = centred.square().mean()
    m4 = centred.pow(4).mean()
    std = var.sqrt()
    return (
        mean.item(),
        std.item(),
        (std / math.sqrt(n)).item(),
        ((m4 - var**2).sqrt() / math.sqrt(n) / (2 * std)).item(),
    )


@pytest.mark.parametrize("mu", [0.1, 1.0])
def test_gaussian_monte_carlo(mu):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(1_000_000, generator=gen, dtype=F64)
    log_q = -0.5 * x**2
    log_p = -0.5 * (x - mu) ** 2  # the shared normaliser cancels in every log-ratio
    assert torch.allclose(log_p - log_q, mu * x - mu**2 / 2)
    c = _closed_forms(mu)
    kl = c["kl"]
    # the estimators see logp = log q (the sampler) and ref_logp = log p, so d = -log(p/q)
    k1, k2, k3 = (compute_kl(log_q, log_p, name) for name in ("k1", "k2", "k3"))
    for k, mean_exp, std_exp in (
        (k1, kl, c["k1_std"] * kl),
        (k2, kl * (1 + c["k2_bias"]), c["k2_std"] * kl),
        (k3, kl, c["k3_std"] * kl),
    ):
        mean, std, se_mean, se_std = _mean_std_se(k)
        assert abs(mean - mean_exp) < 5 * se_mean
        assert abs(std - std_exp) < 5 * se_std
    # at mu = 1 the k2 bias is resolved by far; k3's variance is below k1's at both mu
    mean2, _, se2, _ = _mean_std_se(k2)
    if mu == 1.0:
        assert abs(mean2 - kl) > 20 * se2
    assert k3.std() < k1.std()


# ---------------------------------------------------------------------------------------------
# numerical safety


EXTREME = [1e4, -1e4, 1e3, -1e3, 100.0, -100.0, 41.0, -41.0, 40.0, -40.0, 0.0]


def _expected_clamped(name, d, old_diff, value_clamp, raw):
    c = 40.0
    m = d.abs() > c
    base = name.rstrip("+")
    if base == "corrected_k3" and old_diff is not None:
        m |= old_diff.abs() > c
    if base == "low_var_kl":
        dc = d.clamp(-c, c)
        m |= (torch.expm1(-dc) + dc) > 10
    if value_clamp is not None:
        m |= raw.abs() > value_clamp
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", PER_TOKEN)
def test_extreme_log_ratios_stay_finite(name, dtype):
    d = torch.tensor(EXTREME, dtype=F64)
    for with_old in (False, True):
        for value_clamp in (None, 10.0):
            logp = (d / 2).to(dtype).requires_grad_()
            ref_logp = (-d / 2).to(dtype)
            old_logp = (d / 2 + d.flip(0)).to(dtype) if with_old else None  # logp - old is extreme too
            kl, clamped = compute_kl(
                logp, ref_logp, name, old_logp=old_logp, value_clamp=value_clamp, return_clamped=True
            )
            (g,) = torch.autograd.grad(kl.sum(), logp)
            assert torch.isfinite(kl).all(), (name, with_old, value_clamp, kl)
            assert torch.isfinite(g).all(), (name, with_old, value_clamp, g)
            raw = compute_kl(logp.detach(), ref_logp, name, old_logp=old_logp)
            old_diff = (logp.detach() - old_logp).double() if with_old else None
            expected = _expected_clamped(name, (logp.detach() - ref_logp).double(), old_diff, value_clamp, raw)
            assert torch.equal(clamped, expected), (name, with_old, value_clamp)
            if value_clamp is not None:
                assert kl.abs().max() <= value_clamp


def test_clamp_mask_basic_and_zero_gradient_outside():
    logp = torch.tensor([41.0, 40.0, 0.5], dtype=F64, requires_grad=True)
    ref = torch.zeros(3, dtype=F64)
    kl, clamped = compute_kl(logp, ref, "k1", return_clamped=True)
    assert clamped.tolist() == [True, False, False]
    assert kl.tolist() == [40.0, 40.0, 0.5]
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert g.tolist() == [0.0, 1.0, 1.0]
    # without the log-ratio clamp, the naive output clamp alone would give a NaN gradient in float32
    logp32 = torch.tensor([-100.0], requires_grad=True)
    naive = compute_kl(logp32, torch.zeros(1), "k3", log_ratio_clamp=None, value_clamp=10.0)
    (g_naive,) = torch.autograd.grad(naive.sum(), logp32)
    assert not torch.isfinite(g_naive).all()
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        compute_kl(logp, ref, "k1", log_ratio_clamp=0.0)
    with pytest.raises(ValueError, match="value_clamp"):
        compute_kl(logp, ref, "k1", value_clamp=-1.0)


def test_corrected_k3_gradient_flows_through_the_ratio():
    logp = torch.tensor([-1.0, -0.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([-0.2, -1.5], dtype=F64)
    old = torch.tensor([-1.4, -0.1], dtype=F64)
    kl = compute_kl(logp, ref, "corrected_k3", old_logp=old)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    d = (logp - ref).detach()
    w = (logp - old).detach().exp()
    assert torch.allclose(kl, w * (torch.expm1(-d) + d))
    assert torch.allclose(g, w * d)  # w * (k3 + 1 - r) = w * d


# ---------------------------------------------------------------------------------------------
# full-vocabulary KL


def _dense_kl(x, y):
    logp, logq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 1024])
def test_full_kl_matches_dense(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=F64) * 4
    ref = torch.randn(3, 5, 11, generator=gen, dtype=F64) * 4
    logits[0, 0, 0], logits[1, 2, 3], ref[2, 4, 1] = 1e4, -1e4, 1e4
    logits = logits.requires_grad_()
    out = full_kl(logits, ref, chunk_size=chunk_size)
    dense_logits = logits.detach().clone().requires_grad_()
    dense = _dense_kl(dense_logits, ref)
    assert out.shape == (3, 5) and torch.allclose(out, dense, rtol=1e-10, atol=1e-10)
    upstream = torch.randn(3, 5, generator=gen, dtype=F64)
    (g,) = torch.autograd.grad((out * upstream).sum(), logits)
    (g_dense,) = torch.autograd.grad((dense * upstream).sum(), dense_logits)
    assert torch.allclose(g, g_dense, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(g).all()


def test_full_kl_edge_cases():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=gen, dtype=F64, requires_grad=True)
    y = torch.randn(4, 6, generator=gen, dtype=F64)
    # a non-contiguous slice, like logits[:, :-1]
    big = torch.randn(2, 5, 6, generator=gen, dtype=F64, requires_grad=True)
    ref_big = torch.randn(2, 5, 6, generator=gen, dtype=F64)
    sliced = full_kl(big[:, :-1], ref_big[:, :-1], chunk_size=3)
    assert torch.allclose(sliced, _dense_kl(big[:, :-1], ref_big[:, :-1]))
    sliced.sum().backward()
    assert big.grad[:, -1].abs().sum() == 0 and big.grad[:, :-1].abs().sum() > 0
    # vocabulary entries masked with -inf in both (top-k style) contribute nothing
    xm, ym = x.detach().clone().requires_grad_(), y.clone()
    with torch.no_grad():
        xm[:, 0] = -math.inf
        ym[:, 0] = -math.inf
    out = full_kl(xm, ym)
    assert torch.allclose(out, _dense_kl(x[:, 1:], y[:, 1:]))
    out.sum().backward()
    assert torch.isfinite(xm.grad).all()
    # 1-D input, reference gets no gradient, identical logits give 0, half precision -> float32
    ref_leaf = torch.randn(6, dtype=F64, requires_grad=True)
    v = full_kl(x[0], ref_leaf)
    assert v.shape == () and v.requires_grad
    v.backward()
    assert ref_leaf.grad is None
    assert full_kl(y, y).abs().max() < 1e-12
    assert full_kl(y.to(torch.bfloat16), y.to(torch.bfloat16) * 0.5).dtype == torch.float32
    with pytest.raises(ValueError, match="same shape"):
        full_kl(x, y[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        full_kl(x, y, chunk_size=0)


def _saved_bytes(fn, *inputs):
    """Bytes of storage that autograd saves for backward beyond the inputs' own storages."""
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    seen, record = set(), {"bytes": 0, "tensors": 0}

    def pack(t):
        storage = t.untyped_storage()
        record["tensors"] += 1
        if storage.data_ptr() not in input_storages and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            record["bytes"] += storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, record


def test_full_kl_memory_is_chunk_bounded():
    n, vocab, chunk = 64, 50_000, 8
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(n, vocab, generator=gen).requires_grad_()
    ref = torch.randn(n, vocab, generator=gen)
    bound = chunk * vocab * 4  # one float32 chunk of softmax

    out, chunked = _saved_bytes(lambda a, b: full_kl(a, b, chunk_size=chunk), logits, ref)
    assert chunked["tensors"] >= 3  # the hook does see the custom function's saved tensors
    assert 0 < chunked["bytes"] <= bound, chunked
    _, dense = _saved_bytes(_dense_kl, logits, ref)
    assert dense["bytes"] >= n * vocab * 4  # the naive graph keeps O(N x V): the probe can fail
    out.sum().backward()
    g = logits.grad
    dense_logits = logits.detach().double().requires_grad_()
    _dense_kl(dense_logits, ref.double()).sum().backward()
    assert torch.allclose(out.double(), _dense_kl(logits.detach().double(), ref.double()), rtol=1e-4, atol=1e-5)
    assert torch.allclose(g.double(), dense_logits.grad, rtol=1e-3, atol=1e-8)
