"""The controller statistic (`kl_statistic`): what it defaults to, and that `full` reads the exact KL of the
sampled prefixes, checked against sums over the vocabulary of the tiny model's own next-token distributions."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset

from klppo import KLPPOConfig, KLPPOTrainer
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.testing import klppo_config
from klppo.testing.bandit import PROMPT, bandit_trainer, kl, policy_and_reference


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


def _config(tmp_path, **overrides) -> KLPPOConfig:
    base = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, save_strategy="no")
    return klppo_config(**{**base, **overrides})


def test_the_statistic_defaults_to_full_with_a_target_and_to_the_estimator_without(tmp_path):
    assert _config(tmp_path, kl_target=4.0).experimental.kl_statistic == "full"
    assert _config(tmp_path, kl_estimator="k3").experimental.kl_statistic == "k3"
    assert _config(tmp_path, kl_target=4.0, kl_statistic="k1").experimental.kl_statistic == "k1"
    with pytest.raises(ValueError, match="kl_statistic.*k1.*full"):
        _config(tmp_path, kl_target=4.0, kl_statistic="k9")
    with pytest.raises(ValueError, match="generation_logits_max_mb"):
        _config(tmp_path, kl_target=4.0, generation_logits_max_mb=-1)


def _moved_policy_rollout(trainer, n: int):
    """One rollout of `n` sequences after the policy's LM head was pushed away from the reference's."""
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    torch.manual_seed(3)
    with torch.no_grad():
        head = policy.get_output_embeddings().weight
        head.add_(0.3 * torch.randn_like(head))  # not tied to the frozen reference copy
    rollout = trainer.rollout(trainer.prompt_batch([PROMPT] * n))
    rewards = trainer.compute_rewards(rollout)
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    return rollout, penalty.metrics


def test_full_statistic_is_the_exact_kl_of_one_token_responses(tiny_path, tmp_path):
    """With one-token responses the statistic in `sequence` unit is KL(pi || ref) itself: `full` must give it
    exactly, whatever was sampled, while `k1` (the same expectation) scatters around it."""
    trainer = bandit_trainer(
        tiny_path, tmp_path, kl_target=1.0, max_steps=1, per_device_train_batch_size=32, rollout_forward_batch_size=32
    )
    assert trainer.args.experimental.kl_statistic == "full" and trainer.args.kl_estimator == "k1"
    _, metrics = _moved_policy_rollout(trainer, 32)
    exact = kl(*policy_and_reference(trainer))
    assert exact > 0.1  # the policy has moved: a real KL to read
    assert metrics["kl/value"] == pytest.approx(exact, rel=1e-4)
    assert metrics["kl/full"] == pytest.approx(metrics["kl/value"], rel=1e-5)
    assert abs(metrics["kl/k1"] - exact) > 1e-3  # a sample estimate, not the exact value


def test_full_statistic_sums_the_exact_kl_at_each_sampled_prefix(tiny_path, tmp_path):
    """Two-token responses: the statistic is the mean over sequences of KL at the first position plus KL at the
    second position given the sampled first token (the chain rule), each a sum over the vocabulary."""
    trainer = bandit_trainer(
        tiny_path,
        tmp_path,
        response_length=2,
        kl_target=1.0,
        max_steps=1,
        per_device_train_batch_size=16,
        rollout_forward_batch_size=16,
    )
    rollout, metrics = _moved_policy_rollout(trainer, 16)
    assert bool(rollout.response_mask.bool().all())  # fixed-length responses: both positions count
    first_tokens = [int(t) for t in rollout.responses[:, 0]]
    pol0, ref0 = policy_and_reference(trainer)
    pol1, ref1 = policy_and_reference(trainer, [(t,) for t in first_tokens])
    expected = kl(pol0, ref0) + sum(kl(pol1[i], ref1[i]) for i in range(16)) / 16
    assert metrics["kl/value"] == pytest.approx(expected, rel=1e-4)


def test_a_per_token_statistic_other_than_the_estimator(tiny_path, tmp_path):
    """`kl_statistic: k3` beside `kl_estimator: k1`: the controller reads k3's per-sequence sums (logged as
    `kl/k3`), while the reward keeps k1."""
    trainer = bandit_trainer(
        tiny_path,
        tmp_path,
        response_length=2,
        kl_target=1.0,
        kl_statistic="k3",
        max_steps=2,
        per_device_train_batch_size=16,
        rollout_forward_batch_size=16,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kl/value" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["kl/value"] == pytest.approx(log["kl/k3"], rel=1e-6, abs=1e-9)
        assert log["objective/non_score_reward"] == pytest.approx(-log["kl/coef"] * log["kl/k1"], rel=1e-4, abs=1e-7)


def _statistic_trainer(tiny_path, tmp_path, prompts, **overrides) -> KLPPOTrainer:
    args = _config(
        tmp_path,
        kl_target=2.0,
        per_device_train_batch_size=len(prompts),
        rollout_forward_batch_size=2,
        response_length=6,
        temperature=0.7,
        critic="shared",
        stop_token="eos",
        seed=0,
        num_sample_generations=0,
        **overrides,
    )
    trainer = KLPPOTrainer(
        model=tiny_path,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
    )
    with torch.no_grad():
        head = trainer.accelerator.unwrap_model(trainer.model).policy.get_output_embeddings().weight
        head.add_(0.3 * torch.randn_like(head, generator=torch.Generator().manual_seed(0)))
    return trainer


PROMPTS = ["The day was", "My friend said", "A letter came", "The food tasted", "Our team lost", "It rained"]


@pytest.mark.parametrize("max_mb", [1024.0, 0.0])
def test_the_statistic_from_generation_logits_equals_a_scoring_pass(tiny_path, tmp_path, max_mb):
    """`full` reads the generation's logits when they fit in `generation_logits_max_mb` (else a scoring pass
    computes them): either way the statistic per token, the old log-probs and the shared critic's values equal
    what forward passes over the finished sequences give."""
    trainer = _statistic_trainer(tiny_path, tmp_path, PROMPTS, generation_logits_max_mb=max_mb)
    torch.manual_seed(1)
    timings = {}
    rollout = trainer.rollout(trainer.prompt_batch(PROMPTS), timings=timings)
    assert ("time/score_policy" in timings) == (max_mb == 0)  # a policy forward only when the logits do not fit
    scored = trainer.score(rollout.sequences())
    mask = rollout.response_mask.bool()
    assert rollout.statistic_kl is not None and float(rollout.statistic_kl[mask].sum()) > 0
    for name in ("statistic_kl", "logp", "values"):
        torch.testing.assert_close(getattr(rollout, name)[mask], getattr(scored, name)[mask], rtol=1e-4, atol=1e-4)


def test_one_generate_call_per_rollout_even_when_it_stops_early(tiny_path, tmp_path):
    """The whole rollout is generated in one `generate` call, whatever the scoring chunk (`rollout_forward_batch_size`
    2 for 4 sequences here), and generation stops when every sequence has met the stop token: here after 3 tokens
    (its last token replaced by the stop token). The responses are then 3 tokens wide, and the statistic read from
    the generation's logits equals a scoring pass's, chunk by chunk."""
    trainer = _statistic_trainer(tiny_path, tmp_path, PROMPTS[:4])
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    generate, calls = policy.generate, []

    def stop_early(*args, **kwargs):
        kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
        kwargs["generation_config"].max_new_tokens = 3
        kwargs["generation_config"].min_new_tokens = None
        out = generate(*args, **kwargs)
        out[:, -1] = trainer.sampler.stop_token_id
        calls.append(kwargs["input_ids"].shape[0])
        return out

    policy.generate = stop_early
    torch.manual_seed(1)
    rollout = trainer.rollout(trainer.prompt_batch(PROMPTS[:4]))
    del policy.generate
    assert calls == [4] and rollout.responses.shape[1] == 3
    mask = rollout.response_mask.bool()
    assert mask.all()
    scored = trainer.score(rollout.sequences())
    torch.testing.assert_close(rollout.statistic_kl[mask], scored.statistic_kl[mask], rtol=1e-4, atol=1e-4)
    assert float(rollout.statistic_kl.sum()) > 0
