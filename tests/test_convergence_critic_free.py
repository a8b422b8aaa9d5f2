"""Known answers for the critic-free advantage estimators on the one-token bandit (`klppo.testing.bandit`): 16 prompts
x 4 responses per update, no critic, measured exactly from the trained policy's logits.

Measured (CPU, torch 2.13, seeds 0-2, the settings of the PPO tests in `test_convergence.py`):

- RLOO, k1 in the reward, 120 updates: KL(pi || pi*) 0.0104-0.0126 from 0.455 at the start (PPO with a critic:
  0.0066-0.0072); max |pi - pi*| over the vocabulary 0.0013-0.0024;
- RLOO, k2 in the loss, 240 updates with decay: 0.027-0.034 (PPO: 0.017); max |pi - pi*| 0.0014-0.0018;
- GRPO, k1 in the reward, 120 updates: 0.014 from pi* (the return is constant at pi*, so the group
  normalisation leaves it a fixed point);
- GRPO, k2 in the loss, fixed beta: its group normalisation changes the objective. For a 0/1 reward and groups of
  G, the expected normalised advantage of a response is a function of its reward and of q = pi(reward 1) alone,
  so the policy gradient is that of `E_pi[c_q(r)]` with `c_q(1) - c_q(0) = Delta_G(q)`, and the fixed point is
  the tilt `pi = ref * exp(r * Delta_G(q) / beta) / Z` whose own q is q. For G = 4 and beta = 0.5: q = 0.86
  (Delta = 1.45), where pi* has q = 0.72. 600 updates (constant lr 1e-3) reached q = 0.865;
- GRPO, k3 in the loss (TRL's choice) with the default (equilibrium) controller, from beta 5x below and 5x above
  the beta* of its group-normalised fixed point (0.628): the mean KL over the last 80 of 200 updates at 1.05x and
  1.00x the target, 92% and 97% of the second half within +-20%, mean |KL / target - 1| 0.122 and 0.066, peaks
  1.38x and 1.30x, beta's second half 1.05x beta* from both sides. (The tracking controller, before: 1.00x and
  0.98x, 78% and 66%, 0.129 and 0.154, peaks 3.4x and 1.25x.)
"""

from __future__ import annotations

import pytest
import torch

from klppo.models import TINY_MODEL, resolve_model_path
from klppo.testing.bandit import (
    bandit_trainer,
    grpo_advantage_gap,
    grpo_coefficient_for_target,
    kl,
    one_token_state,
    tilted,
)

pytestmark = [pytest.mark.slow, pytest.mark.numerics]
BETA = 0.5
GROUP = 4


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


def critic_free_bandit(tiny_path, tmp_path, estimator, **overrides):
    return bandit_trainer(tiny_path, tmp_path, advantage_estimator=estimator, num_generations=GROUP, **overrides)


def test_rloo_reward_mode_k1_lands_on_the_tilted_optimum(tiny_path, tmp_path):
    trainer = critic_free_bandit(tiny_path, tmp_path, "rloo", kl_mode="reward", kl_estimator="k1")
    assert trainer.model.critic is None and trainer.model.value_head is None
    start = one_token_state(trainer)
    opt = tilted(start["ref"], start["reward"], BETA)
    assert kl(start["logp"], opt) > 0.4
    trainer.train()
    end = one_token_state(trainer)
    assert kl(end["logp"], opt) < 0.02  # the PPO test's tolerance
    assert float((end["logp"].exp() - opt.exp()).abs().max()) < 0.005


def test_rloo_loss_mode_k2_lands_on_the_same_optimum(tiny_path, tmp_path):
    """beta names E[r] - beta * KL in loss mode too: the whitened RLOO advantage is divided by its std, and so
    is the loss-mode coefficient (`kl_loss_scale`)."""
    trainer = critic_free_bandit(
        tiny_path, tmp_path, "rloo", kl_mode="loss", kl_estimator="k2", max_steps=240, lr_scheduler_type="linear"
    )
    trainer.train()
    end = one_token_state(trainer)
    opt = tilted(end["ref"], end["reward"], BETA)
    assert kl(end["logp"], opt) < 0.06  # the PPO test's tolerance
    assert float((end["logp"].exp() - opt.exp()).abs().max()) < 0.005


def test_grpo_reward_mode_k1_keeps_pi_star_as_its_fixed_point(tiny_path, tmp_path):
    """With k1 in the reward GRPO divides the whole return `r - beta * KL` by a positive number per group; at pi*
    that return is the same for every response, so pi* is still the fixed point (measured: 0.014 from it)."""
    trainer = critic_free_bandit(tiny_path, tmp_path, "grpo", kl_mode="reward", kl_estimator="k1")
    trainer.train()
    end = one_token_state(trainer)
    assert kl(end["logp"], tilted(end["ref"], end["reward"], BETA)) < 0.03


def grpo_fixed_point(ref: torch.Tensor, reward: torch.Tensor, beta: float, group: int) -> torch.Tensor:
    """log pi of GRPO's loss-mode fixed point on a 0/1 reward: `ref * exp(r * Delta_G(q) / beta) / Z` with q its
    own reward probability (bisection on q: the tilt's q minus q changes sign once on this bandit)."""

    def excess(q: float) -> float:
        return float((tilted(ref, reward, beta / grpo_advantage_gap(q, group)).exp() * reward).sum()) - q

    lo, hi = 0.3, 0.99
    assert excess(lo) > 0 > excess(hi)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return tilted(ref, reward, beta / grpo_advantage_gap(0.5 * (lo + hi), group))


def test_grpo_loss_mode_lands_on_its_group_normalised_fixed_point_not_on_pi_star(tiny_path, tmp_path):
    trainer = critic_free_bandit(
        tiny_path, tmp_path, "grpo", kl_mode="loss", kl_estimator="k2", max_steps=600, lr_scheduler_type="constant"
    )
    trainer.train()
    end = one_token_state(trainer)
    star = tilted(end["ref"], end["reward"], BETA)
    fixed = grpo_fixed_point(end["ref"], end["reward"], BETA, GROUP)
    q = lambda logp: float((logp.exp() * end["reward"]).sum())  # noqa: E731
    assert q(fixed) == pytest.approx(0.86, abs=0.01) and q(star) == pytest.approx(0.72, abs=0.01)
    assert q(end["logp"]) == pytest.approx(q(fixed), abs=0.03)
    assert kl(end["logp"], fixed) < 0.5 * kl(end["logp"], star)


@pytest.mark.parametrize("start", [0.2, 5.0])
def test_grpo_k3_loss_holds_a_kl_target_at_the_beta_of_its_fixed_point(tiny_path, tmp_path, start):
    """GRPO's group normalisation makes its loss follow the policy gradient of `E[Delta_G(q) * r]`, so the default
    (equilibrium) controller, fed the reward times the batch's advantage slope, lands on the beta whose
    group-normalised fixed point has the target KL (the forward-KL optimum at beta / Delta_G(q), k3 in the loss),
    from 5x below and 5x above it; the KL is read by the exact `full` statistic."""
    state = one_token_state(bandit_trainer(tiny_path, tmp_path, max_steps=1))
    target = kl(tilted(state["ref"], state["reward"], BETA), state["ref"])
    beta_star = grpo_coefficient_for_target(state["ref"], state["reward"], target, GROUP, forward=True)
    trainer = critic_free_bandit(
        tiny_path,
        tmp_path,
        "grpo",
        kl_mode="loss",
        kl_estimator="k3",
        kl_target=target,
        kl_coef=start * beta_star,
        max_steps=200,
        learning_rate=3e-3,
        per_device_train_batch_size=128,
        rollout_forward_batch_size=128,
    )
    assert trainer.args.kl_controller == "equilibrium"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kl/value" in h]
    kls, coefs = [h["kl/value"] for h in logs], [h["kl/coef"] for h in logs]
    errors = [abs(k / target - 1) for k in kls[len(kls) // 2 :]]
    assert sum(kls[-80:]) / 80 == pytest.approx(target, rel=0.15)
    assert sum(e <= 0.2 for e in errors) / len(errors) >= 0.6
    assert sum(errors) / len(errors) <= 0.2
    assert max(kls) <= 3.0 * target
    assert 1 / 1.3 < sum(coefs[100:]) / 100 / beta_star < 1.3
