"""TRL 1.12's PPO API on klppo: `PPOConfig` / `PPOTrainer`, TRL-shaped scripts (the examples), every PPO command
line TRL 1.12 documents, pre-tokenized prompts, token-id reward models, a trained adapter's reference, and the critic
saved beside the policy."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from klppo import KLPPOConfig, KLPPOTrainer, PPOConfig, PPOTrainer
from klppo.models import TINY_MODEL, load_causal_lm, load_tokenizer, resolve_model_path
from klppo.ppo.actor_critic import CriticModel
from klppo.ppo.prompts import collate_prompts
from klppo.rewards import RewardModelFunction, load_reward_funcs
from klppo.trl_compat import TRL_METRIC_NAMES

ROOT = Path(__file__).resolve().parents[1]

# every field of TRL 1.12's `trl.experimental.ppo.PPOConfig` (its own and the defaults it overrode), plus the
# older `exp_name`
TRL_112_FIELDS = {
    "dataset_num_proc": 2,
    "num_mini_batches": 1,
    "total_episodes": 8,
    "local_rollout_forward_batch_size": 4,
    "num_sample_generations": 0,
    "response_length": 6,
    "stop_token": "eos",
    "stop_token_id": None,
    "temperature": 0.7,
    "missing_eos_penalty": 1.0,
    "sft_model_path": "a/b",
    "world_size": None,
    "num_total_batches": None,
    "micro_batch_size": None,
    "local_batch_size": None,
    "batch_size": None,
    "local_mini_batch_size": None,
    "mini_batch_size": None,
    "push_to_hub": False,
    "reward_model_path": "c/d",
    "model_adapter_name": None,
    "ref_adapter_name": None,
    "num_ppo_epochs": 1,
    "whiten_rewards": False,
    "kl_coef": 0.05,
    "kl_estimator": "k3",
    "cliprange": 0.2,
    "vf_coef": 0.1,
    "cliprange_value": 0.2,
    "gamma": 1.0,
    "lam": 0.95,
    "ds3_gather_for_generation": True,
    "learning_rate": 3e-6,
    "logging_steps": 10,
    "gradient_checkpointing": False,
    "bf16": False,
    "lr_scheduler_kwargs": None,
    "use_liger_kernel": False,
    "torch_empty_cache_steps": None,
    "exp_name": "my-run",
}
TRL_METRICS = [
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "episode",
]


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


@pytest.fixture(scope="module")
def reward_model_path(tiny_reward_model_path):
    """TRL's `reward_model_path`: a one-output sequence classifier with the tiny tokenizer."""
    return str(tiny_reward_model_path)


def base_args(tmp_path, **overrides) -> dict:
    args = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_ppo_epochs=1,
        response_length=6,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
    )
    args.update(overrides)
    return args


def run_script(script: str, tmp_path, monkeypatch, *flags: str):
    """Run an example as `python <script> <flags>` in this process; returns its globals (`trainer` included)."""
    common = [
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
        "--num_ppo_epochs",
        "1",
        "--response_length",
        "6",
        "--seed",
        "0",
        "--per_device_eval_batch_size",
        "2",
    ]
    monkeypatch.setattr(sys, "argv", [script, *common, *flags])
    return runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")


# ---------------------------------------------------------------------------------------------------- config
def test_ppo_config_accepts_every_trl_112_field(tmp_path):
    args = PPOConfig(**base_args(tmp_path, **TRL_112_FIELDS))
    assert args.rollout_forward_batch_size == 4  # klppo's name of local_rollout_forward_batch_size
    assert args.kl_estimator == "k3" and args.kl_controller == "fixed" and args.kl_mode == "reward"
    assert args.run_name.startswith("my-run__0__")
    # TRL's batch convention: rollout per process = per_device * gradient_accumulation_steps = 4
    assert (args.local_batch_size, args.batch_size, args.world_size, args.micro_batch_size) == (4, 4, 1, 2)
    assert args.local_rollout_batch_size == 4 and args.num_updates(dataset_size=100, world_size=1) == 2


def test_ppo_config_keeps_trl_defaults(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (args.learning_rate, args.logging_steps, args.stop_token, args.rollout_forward_batch_size) == (
        3e-6,
        10,
        None,
        64,
    )
    assert args.sft_model_path == args.reward_model_path == "EleutherAI/pythia-160m"
    assert args.bf16 is False  # TRL's bf16 default applies on a GPU only


def test_ppo_config_mini_batches_follow_trl(tmp_path):
    # TRL: rollout per process 2 * 4 = 8, two mini-batches of 4, micro-batches of 2
    args = PPOConfig(**base_args(tmp_path, gradient_accumulation_steps=4, num_mini_batches=2, total_episodes=20))
    assert (args.local_rollout_batch_size, args.local_mini_batch_size, args.gradient_accumulation_steps) == (8, 4, 2)
    assert args.num_updates(dataset_size=1000, world_size=1) == 3  # ceil(20 / 8)
    assert args.num_updates(dataset_size=1000, world_size=2) == 2  # ceil(20 / 16)
    import dataclasses

    again = dataclasses.replace(args)  # converting a converted config changes nothing
    assert (again.local_rollout_batch_size, again.gradient_accumulation_steps) == (8, 2)
    # a mini-batch smaller than a micro-batch: micro-batches of the mini-batch's size
    small = PPOConfig(
        **base_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2)
    )
    assert (small.local_rollout_batch_size, small.per_device_train_batch_size) == (4, 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(ds3_gather_for_generation=False), "always gathers"),
        (dict(stop_token="eos", stop_token_id=3), "mutually exclusive"),
        (dict(total_episodes=10, max_steps=2), "set one of them"),
        (dict(total_episodes=0), "must be >= 1"),
        (dict(gradient_accumulation_steps=1, num_mini_batches=4), "not a multiple of num_mini_batches"),
        (dict(gradient_accumulation_steps=3, num_mini_batches=2), "does not split into micro-batches"),
        (dict(local_rollout_forward_batch_size=8, rollout_forward_batch_size=4), "Set only one of them"),
        (dict(kl_estimator="k9"), "kl_estimator"),
    ],
)
def test_ppo_config_refuses_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**base_args(tmp_path, **overrides))


def test_trl_flags_without_stop_token_parse_with_trl_meaning(tmp_path, caplog, monkeypatch):
    """TRL's `ppo.py` command gives `--missing_eos_penalty 1.0` and no `--stop_token`: the script's parser accepts
    it (TRL 1.12 did), with one warning that says what happens, and the run samples EOS (nothing suppressed)."""
    from transformers import HfArgumentParser
    from trl import ModelConfig, ScriptArguments

    from klppo.ppo import config as config_module
    from klppo.ppo.generation.sampling import sampling_setup

    monkeypatch.setattr(config_module, "_WARNED", set())
    flags = [
        "--dataset_name",
        "d",
        "--output_dir",
        str(tmp_path),
        "--per_device_train_batch_size",
        "64",
        "--gradient_accumulation_steps",
        "1",
        "--total_episodes",
        "10000",
        "--missing_eos_penalty",
        "1.0",
    ]
    with caplog.at_level("WARNING"):
        _, args, _ = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig)).parse_args_into_dataclasses(flags)
    assert (args.stop_token, args.stop_token_id, args.missing_eos_penalty) == (None, None, 1.0)
    warned = [r.getMessage() for r in caplog.records if "missing_eos_penalty=1.0" in r.getMessage()]
    assert len(warned) == 1 and "contains no EOS token anywhere has 1.0 subtracted" in warned[0]
    stop_token_id, suppressed, generation_config = sampling_setup(args, load_tokenizer(resolve_model_path(TINY_MODEL)))
    assert stop_token_id is None and suppressed is None and generation_config.eos_token_id == []


def test_trl_flags_klppo_treats_otherwise_warn_once(tmp_path, caplog, monkeypatch):
    """`local_rollout_forward_batch_size` below the rollout batch (klppo generates the whole batch at once) and
    `eval_strategy` (klppo evaluates, TRL did not): one warning each, however often the config is built."""
    from klppo.ppo import config as config_module

    monkeypatch.setattr(config_module, "_WARNED", set())
    overrides = dict(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=16,
        local_rollout_forward_batch_size=1,
        eval_strategy="steps",
        eval_steps=100,
    )
    with caplog.at_level("WARNING"):
        PPOConfig(**base_args(tmp_path))  # TRL's defaults: nothing to say
        assert not caplog.records
        for _ in range(2):
            PPOConfig(**base_args(tmp_path, **overrides))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "whole rollout batch of a process (16 sequences) in one generate call" in messages[0]
    assert "evaluates every eval_steps=100 updates" in messages[1] and "evaluated nothing" in messages[1]


def test_migration_guide_covers_every_trl_field():
    guide = (ROOT / "docs" / "migrating_from_trl.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", guide, flags=re.M))
    assert set(TRL_112_FIELDS) <= rows, sorted(set(TRL_112_FIELDS) - rows)
    for field_name in rows:  # every row names a field that PPOConfig accepts
        assert hasattr(PPOConfig(output_dir="x", use_cpu=True), field_name), field_name


# ---------------------------------------------------------------------------------------------------- a TRL script
def test_trl_shaped_script_runs_with_the_import_changed(tiny_path, reward_model_path, tmp_path, monkeypatch):
    """examples/ppo.py is TRL 1.12's ppo.py with `from klppo import PPOConfig, PPOTrainer`: TRL's flags, models from
    `sft_model_path` / `reward_model_path`, an `input_ids` dataset, `[PAD]` added to the tokenizer."""
    source = (ROOT / "examples" / "ppo.py").read_text()
    assert "from klppo import PPOConfig, PPOTrainer" in source and "trl.experimental" not in source.split('"""')[-1]
    out = run_script(
        "ppo.py",
        tmp_path,
        monkeypatch,
        "--dataset_name",
        "klppo:offline-prompts",
        "--model_name_or_path",
        tiny_path,
        "--sft_model_path",
        tiny_path,
        "--reward_model_path",
        reward_model_path,
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--num_mini_batches",
        "2",
        "--total_episodes",
        "20",
        "--local_rollout_forward_batch_size",
        "4",
        "--missing_eos_penalty",
        "1.0",
        "--stop_token",
        "eos",
    )
    trainer = out["trainer"]
    assert isinstance(trainer, PPOTrainer) and isinstance(trainer.args, PPOConfig)
    updates = [h for h in trainer.state.log_history if "objective/kl" in h]
    assert len(updates) == math.ceil(20 / 8) == trainer.state.global_step == trainer.args.num_total_batches
    for name in TRL_METRICS + ["kl/k1", "kl/k2", "kl/k3", "kl/coef", "kl/value"]:
        assert all(name in h and math.isfinite(h[name]) for h in updates), name
    for klppo_name in TRL_METRIC_NAMES:  # one figure, one name
        assert not any(klppo_name in h for h in trainer.state.log_history), klppo_name
    assert [h["episode"] for h in updates] == [8, 16, 24]
    # the reward model scored the policy's token ids (it shares the tokenizer, as in TRL)
    assert trainer.reward_funcs[0].token_ids
    # the saved policy loads with from_pretrained and is the trained one
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    trained = trainer.model.policy.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in saved.state_dict().items())
    assert not torch.equal(
        saved.state_dict()["lm_head.weight"], load_causal_lm(tiny_path).state_dict()["lm_head.weight"]
    )
    table = trainer.generate_completions(sampling=True)
    assert list(table.columns) == ["query", "model response", "score"] and len(table) == 2


def test_tldr_example_runs_offline(tiny_path, reward_model_path, tmp_path, monkeypatch):
    out = run_script(
        "ppo_tldr.py",
        tmp_path,
        monkeypatch,
        "--dataset_name",
        "klppo:tldr",
        "--dataset_test_split",
        "validation",
        "--model_name_or_path",
        tiny_path,
        "--sft_model_path",
        tiny_path,
        "--reward_model_path",
        reward_model_path,
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--total_episodes",
        "4",
        "--stop_token",
        "eos",
        "--missing_eos_penalty",
        "1.0",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "1",
        "--heldout_eval_texts",
        "2",
    )
    trainer = out["trainer"]
    assert trainer.state.global_step == 1
    assert any("eval/scores" in h for h in trainer.state.log_history)
    assert (tmp_path / "out" / "value_model" / "value_head.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------- pieces
def test_pretokenized_prompts_are_collated_as_they_are():
    tokenizer = load_tokenizer(resolve_model_path(TINY_MODEL))
    ids = [tokenizer("The day was")["input_ids"], tokenizer("A letter came from far away")["input_ids"]]
    batch = collate_prompts([{"input_ids": ids[0], "lengths": 3}, {"input_ids": ids[1], "lengths": 6}], tokenizer, 256)
    width = max(map(len, ids))
    assert batch.input_ids[0].tolist() == [tokenizer.pad_token_id] * (width - len(ids[0])) + ids[0]
    assert batch.input_ids[1].tolist() == ids[1] and batch.attention_mask[0].sum() == len(ids[0])
    assert batch.prompts == ["The day was", "A letter came from far away"]
    assert batch.extra == {"lengths": [3, 6]}  # other columns reach the reward functions


def test_reward_model_sharing_the_vocabulary_scores_token_ids(reward_model_path, tiny_path):
    policy_tokenizer = load_tokenizer(tiny_path)
    (rm,), _ = load_reward_funcs(reward_model_path, policy_tokenizer=policy_tokenizer, batch_size=2)
    assert rm.token_ids
    prompts, completions = ["The day was", "My friend said"], [" sunny and warm", " hello to me"]
    prompt_ids = [policy_tokenizer(p)["input_ids"] for p in prompts]
    completion_ids = [policy_tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    text_scores = RewardModelFunction(reward_model_path)(prompts, completions)
    rm.tokenizer = None  # the id path neither decodes nor re-encodes
    id_scores = rm(prompts, completions, completion_ids=completion_ids, prompt_ids=prompt_ids)
    assert id_scores == pytest.approx(text_scores, abs=1e-5)
    # padding inside a batch does not change a score
    assert [rm.score_ids([p + c])[0] for p, c in zip(prompt_ids, completion_ids)] == pytest.approx(id_scores, abs=1e-5)
    with pytest.raises(ValueError, match="prompt_ids"):
        rm(prompts, completions, completion_ids=completion_ids)
    # another vocabulary: the text is re-tokenized with the reward model's own tokenizer
    other = load_tokenizer(tiny_path)
    other.add_tokens(["<extra>"])
    (rm_text,), _ = load_reward_funcs(reward_model_path, policy_tokenizer=other)
    assert not rm_text.token_ids


def test_pretrained_adapter_reference_is_a_frozen_copy_of_it(tiny_path, tmp_path):
    """A policy with a trained adapter (non-zero LoRA B): its reference is that adapter, so the KL at the first
    update is ~0; the base model (adapter disabled) would be far from it."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    sft = peft.get_peft_model(load_causal_lm(tiny_path), lora)
    start = {n: p.detach().clone() for n, p in sft.named_parameters() if "lora" in n}
    prompts = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 2})
    args = KLPPOConfig(**base_args(tmp_path, max_steps=1, learning_rate=1e-2, critic="shared"))
    trainer = KLPPOTrainer(
        model=sft,
        args=args,
        processing_class=load_tokenizer(tiny_path),
        reward_funcs=length_reward,
        train_dataset=prompts,
    )
    assert trainer.use_adapter_reference and trainer.ref_adapter_name == "ref"
    batch = trainer.prompt_batch(prompts["prompt"][:4])
    rollout = trainer.rollout(batch)
    torch.testing.assert_close(rollout.logp, rollout.ref_logp, rtol=1e-5, atol=1e-5)
    trainer.scorer.ref_adapter = None  # the wrong reference (the base model) is measurably different
    assert (trainer.score(rollout.sequences()).ref_logp - rollout.logp).abs().max() > 1e-2
    trainer.scorer.ref_adapter = "ref"
    trainer.train()
    assert abs(trainer.state.log_history[0]["kl/k1"]) < 1e-5
    trained = dict(trainer.model.policy.named_parameters())
    for name, before in start.items():  # the copy stayed, the adapter moved
        assert torch.equal(trained[name.replace(".default.", ".ref.")], before)
        assert not trained[name.replace(".default.", ".ref.")].requires_grad
    assert any(not torch.equal(trained[n], before) for n, before in start.items())
    trainer.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "saved" / "ref").exists()  # only the trained adapter is saved
    reloaded = peft.PeftModel.from_pretrained(load_causal_lm(tiny_path), str(tmp_path / "saved"))
    assert torch.equal(dict(reloaded.named_parameters())[next(iter(start))], trained[next(iter(start))])


def test_critic_is_saved_beside_the_policy_and_reloads(tiny_path, reward_model_path, tmp_path):
    prompts = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 2})
    args = PPOConfig(**base_args(tmp_path, total_episodes=4, learning_rate=1e-2))
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1)
    trainer = PPOTrainer(
        args=args,
        processing_class=load_tokenizer(tiny_path),
        model=load_causal_lm(tiny_path),
        reward_model=reward_model_path,
        value_model=value_model,
        train_dataset=prompts,
    )
    before = {k: v.clone() for k, v in trainer.model.critic.state_dict().items()}
    trainer.train()
    trainer.save_model(str(tmp_path / "run1"))
    trained = trainer.model.critic.state_dict()
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    folder = tmp_path / "run1" / "value_model"
    loaded = CriticModel.from_pretrained(folder)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    # another run starts its critic from it
    again = PPOTrainer(
        args=PPOConfig(**base_args(tmp_path, total_episodes=4, output_dir=str(tmp_path / "run2"))),
        processing_class=load_tokenizer(tiny_path),
        model=load_causal_lm(tiny_path),
        reward_model=reward_model_path,
        value_model=str(folder),
        train_dataset=prompts,
    )
    assert all(torch.equal(v, trained[k]) for k, v in again.model.critic.state_dict().items())


def test_generate_completions_without_stop_token_runs_past_eos(tiny_path, reward_model_path, tmp_path):
    """`generate_completions` decodes as the rollout samples: with `missing_eos_penalty` and no stop token, EOS
    ends no response. The policy makes EOS the greedy choice at every step: each response is EOS throughout."""
    from test_trainer import policy_favouring_eos

    prompts = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"]})
    args = PPOConfig(**base_args(tmp_path, total_episodes=4, missing_eos_penalty=1.0, per_device_eval_batch_size=2))
    tokenizer = load_tokenizer(tiny_path)
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy_favouring_eos(tiny_path, 50.0),
        reward_model=reward_model_path,
        train_dataset=prompts,
        eval_dataset=prompts,
    )
    seen, compute_rewards = [], trainer.compute_rewards
    trainer.compute_rewards = lambda sequences: seen.append(sequences) or compute_rewards(sequences)
    table = trainer.generate_completions()
    assert len(table) == 4
    assert len(seen) == 2 and all(s.response_mask.all() and (s.responses == tokenizer.eos_token_id).all() for s in seen)
    assert all(s.responses.shape[1] == args.response_length for s in seen)


def test_trainer_refuses_trl_misuse(tiny_path, reward_model_path, tmp_path):
    prompts = Dataset.from_dict({"prompt": ["The day was"] * 4})
    policy = load_causal_lm(tiny_path)
    common = dict(
        args=PPOConfig(**base_args(tmp_path)),
        processing_class=load_tokenizer(tiny_path),
        reward_model=reward_model_path,
        train_dataset=prompts,
    )
    with pytest.raises(ValueError, match="cannot be the same object"):
        PPOTrainer(model=policy, ref_model=policy, **common)
    with pytest.raises(ValueError, match="data_collator"):
        PPOTrainer(model=policy, data_collator=lambda rows: rows, **common)
    with pytest.raises(ValueError, match="model_adapter_name"):
        PPOTrainer(model=policy, **{**common, "args": PPOConfig(**base_args(tmp_path, model_adapter_name="sft"))})


# ---------------------------------------------------------------------------------------------------- TRL's commands
# TRL 1.12's documented PPO command lines, as written there (the same text from trl 1.0 on): the two commands of
# docs/source/ppo_trainer.md ("Get started", "Benchmark experiments") and the docstrings at the top of
# examples/scripts/ppo/ppo.py and examples/scripts/ppo/ppo_tldr.py.
TRL_PPO_COMMANDS = {
    "ppo_trainer.md, Get started": r"""
python examples/scripts/ppo/ppo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
    --dataset_train_split descriptiveness \
    --learning_rate 3e-6 \
    --num_ppo_epochs 1 \
    --num_mini_batches 1 \
    --output_dir models/minimal/ppo \
    --per_device_train_batch_size 64 \
    --gradient_accumulation_steps 1 \
    --total_episodes 10000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path EleutherAI/pythia-1b-deduped \
    --reward_model_path EleutherAI/pythia-1b-deduped \
    --missing_eos_penalty 1.0
""",
    "ppo.py": r"""
python -i examples/scripts/ppo/ppo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
    --dataset_train_split descriptiveness \
    --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo \
    --per_device_train_batch_size 64 \
    --gradient_accumulation_steps 1 \
    --total_episodes 10000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --missing_eos_penalty 1.0
""",
    "ppo.py, ZeRO-3": r"""
accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml \
    examples/scripts/ppo/ppo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
    --dataset_train_split descriptiveness \
    --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo \
    --num_ppo_epochs 1 \
    --num_mini_batches 1 \
    --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 16 \
    --total_episodes 10000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path EleutherAI/pythia-1b-deduped \
    --reward_model_path EleutherAI/pythia-1b-deduped \
    --local_rollout_forward_batch_size 1 \
    --missing_eos_penalty 1.0
""",
    "ppo_tldr.py": r"""
python examples/scripts/ppo/ppo_tldr.py \
    --dataset_name trl-lib/tldr \
    --dataset_test_split validation \
    --output_dir pythia-1b-deduped-tldr-preference-sft-trl-style-ppo \
    --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 64 \
    --total_episodes 30000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
    --missing_eos_penalty 1.0 \
    --stop_token eos \
    --response_length 53 \
    --eval_strategy steps \
    --eval_steps 100
""",
    "ppo_tldr.py, ZeRO-2": r"""
accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml \
    examples/scripts/ppo/ppo_tldr.py \
    --dataset_name trl-lib/tldr \
    --dataset_test_split validation \
    --output_dir pythia-1b-deduped-tldr-preference-sft-trl-style-ppo \
    --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 4 \
    --total_episodes 1000000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
    --local_rollout_forward_batch_size 16 \
    --missing_eos_penalty 1.0 \
    --stop_token eos \
    --eval_strategy steps \
    --eval_steps 100
""",
    "ppo_trainer.md, Benchmark experiments": r"""
accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml \
    examples/scripts/ppo/ppo_tldr.py \
    --dataset_name trl-lib/tldr \
    --dataset_test_split validation \
    --output_dir models/minimal/ppo_tldr \
    --learning_rate 3e-6 \
    --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 4 \
    --total_episodes 1000000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
    --local_rollout_forward_batch_size 16 \
    --missing_eos_penalty 1.0 \
    --stop_token eos \
    --eval_strategy steps \
    --eval_steps 100
""",
}
# The substitutions: no hub here, so the hub's ids become the offline tiny ones; TRL's paths become klppo's
RUNNER = str(ROOT / "tests" / "trl_script_runner.py")  # runs the script unchanged and records each update's figures
ID_SUBSTITUTIONS = {
    "examples/scripts/ppo/ppo.py": str(ROOT / "examples" / "ppo.py"),
    "examples/scripts/ppo/ppo_tldr.py": str(ROOT / "examples" / "ppo_tldr.py"),
    "trl-internal-testing/descriptiveness-sentiment-trl-style": "klppo:offline-prompts",
    "trl-lib/tldr": "klppo:tldr",  # summarization prompts made offline
    "EleutherAI/pythia-1b-deduped": TINY_MODEL,  # the policy, and in ppo.py the reward model with a fresh head
    "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": TINY_MODEL,
    "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": "<tiny reward model>",  # a one-output classifier
    "examples/accelerate_configs/deepspeed_zero3.yaml": "<ZeRO-3 on 2 CPU ranks>",  # the shipped CPU config
    "examples/accelerate_configs/deepspeed_zero2.yaml": "<ZeRO-2 on 2 CPU ranks>",  # the same with stage 2
}
# PPOConfig's defaults of the two paths (TRL's: EleutherAI/pythia-160m), replaced where a command leaves them unset
DEFAULT_PATH_FLAGS = {"--sft_model_path": TINY_MODEL, "--reward_model_path": TINY_MODEL}
# documented commands that run exactly as another one does: the same launcher, accelerate config and script, and
# flags that TRL's parser reads into the same arguments but for the output folder ("Benchmark experiments" is the
# ZeRO-2 command of ppo_tldr.py with `--learning_rate` set to its default). Checked below; the other one's run covers
# them.
RUNS_AS = {"ppo_trainer.md, Benchmark experiments": "ppo_tldr.py, ZeRO-2"}
UPDATES = 1  # `--total_episodes` appended last (the parser reads the last value): this many PPO updates
NO_STOP_WARNING = "is taken as TRL 1.12 took it"


def trl_command(name: str, tmp_path, reward_model: str) -> tuple[list[str], dict[str, str]]:
    """TRL's command line `name` with the substitutions above: `(argv, the script's flags as it reads them)`."""
    import shlex

    from test_trainer_distributed import free_port

    words = shlex.split(TRL_PPO_COMMANDS[name].replace("\\\n", " "))
    local = {"<tiny reward model>": reward_model}
    for stage in (2, 3):
        if f"deepspeed_zero{stage}.yaml" in TRL_PPO_COMMANDS[name]:
            from test_deepspeed import accelerate_config

            local[f"<ZeRO-{stage} on 2 CPU ranks>"] = accelerate_config(tmp_path, stage)
    words = [ID_SUBSTITUTIONS.get(w, w) for w in words]
    words = [local.get(w, w) for w in words]
    if words[:2] == ["python", "-i"]:  # `-i` only opens an interpreter prompt once the script is done
        words = ["python", *words[2:]]
    if words[0] == "python":
        argv, script_at = [sys.executable, RUNNER], 1
    else:  # accelerate launch --config_file <config>
        assert words[:3] == ["accelerate", "launch", "--config_file"], words
        argv = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            words[3],
            "--main_process_port",
            str(free_port()),
            RUNNER,
        ]
        script_at = 4
    script_flags = words[script_at + 1 :]
    flags = dict(zip(script_flags[::2], script_flags[1::2]))
    for flag, value in DEFAULT_PATH_FLAGS.items():
        if flag not in flags:
            script_flags += [flag, value]
    ranks = 1 if words[0] == "python" else 2
    episodes = (
        UPDATES * int(flags["--per_device_train_batch_size"]) * int(flags["--gradient_accumulation_steps"]) * ranks
    )
    script_flags += ["--total_episodes", str(episodes)]
    flags = dict(zip(script_flags[::2], script_flags[1::2]))  # the last value of each flag, as the parser keeps it
    return [*argv, words[script_at], *script_flags], flags


@pytest.mark.parametrize("name, runs_as", RUNS_AS.items())
def test_a_documented_command_not_run_reads_as_the_one_run(name, runs_as, tmp_path):
    """`RUNS_AS`: the command launches the same way (the port aside) and the same script, and TRL's parser reads its
    flags into the same `ScriptArguments`, `PPOConfig` and `ModelConfig` as the command that runs, `output_dir` aside
    (where the two write)."""
    from transformers import HfArgumentParser
    from trl import ModelConfig, ScriptArguments

    def read(command):
        argv, _ = trl_command(command, tmp_path, "<reward model>")
        at = argv.index(RUNNER)
        launch = [w for i, w in enumerate(argv[:at]) if "--main_process_port" not in argv[i - 1 : i + 1]]
        parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
        parsed = [
            {f.name: getattr(a, f.name) for f in dataclasses.fields(a)}
            for a in parser.parse_args_into_dataclasses(args=argv[at + 2 :])
        ]
        return launch, argv[at + 1], parsed

    (launch, script, parsed), (launch_run, script_run, parsed_run) = read(name), read(runs_as)
    assert (launch, script) == (launch_run, script_run)
    assert parsed[1].pop("output_dir") != parsed_run[1].pop("output_dir")
    assert parsed == parsed_run


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.ranks] if command.lstrip().startswith("accelerate launch") else [])
        for name, command in TRL_PPO_COMMANDS.items()
        if name not in RUNS_AS
    ],
)
def test_trl_112_documented_command_runs(name, tiny_path, reward_model_path, tmp_path, monkeypatch):
    """Each PPO command line TRL 1.12 documents (but those of `RUNS_AS`) runs with its flags unchanged, through
    klppo's TRL-shaped examples (only the import differs), on the offline tiny models: the hub's ids, TRL's script and config paths
    are substituted (`ID_SUBSTITUTIONS`), PPOConfig's default hub ids of `sft_model_path` / `reward_model_path` are
    replaced by flags where a command leaves them unset, `python -i` runs as `python`, and `--total_episodes` is
    appended last, as a user would, for `UPDATES` updates instead of thousands. The ZeRO-3 and ZeRO-2 commands run
    under DeepSpeed on 2 CPU ranks.

    Checks: exit 0; the updates ran, with the batch sizes, epochs and learning rate the flags give in TRL; every
    response without EOS, and only those, lost `missing_eos_penalty` (the figures: raw reward - score = penalty x
    share without EOS); without a stop token, nothing was suppressed or truncated (every response has
    `response_length` tokens, EOS sampled like any token) and one warning said so; with `--stop_token eos`,
    responses end at EOS and no such warning."""
    from test_trainer_distributed import run

    argv, flags = trl_command(name, tmp_path, reward_model_path)
    record_dir = tmp_path / "record"
    record_dir.mkdir()
    monkeypatch.setenv("KLPPO_RUN_RECORD", str(record_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    _, stderr = run(argv, tmp_path)
    ranks = 2 if "accelerate.commands.launch" in argv else 1
    records = [json.loads((record_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    record, args = records[0], records[0]["args"]
    assert [r["world"] for r in records] == [ranks] * ranks and record["deepspeed"] == (ranks == 2)
    # the updates ran, with TRL's meaning of the flags
    assert record["global_step"] == args["num_total_batches"] == len(record["updates"]) == UPDATES
    local_batch = int(flags["--per_device_train_batch_size"]) * int(flags["--gradient_accumulation_steps"])
    assert (args["local_batch_size"], args["batch_size"]) == (local_batch, local_batch * ranks)
    assert args["num_ppo_epochs"] == int(flags.get("--num_ppo_epochs", 4))
    assert args["num_mini_batches"] == int(flags.get("--num_mini_batches", 1))
    assert args["learning_rate"] == float(flags.get("--learning_rate", 3e-6))
    assert args["response_length"] == int(flags.get("--response_length", 53)) == 53
    assert (tmp_path / flags["--output_dir"] / "config.json").is_file()  # the trained policy was saved
    penalty = float(flags["--missing_eos_penalty"])
    assert args["missing_eos_penalty"] == penalty == 1.0
    (reward,) = record["reward_names"]
    for update in record["updates"]:
        assert all(math.isfinite(update[k]) for k in ("loss/policy", "loss/value", "kl/k1", "objective/scores"))
        # the penalty went to the responses without EOS, and only to them
        missing = 1.0 - update["objective/eos_frac"]
        assert update[f"rewards/{reward}"] - update["objective/scores"] == pytest.approx(penalty * missing, abs=1e-4)
    lengths = [u["objective/response_length"] for u in record["updates"]]
    eos_sampled = sum(u["val/num_eos_tokens"] for u in record["updates"])
    if "--stop_token" in flags:
        assert record["stop_token_id"] == record["eos_token_id"] == record["generation_eos_token_id"]
        for update, length in zip(record["updates"], lengths):  # a response ends early only at EOS
            assert 0 < length <= 53 and (length == 53 or update["objective/eos_frac"] > 0)
        assert NO_STOP_WARNING not in stderr
    else:  # TRL's meaning: EOS sampled like any token, no truncation, responses without EOS penalised
        assert record["stop_token_id"] is None and record["suppressed_ids"] is None
        assert record["generation_eos_token_id"] == []
        # the seeded tiny model samples EOS about once in 1,000 tokens: a few of the responses hold one, and
        # still have all their tokens
        assert eos_sampled > 0 and lengths == [53.0] * UPDATES
        assert stderr.count(NO_STOP_WARNING) == 1, stderr[-3000:]
    # where klppo does something else with a flag than TRL did, one warning says what
    if record["eval_strategy"] == "steps":  # klppo evaluates every eval_steps updates, TRL evaluated nothing
        assert stderr.count("TRL 1.12's PPOTrainer evaluated nothing") == 1
    if int(flags.get("--local_rollout_forward_batch_size", 64)) < local_batch:  # TRL also generated in such chunks
        assert stderr.count("in one generate call") == 1
