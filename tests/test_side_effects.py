"""Building a trainer changes neither the process's environment nor the objects passed in, and what communicates
across ranks is a method that says so."""

from __future__ import annotations

import os

import pytest
from datasets import Dataset

from klppo import KLPPOTrainer
from klppo.models import TINY_MODEL, load_causal_lm, load_tokenizer, resolve_model_path
from klppo.testing import klppo_config

PROMPTS = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 2})


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


def args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=1,
        response_length=4,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
    )
    return klppo_config(**{**base, **overrides})


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    import klppo.ppo.run.callbacks as callbacks

    monkeypatch.setenv("WANDB_MODE", "")  # so that the test's end restores the variable as it was
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setattr(callbacks, "_WANDB_NOTICE_GIVEN", False)
    monkeypatch.chdir(tmp_path)


def test_building_a_trainer_leaves_the_environment_and_the_callers_tokenizer_alone(
    tiny_path, tmp_path, no_wandb_credentials
):
    environment = dict(os.environ)
    tokenizer = load_tokenizer(tiny_path)
    tokenizer.padding_side = "right"
    trainer = KLPPOTrainer(
        model=load_causal_lm(tiny_path),
        processing_class=tokenizer,
        reward_funcs=length_reward,
        args=args(tmp_path, report_to=["wandb"]),
        train_dataset=PROMPTS,
    )
    assert dict(os.environ) == environment  # no WANDB_MODE: wandb, without credentials, is offline only while it starts
    assert tokenizer.padding_side == "right" and trainer.processing_class.padding_side == "left"


def test_the_trl_compatible_trainer_leaves_the_callers_tokenizer_alone(tiny_path, tmp_path):
    """A pad token outside the policy's embeddings (TRL's scripts add `[PAD]`) pads with EOS in the trainer's copy."""
    from klppo import PPOConfig, PPOTrainer

    tokenizer = load_tokenizer(tiny_path)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    pad_id = tokenizer.pad_token_id
    config = PPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        num_sample_generations=0,
    )
    trainer = PPOTrainer(
        config, tokenizer, model=load_causal_lm(tiny_path), reward_funcs=length_reward, train_dataset=PROMPTS
    )
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == pad_id
    assert trainer.processing_class is not tokenizer
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token


def test_the_rollback_decision_is_made_once_and_read_without_communication(tiny_path, tmp_path, monkeypatch):
    """`decide_rollback_on_all_ranks` (a collective, which the constructor calls) decides; `rollback_updates` only
    reads the decision."""
    import klppo.ppo.safety.nonfinite as safety

    calls = []
    reduce = safety.all_reduce_sum
    monkeypatch.setattr(safety, "all_reduce_sum", lambda *a, **k: calls.append(1) or reduce(*a, **k))
    trainer = KLPPOTrainer(model=tiny_path, reward_funcs=length_reward, args=args(tmp_path), train_dataset=PROMPTS)
    assert len(calls) == 1  # the constructor's decision: full fine-tuning, no undo copy
    assert trainer.rollback_updates is False and trainer.rollback_updates is False
    assert trainer.decide_rollback_on_all_ranks() is False
    assert len(calls) == 1


@pytest.mark.slow
def test_a_trainer_from_python_logs_offline_without_credentials_and_restores_the_environment(
    tiny_path, tmp_path, no_wandb_credentials
):
    import wandb

    trainer = KLPPOTrainer(
        model=tiny_path, reward_funcs=length_reward, args=args(tmp_path, report_to=["wandb"]), train_dataset=PROMPTS
    )
    with pytest.warns(UserWarning, match="wandb has no credentials here: logging offline"):
        trainer.train()
    trainer.shutdown()
    assert "WANDB_MODE" not in os.environ and wandb.run is None  # the run ended, and the environment is as it was
