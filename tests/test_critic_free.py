"""Critic-free advantages (`advantage_estimator`: `rloo`, `grpo`): the math against values worked out by hand,
the config's checks, and KLPPOTrainer on the tiny Llama with no critic built or trained."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from datasets import Dataset

from klppo import KLPPOConfig, KLPPOTrainer
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.ppo.advantages import advantage_slope, grpo_advantages, rloo_advantages, sequence_advantages
from klppo.testing.bandit import grpo_advantage_gap

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

F64 = torch.float64


def test_rloo_by_hand():
    """Two prompts, three responses each. Group 0: returns 1, 2, 6 (sum 9): A = 1 - 8/2, 2 - 7/2, 6 - 3/2.
    Group 1: 0, 0, 3 (sum 3): A = 0 - 3/2, 0 - 3/2, 3 - 0."""
    returns = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0], dtype=F64)
    expected = torch.tensor([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0], dtype=F64)
    assert torch.equal(rloo_advantages(returns, 3), expected)
    # = G / (G - 1) * (R - group mean): group 0's mean is 3, 1.5 * (1 - 3) = -3
    assert torch.allclose(rloo_advantages(returns, 3)[:3], 1.5 * (returns[:3] - 3.0))


def test_rloo_of_pairs_is_the_difference():
    """G = 2: each response's baseline is the other one."""
    returns = torch.tensor([0.25, 1.0, -2.0, -2.0], dtype=F64)
    assert torch.equal(rloo_advantages(returns, 2), torch.tensor([-0.75, 0.75, 0.0, 0.0], dtype=F64))


def test_rloo_is_an_unbiased_policy_gradient_by_enumeration():
    """E[A_1 * grad log pi(y_1)] over every pair of draws from a 3-armed softmax bandit equals grad E[r]
    exactly: the leave-one-out baseline adds no bias (coefficient 1)."""
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    r = torch.tensor([1.0, 0.0, 2.5], dtype=F64)
    p = torch.softmax(theta, 0)
    (grad_true,) = torch.autograd.grad((p * r).sum(), theta)
    p = p.detach()
    score = torch.eye(3, dtype=F64) - p  # row a: grad log pi(a) = e_a - p
    expected = torch.zeros(3, dtype=F64)
    for a in range(3):
        for b in range(3):
            adv = rloo_advantages(torch.stack([r[a], r[b]]), 2)[0]
            expected += p[a] * p[b] * adv * score[a]
    assert torch.allclose(expected, grad_true, atol=1e-15)


def test_grpo_by_hand():
    """Group 0: 1, 2, 6: mean 3, unbiased std sqrt(((-2)^2 + (-1)^2 + 3^2) / 2) = sqrt(7).
    Group 1: all 4: std 0, so every advantage is 0 / (0 + eps) = 0."""
    returns = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0], dtype=F64)
    s = math.sqrt(7.0) + 1e-4
    expected = torch.tensor([-2 / s, -1 / s, 3 / s, 0.0, 0.0, 0.0], dtype=F64)
    assert torch.allclose(grpo_advantages(returns, 3), expected, rtol=0, atol=1e-15)
    # the naive loop of the docstring
    for i in range(3):
        group = [1.0, 2.0, 6.0]
        assert float(grpo_advantages(returns, 3)[i]) == pytest.approx(
            (group[i] - statistics.mean(group)) / (statistics.stdev(group) + 1e-4), rel=1e-14
        )


def test_grpo_pairs_and_eps():
    """G = 2: std = |a - b| / sqrt(2), so advantages are +-1/sqrt(2) up to eps."""
    adv = grpo_advantages(torch.tensor([0.0, 1.0], dtype=F64), 2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0], dtype=F64) / math.sqrt(2), atol=1e-15)


@pytest.mark.parametrize("fn", [rloo_advantages, grpo_advantages])
def test_groups_are_checked(fn):
    with pytest.raises(ValueError, match="num_generations >= 2"):
        fn(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="multiple of num_generations=3"):
        fn(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="choose one of"):
        sequence_advantages("gae", torch.zeros(4), 2)


# ---------------------------------------------------------------------- config
def config(tmp_path, **overrides) -> KLPPOConfig:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to="none", use_cpu=True)
    return KLPPOConfig(**{**base, **overrides})


def test_num_generations_defaults(tmp_path):
    assert config(tmp_path).num_generations == 1
    assert config(tmp_path, advantage_estimator="rloo").num_generations == 4
    assert config(tmp_path, advantage_estimator="grpo", num_generations=2).critic_free


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(advantage_estimator="ppo"), "Choose one of: 'gae', 'rloo', 'grpo'"),
        (dict(advantage_estimator="rloo", num_generations=1), "must be >= 2"),
        (
            dict(advantage_estimator="grpo", num_generations=3),
            r"rollout batch \(4 = .*multiple of num_generations=3.*e\.g\. 3 or 6",
        ),
        (dict(num_generations=0), "must be >= 1"),
    ],
)
def test_config_refuses(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


# ---------------------------------------------------------------------- trainer
def even_reward(prompts, completions, completion_ids=None, **kwargs):
    """The fraction of even token ids: varies between responses of the tiny random model."""
    return [sum(i % 2 == 0 for i in ids) / len(ids) for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


@pytest.fixture(scope="module")
def prompts():
    return Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"]})


def make_trainer(tiny_path, prompts, tmp_path, **overrides) -> KLPPOTrainer:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_ppo_epochs=1,
        max_steps=2,
        response_length=6,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
    )
    args = KLPPOConfig(**{**base, **overrides})
    return KLPPOTrainer(model=tiny_path, args=args, train_dataset=prompts, reward_funcs=even_reward)


@pytest.mark.parametrize("estimator, kl_mode", [("rloo", "reward"), ("grpo", "loss")])
def test_no_critic_is_built_or_trained(tiny_path, prompts, tmp_path, estimator, kl_mode, caplog):
    caplog.set_level("INFO", logger="klppo.ppo.build")
    trainer = make_trainer(
        tiny_path,
        prompts,
        tmp_path,
        advantage_estimator=estimator,
        num_generations=4,
        kl_mode=kl_mode,
        kl_estimator="k1" if kl_mode == "reward" else "k3",
    )
    assert "needs no critic" in caplog.text
    model = trainer.model
    assert model.critic is None and model.value_head is None
    assert not any(n.startswith(("critic.", "value_head.")) for n, _ in model.named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    seen = []
    original = trainer.compute_advantages

    def spy(rollout, rewards, penalty):
        out = original(rollout, rewards, penalty)
        seen.append((rollout, penalty, out))
        return out

    trainer.compute_advantages = spy
    trainer.train()
    for name, param in model.named_parameters():
        if name in before:
            assert not torch.equal(before[name], param), f"{name} did not change"
    log = next(h for h in reversed(trainer.state.log_history) if "kl/coef" in h)
    assert "loss/value" not in log and "val/clipfrac" not in log and math.isfinite(log["loss/policy"])
    rollout, penalty, adv = seen[-1]
    # the 8 rows are 2 prompts x 4 responses, each prompt's in consecutive rows
    assert rollout.prompts[:4] == [rollout.prompts[0]] * 4 and rollout.prompts[4:] == [rollout.prompts[4]] * 4
    assert rollout.prompts[0] != rollout.prompts[4]
    mask = rollout.response_mask.bool()
    returns = (penalty.token_rewards * mask).sum(dim=1)
    raw = sequence_advantages(estimator, returns, 4)
    if estimator == "rloo":  # whitened with the global statistics, one value on every token of a sequence
        assert adv.metrics["policy/advantage_std"] > 0
        expected = (raw[:, None] - (raw[:, None] * mask).sum() / mask.sum()) / adv.metrics["policy/advantage_std"]
        assert torch.allclose(adv.advantages[mask], expected.expand_as(mask)[mask], atol=1e-4)
    else:  # GRPO: not whitened again; the loss coefficient is beta as it is
        assert torch.allclose(adv.advantages, raw[:, None] * mask)
        assert adv.kl_loss_coef == penalty.coef


def test_num_train_epochs_counts_prompts(tiny_path, prompts, tmp_path):
    """4 prompts, 2 prompts x 4 responses per update: one epoch is 2 updates."""
    args = KLPPOConfig(
        output_dir=str(tmp_path / "o"),
        per_device_train_batch_size=8,
        advantage_estimator="rloo",
        num_generations=4,
        max_steps=-1,
        num_train_epochs=1,
        report_to="none",
        use_cpu=True,
    )
    assert args.num_updates(len(prompts), world_size=1) == 2


def test_a_critic_free_run_saves_and_resumes(tiny_path, prompts, tmp_path):
    """No critic in the checkpoint (no `value_model/`); resuming continues at the next update."""
    import os

    kw = dict(advantage_estimator="rloo", num_generations=4, save_strategy="steps", save_steps=1)
    full = make_trainer(tiny_path, prompts, tmp_path, **kw)
    full.train()
    checkpoint = os.path.join(full.args.output_dir, "checkpoint-1")
    assert os.path.isdir(checkpoint) and not os.path.exists(os.path.join(checkpoint, "value_model"))
    resumed = make_trainer(tiny_path, prompts, tmp_path / "again", **kw)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 2
    with pytest.raises(Exception, match="advantage_estimator"):
        make_trainer(tiny_path, prompts, tmp_path / "gae", save_strategy="steps", save_steps=1).train(
            resume_from_checkpoint=checkpoint
        )


def test_advantage_slope_is_the_expected_advantage_per_unit_of_reward():
    """Exact for centring alone (TRL's `scale_rewards="none"`: (G - 1) / G); for GRPO's group normalisation of a 0/1
    reward, Delta_G(q) = E[A | r = 1] - E[A | r = 0], to sampling error (40,000 groups)."""
    rewards = torch.randn(200, dtype=F64)
    centred = (rewards.view(-1, 4) - rewards.view(-1, 4).mean(dim=1, keepdim=True)).flatten()
    assert advantage_slope(centred, rewards, 4) == pytest.approx(0.75, rel=1e-12)
    assert advantage_slope(torch.zeros(8), torch.ones(8), 4) == 0.0  # no group varies: no tilt
    with_nan = torch.cat([rewards[:8], torch.tensor([float("nan"), 1.0, 0.0, 1.0], dtype=F64)])
    # a group with an unscored row is left out
    assert advantage_slope(torch.cat([centred[:8], torch.zeros(4)]), with_nan, 4) == pytest.approx(
        advantage_slope(centred[:8], rewards[:8], 4), rel=1e-12
    )
    generator = torch.Generator().manual_seed(0)
    for q in (0.2, 0.7):
        r = (torch.rand(160000, generator=generator) < q).double()
        assert advantage_slope(grpo_advantages(r, 4), r, 4) == pytest.approx(grpo_advantage_gap(q, 4), rel=0.02)
