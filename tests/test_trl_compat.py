"""TRL 1.12's PPO API on klppo: `PPOConfig` / `PPOTrainer`, TRL-shaped scripts (the examples), pre-tokenized
prompts, token-id reward models, a trained adapter's reference, and the critic saved beside the policy."""

from __future__ import annotations

import math
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
from klppo.ppo.rollout import collate_prompts
from klppo.ppo.value import CriticModel
from klppo.rewards import RewardModelFunction, load_reward_funcs
from klppo.trl_compat import TRL_METRIC_NAMES

ROOT = Path(__file__).resolve().parents[1]

# every field of TRL 1.12's `trl.experimental.ppo.PPOConfig` (its own and the defaults it overrode), plus the
# older `exp_name`
TRL_112_FIELDS = {
    "dataset_num_proc": 2, "num_mini_batches": 1, "total_episodes": 8, "local_rollout_forward_batch_size": 4,
    "num_sample_generations": 0, "response_length": 6, "stop_token": "eos", "stop_token_id": None,
    "temperature": 0.7, "missing_eos_penalty": 1.0, "sft_model_path": "a/b", "world_size": None,
    "num_total_batches": None, "micro_batch_size": None, "local_batch_size": None, "batch_size": None,
    "local_mini_batch_size": None, "mini_batch_size": None, "push_to_hub": False, "reward_model_path": "c/d",
    "model_adapter_name": None, "ref_adapter_name": None, "num_ppo_epochs": 1, "whiten_rewards": False,
    "kl_coef": 0.05, "kl_estimator": "k3", "cliprange": 0.2, "vf_coef": 0.1, "cliprange_value": 0.2, "gamma": 1.0,
    "lam": 0.95, "ds3_gather_for_generation": True, "learning_rate": 3e-6, "logging_steps": 10,
    "gradient_checkpointing": False, "bf16": False, "lr_scheduler_kwargs": None, "use_liger_kernel": False,
    "torch_empty_cache_steps": None, "exp_name": "my-run",
}  # fmt: skip
TRL_METRICS = [
    "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
    "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
    "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "episode",
]  # fmt: skip


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
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                num_ppo_epochs=1, response_length=6, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                disable_tqdm=True, use_cpu=True, num_sample_generations=0)  # fmt: skip
    args.update(overrides)
    return args


def run_script(script: str, tmp_path, monkeypatch, *flags: str):
    """Run an example as `python <script> <flags>` in this process; returns its globals (`trainer` included)."""
    common = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_cpu", "true", "--disable_tqdm",
              "true", "--logging_steps", "1", "--num_ppo_epochs", "1", "--response_length", "6", "--seed", "0",
              "--per_device_eval_batch_size", "2"]  # fmt: skip
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
    assert (args.learning_rate, args.logging_steps, args.stop_token, args.rollout_forward_batch_size) == (3e-6, 10, None, 64)
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
    small = PPOConfig(**base_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2))
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
        "ppo.py", tmp_path, monkeypatch, "--dataset_name", "klppo:offline-prompts",
        "--model_name_or_path", tiny_path, "--sft_model_path", tiny_path, "--reward_model_path", reward_model_path,
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--num_mini_batches", "2",
        "--total_episodes", "20", "--local_rollout_forward_batch_size", "4", "--missing_eos_penalty", "1.0",
        "--stop_token", "eos",
    )  # fmt: skip
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
    assert not torch.equal(saved.state_dict()["lm_head.weight"], load_causal_lm(tiny_path).state_dict()["lm_head.weight"])
    table = trainer.generate_completions(sampling=True)
    assert list(table.columns) == ["query", "model response", "score"] and len(table) == 2


def test_tldr_example_runs_offline(tiny_path, reward_model_path, tmp_path, monkeypatch):
    out = run_script(
        "ppo_tldr.py", tmp_path, monkeypatch, "--dataset_name", "klppo:tldr", "--dataset_test_split", "validation",
        "--model_name_or_path", tiny_path, "--sft_model_path", tiny_path, "--reward_model_path", reward_model_path,
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--total_episodes", "4",
        "--stop_token", "eos", "--missing_eos_penalty", "1.0", "--eval_strategy", "steps", "--eval_steps", "1",
        "--heldout_eval_texts", "2",
    )  # fmt: skip
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
    trainer = KLPPOTrainer(model=sft, args=args, processing_class=load_tokenizer(tiny_path), reward_funcs=length_reward,
                           train_dataset=prompts)  # fmt: skip
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
    trainer = PPOTrainer(args=args, processing_class=load_tokenizer(tiny_path), model=load_causal_lm(tiny_path),
                         reward_model=reward_model_path, value_model=value_model, train_dataset=prompts)  # fmt: skip
    before = {k: v.clone() for k, v in trainer.model.critic.state_dict().items()}
    trainer.train()
    trainer.save_model(str(tmp_path / "run1"))
    trained = trainer.model.critic.state_dict()
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    folder = tmp_path / "run1" / "value_model"
    loaded = CriticModel.from_pretrained(folder)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    # another run starts its critic from it
    again = PPOTrainer(args=PPOConfig(**base_args(tmp_path, total_episodes=4, output_dir=str(tmp_path / "run2"))),
                       processing_class=load_tokenizer(tiny_path), model=load_causal_lm(tiny_path),
                       reward_model=reward_model_path, value_model=str(folder), train_dataset=prompts)  # fmt: skip
    assert all(torch.equal(v, trained[k]) for k, v in again.model.critic.state_dict().items())


def test_trainer_refuses_trl_misuse(tiny_path, reward_model_path, tmp_path):
    prompts = Dataset.from_dict({"prompt": ["The day was"] * 4})
    policy = load_causal_lm(tiny_path)
    common = dict(args=PPOConfig(**base_args(tmp_path)), processing_class=load_tokenizer(tiny_path),
                  reward_model=reward_model_path, train_dataset=prompts)  # fmt: skip
    with pytest.raises(ValueError, match="cannot be the same object"):
        PPOTrainer(model=policy, ref_model=policy, **common)
    with pytest.raises(ValueError, match="data_collator"):
        PPOTrainer(model=policy, data_collator=lambda rows: rows, **common)
    with pytest.raises(ValueError, match="model_adapter_name"):
        PPOTrainer(model=policy, **{**common, "args": PPOConfig(**base_args(tmp_path, model_adapter_name="sft"))})
