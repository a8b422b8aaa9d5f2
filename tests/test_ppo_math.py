"""PPO's math against values computed by hand: GAE (with padding), the clipped policy and value losses, and
truncation at the stop token. Float64, explicit numbers; each expected value is worked out in a comment."""

from __future__ import annotations

import math

import pytest
import torch

from klppo.ppo.advantages import gae_advantages
from klppo.ppo.generation.sampling import ends_with_stop, truncate_at_stop
from klppo.ppo.losses import clipped_policy_loss, clipped_value_loss

F64 = torch.float64


def naive_gae(rewards, values, n, gamma, lam):
    """One sequence with `n` valid tokens, the last one terminal: the loop of Schulman et al. (2016)."""
    adv = [0.0] * n
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        adv[t] = delta + gamma * lam * (adv[t + 1] if t + 1 < n else 0.0)
    return adv


def test_gae_by_hand_with_a_padded_row():
    """gamma 0.9, lam 0.8 (gamma * lam = 0.72). Row 1 has 2 valid tokens; its padding holds a reward and a value
    that must not count (the sequence ends at its last valid token)."""
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.5, 3.0, 5.0]], dtype=F64)
    values = torch.tensor([[0.5, 1.0, -1.0], [2.0, 1.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: t=2: delta = 2 + 0 - (-1) = 3                          A2 = 3
    #        t=1: delta = 0 + 0.9 * (-1) - 1 = -1.9                 A1 = -1.9 + 0.72 * 3 = 0.26
    #        t=0: delta = 1 + 0.9 * 1 - 0.5 = 1.4                   A0 = 1.4 + 0.72 * 0.26 = 1.5872
    # row 1: t=1 is terminal: delta = 3 + 0 - 1 = 2                 A1 = 2
    #        t=0: delta = 0.5 + 0.9 * 1 - 2 = -0.6                  A0 = -0.6 + 0.72 * 2 = 0.84
    expected = torch.tensor([[1.5872, 0.26, 3.0], [0.84, 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    # returns = A + V on valid tokens, 0 on padding
    torch.testing.assert_close(
        returns, torch.tensor([[2.0872, 1.26, 2.0], [2.84, 3.0, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )


def test_gae_special_cases_by_hand():
    """lam = 1: A_t is the discounted return minus V_t (Monte Carlo); lam = 0: the one-step TD error."""
    rewards = torch.tensor([[1.0, 2.0, 4.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, 1.0]], dtype=F64)
    mask = torch.ones(1, 3)
    mc, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    # G2 = 4, G1 = 2 + 0.5 * 4 = 4, G0 = 1 + 0.5 * 4 = 3; A = G - V
    torch.testing.assert_close(mc, torch.tensor([[2.5, 3.75, 3.0]], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, torch.tensor([[3.0, 4.0, 4.0]], dtype=F64), rtol=0, atol=1e-12)
    td, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    # delta_0 = 1 + 0.5 * 0.25 - 0.5 = 0.625, delta_1 = 2 + 0.5 * 1 - 0.25 = 2.25, delta_2 = 4 - 1 = 3
    torch.testing.assert_close(td, torch.tensor([[0.625, 2.25, 3.0]], dtype=F64), rtol=0, atol=1e-12)


def test_gae_matches_the_naive_loop_and_ignores_padding():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 7, generator=gen, dtype=F64)
    values = torch.randn(5, 7, generator=gen, dtype=F64)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    for b, n in enumerate(lengths):
        expected = naive_gae(rewards[b].tolist(), values[b].tolist(), n, 0.97, 0.9)
        assert advantages[b, :n].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert (advantages[b, n:] == 0).all() and (returns[b, n:] == 0).all()
    # whatever finite values the padding holds, the advantages are the same
    noisy_r, noisy_v = rewards.clone(), values.clone()
    noisy_r[mask == 0], noisy_v[mask == 0] = 1e6, -1e6
    again, _ = gae_advantages(noisy_r, noisy_v, mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(again, advantages, rtol=0, atol=1e-9)


def test_clipped_policy_loss_by_hand():
    """cliprange 0.2. Per token: loss = max(-A r, -A clip(r, 0.8, 1.2)), the pessimistic branch."""
    log_ratio = torch.tensor([[0.1, 0.5, 0.5, -0.5, -0.5]], dtype=F64)
    advantages = torch.tensor([[1.0, 2.0, -1.0, 1.0, -1.0]], dtype=F64)
    old_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5]], dtype=F64)
    logp = (old_logp + log_ratio).requires_grad_()
    loss, clipped, got_log_ratio = clipped_policy_loss(logp, old_logp, advantages, cliprange=0.2)
    e01, e05, em05 = math.exp(0.1), math.exp(0.5), math.exp(-0.5)  # 1.105, 1.649, 0.607
    expected = [
        -e01,  # r = 1.105 inside [0.8, 1.2]: -A r
        -2.0 * 1.2,  # A > 0, r = 1.649 > 1.2: clipped, -2 * 1.2 = -2.4 (no more gain for raising r)
        e05,  # A < 0, r = 1.649: -A r = 1.649 > -A * 1.2 = 1.2: the unclipped, larger loss
        -em05,  # A > 0, r = 0.607 < 0.8: -A r = -0.607 > -0.8: unclipped
        0.8,  # A < 0, r = 0.607 < 0.8: -A r = 0.607 < -A * 0.8 = 0.8: clipped
    ]
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-12)
    assert clipped[0].tolist() == [False, True, False, False, True]
    torch.testing.assert_close(got_log_ratio, log_ratio, rtol=0, atol=1e-12)
    # gradient wrt logp: -A r on unclipped tokens, 0 on clipped ones
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad[0].tolist() == pytest.approx([-e01, 0.0, e05, -em05, 0.0], rel=1e-12, abs=1e-15)


def test_clipped_value_loss_by_hand():
    """cliprange_value 0.2: v_clip = old + clip(v - old, -0.2, 0.2); loss = 0.5 max((v - R)^2, (v_clip - R)^2)."""
    values = torch.tensor([[1.0, 0.6, 1.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.0]], dtype=F64)
    returns = torch.tensor([[2.0, 2.0, 0.0, 1.0, -3.0]], dtype=F64)
    loss, clipped = clipped_value_loss(values, old_values, returns, cliprange_value=0.2)
    expected = [
        0.5 * 1.69,  # v_clip = 0.7: (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69: clipped
        0.5 * 1.96,  # v - old = 0.1 inside the range: both (0.6 - 2)^2 = 1.96
        0.5 * 1.0,  # v_clip = 0.7: (1 - 0)^2 = 1 > (0.7 - 0)^2 = 0.49
        0.5 * 4.0,  # v_clip = -0.2: (-1 - 1)^2 = 4 > (-0.2 - 1)^2 = 1.44
        0.5 * 7.84,  # v_clip = -0.2: (-1 + 3)^2 = 4 < (-0.2 + 3)^2 = 7.84: clipped
    ]
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-12)
    assert clipped[0].tolist() == [True, False, False, False, True]
    (grad,) = torch.autograd.grad(loss.sum(), values)
    # d/dv 0.5 (v - R)^2 = v - R where unclipped; the clipped branch does not depend on v (0)
    assert grad[0].tolist() == pytest.approx([0.0, -1.4, 1.0, -2.0, 0.0], rel=1e-12, abs=1e-15)


def test_truncate_at_stop_by_hand():
    """Stop token 2, pad 0: everything after the first stop token becomes padding; the stop token is kept."""
    responses = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9], [4, 4, 4, 2]])
    truncated, mask = truncate_at_stop(responses, stop_token_id=2, pad_token_id=0)
    assert truncated.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0], [4, 4, 4, 2]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert ends_with_stop(truncated, mask, 2).tolist() == [True, False, True, True]
    # no stop token (fixed-length responses): nothing is cut
    kept, full = truncate_at_stop(responses, stop_token_id=None, pad_token_id=0)
    assert torch.equal(kept, responses) and full.tolist() == [[1] * 4] * 4


def test_explained_variance_is_one_minus_the_residual_share_of_the_returns_variance():
    """Returns 1, 2, 3, 4 (variance 1.25) on the masked tokens; values 1, 2, 3, 3: residuals 0, 0, 0, 1 (variance
    0.1875): 1 - 0.1875 / 1.25 = 0.85. Perfect values give 1; the returns' mean gives 0; a token outside the mask
    counts for nothing, whatever it holds."""
    import math

    from klppo.kl.reduce import explained_variance

    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    values = torch.tensor([[1.0, 2.0, -5.0], [3.0, 3.0, 7.0]])
    assert explained_variance(returns, values, mask) == pytest.approx(0.85)
    assert explained_variance(returns, returns.nan_to_num(), mask) == pytest.approx(1.0)
    assert explained_variance(returns, torch.full_like(returns, 2.5), mask) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)))
