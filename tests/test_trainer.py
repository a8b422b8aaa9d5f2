"""KLPPOTrainer on a tiny random Llama (no hub): parameters move, KL modes, controllers, resume, PEFT."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from datasets import Dataset

from klppo import KLPPOConfig, KLPPOTrainer
from klppo.kl import kl_estimators
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.ppo.results import Advantages
from klppo.ppo.update import kl_loss_baseline
from klppo.testing import klppo_config

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

LOGGED_METRICS = [
    "kl/coef",
    "kl/value",
    "kl/k1",
    "kl/k2",
    "kl/k3",
    "kl/clamped_frac",
    "objective/scores",
    "objective/rlhf_reward",
    "objective/non_score_reward",
    "loss/policy",
    "loss/value",
    "policy/approxkl",
    "policy/clipfrac",
    "policy/entropy",
    "val/clipfrac",
]


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    """Rewards longer completions: a signal the tiny model can follow."""
    return [len(ids) / 8.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


@pytest.fixture(scope="module")
def prompts():
    words = ["The day was", "My friend said", "A letter came", "The food tasted", "Our team lost", "It rained"]
    return Dataset.from_dict({"prompt": [w for w in words for _ in range(4)]})


def make_args(tmp_path, **overrides) -> KLPPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_steps=1,
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
    base.update(overrides)
    return klppo_config(**base)


def make_trainer(tiny_path, prompts, args, **kwargs) -> KLPPOTrainer:
    kwargs.setdefault("reward_funcs", length_reward)
    return KLPPOTrainer(model=tiny_path, args=args, train_dataset=prompts, **kwargs)


def last_log(trainer) -> dict:
    return next(h for h in reversed(trainer.state.log_history) if "kl/coef" in h)


def test_every_trainable_parameter_changes_reference_does_not(tiny_path, prompts, tmp_path):
    args = make_args(tmp_path, kl_mode="both", kl_estimator="k3+", max_steps=2, num_ppo_epochs=2)
    trainer = make_trainer(tiny_path, prompts, args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    ref_before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        if name in before:
            assert not torch.equal(before[name], param), f"{name} did not change"
    for name, param in trainer.ref_model.named_parameters():
        assert torch.equal(ref_before[name], param), f"reference {name} changed"
    log = last_log(trainer)
    for key in LOGGED_METRICS:
        assert key in log and math.isfinite(log[key]), key
    assert log["loss/kl"] > 0.0  # the policy has moved away from the reference by the second update
    assert log["kl/k2"] > 0.0 and log["kl/k3"] > 0.0


def moved_policy_rollout(tiny_path, prompts, args, n: int = 4):
    """A trainer whose policy has moved away from the reference (its LM head perturbed, the same way for every
    call) and a rollout of `n` prompts sampled from it."""
    trainer = make_trainer(tiny_path, prompts, args)
    with torch.no_grad():
        head = trainer.model.policy.get_output_embeddings().weight
        head.add_(0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    return trainer, trainer.rollout(trainer.prompt_batch(prompts["prompt"][:n]))


def kl_loss_term(trainer, rollout, baseline: torch.Tensor | None = None) -> tuple[float, dict]:
    """The loss-mode KL term (coefficient 1) of one micro-batch holding the whole `rollout`, and the gradient
    it puts on the policy's weights. Advantages are 0 and the critic is separate, so the policy's gradient is
    the KL term's alone."""
    n = rollout.batch_size
    advantages = Advantages(
        torch.zeros_like(rollout.values), rollout.values, kl_loss_coef=1.0, kl_loss_baseline=baseline
    )
    counts = dict(num_tokens=rollout.response_mask.sum(), num_seqs=n)
    trainer.model.zero_grad()
    loss, parts, _ = trainer.loss_function()(rollout, advantages, torch.arange(n), counts)
    loss.backward()
    grads = {name: p.grad for name, p in trainer.model.policy.named_parameters() if p.requires_grad}
    return float(parts["loss/kl"][0]), grads


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_a_micro_batch_without_its_padding_columns_gives_the_same_loss_and_gradients(
    tiny_path, prompts, tmp_path, critic
):
    """A micro-batch of short prompts from a rollout padded to a long one: dropping the columns that are padding in
    every row (what the PPO epochs and the scoring chunks do) changes no loss term and no gradient."""
    args = make_args(tmp_path, kl_mode="both", kl_estimator="k2", critic=critic)
    trainer, _ = moved_policy_rollout(tiny_path, prompts, args)
    torch.manual_seed(0)
    long = "It rained all day and all night on the quiet town by the sea"
    rollout = trainer.rollout(trainer.prompt_batch(["The day was", long, "My friend said", "It rained"]))
    short = rollout.select([0, 2, 3])
    trimmed = short.without_padding_columns()
    assert trimmed.query_responses.shape[1] < short.query_responses.shape[1]
    assert (
        trimmed.query_responses.shape[1] - trimmed.context_length
        == short.query_responses.shape[1] - short.context_length
    )
    assert bool(trimmed.attention_mask[:, 0].any()) and trimmed.without_padding_columns() is trimmed
    advantages = Advantages(
        torch.randn(rollout.values.shape, generator=torch.Generator().manual_seed(1)),
        rollout.values + 0.5,
        kl_loss_coef=0.1,
    )
    idx = torch.tensor([0, 2, 3])
    counts = dict(num_tokens=short.response_mask.sum(), num_seqs=3)
    results = []
    for mb in (short, trimmed):
        trainer.model.zero_grad()
        loss, parts, _ = trainer.loss_function()(mb, advantages, idx, counts)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), {k: float(v[0]) for k, v in parts.items()}, grads))
    (loss_a, parts_a, grads_a), (loss_b, parts_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert parts_b == pytest.approx(parts_a, rel=1e-4, abs=1e-6) and "loss/value" in parts_a and "loss/kl" in parts_a
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # scoring in chunks of one sequence (each without its padding columns) gives the whole batch's scores
    whole = trainer.score(rollout.sequences())
    trainer.scorer.chunk = 1
    alone = trainer.score(rollout.sequences())
    for key in ("logp", "ref_logp", "values"):
        torch.testing.assert_close(getattr(alone, key), getattr(whole, key), rtol=1e-4, atol=1e-5, msg=key)


def test_each_estimators_loss_term_is_finite_and_pulls_the_policy(tiny_path, prompts, tmp_path):
    """Every registered estimator in loss mode, away from the reference: the KL term is finite and puts a finite,
    non-zero gradient on the policy (one micro-batch each, on the same rollout)."""
    rollout = None
    for estimator in kl_estimators():
        args = make_args(tmp_path, kl_mode="loss", kl_estimator=estimator, critic="separate")
        trainer, own = moved_policy_rollout(tiny_path, prompts, args)
        rollout = rollout or own  # every trainer's policy is the same: one rollout serves them all
        term, grads = kl_loss_term(trainer, rollout)
        assert math.isfinite(term), estimator
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values() if g is not None))
        assert torch.isfinite(norm) and norm > 0, estimator


def test_the_kl_loss_baseline_is_the_token_mean_of_the_estimators_gradient_coefficient(tiny_path, prompts, tmp_path):
    """`kl_loss_baseline`'s b for a sequence is the token mean, over every OTHER sequence of the rollout, of the
    coefficient g that the estimator puts on `w * grad log pi`: `d` for `k2` and `corrected_k3`, `1 - exp(-d)` for
    `k3`, 1 for `k1` (d the log-ratio); the logged figure is the mean over all sequences."""
    expected = {
        "k2": lambda d: d,
        "corrected_k3": lambda d: d,
        "k3": lambda d: 1 - torch.exp(-d),
        "k1": torch.ones_like,
    }
    rollout = None
    for estimator, g in expected.items():
        args = make_args(
            tmp_path, kl_mode="loss", kl_estimator=estimator, critic="separate", experimental={"kl_loss_baseline": True}
        )
        trainer, own = moved_policy_rollout(tiny_path, prompts, args)
        rollout = rollout or own
        mask = rollout.response_mask.bool()
        d = (rollout.logp - rollout.ref_logp).double()
        per_row, mean = kl_loss_baseline(trainer.kl_plan, rollout, trainer.accelerator)
        assert mean == pytest.approx(float(g(d[mask]).mean()), rel=1e-6, abs=1e-12), estimator
        assert per_row.shape == (rollout.batch_size, 1)
        for i in range(rollout.batch_size):
            others = torch.cat([g(d[j][mask[j]]) for j in range(rollout.batch_size) if j != i])
            assert float(per_row[i, 0]) == pytest.approx(float(others.mean()), rel=1e-6, abs=1e-12), (estimator, i)


def test_with_the_baseline_k1_in_the_loss_puts_no_gradient_on_the_policy(tiny_path, prompts, tmp_path):
    """k1 in the loss has gradient `grad log pi`, whose expectation is 0 (pure noise); its coefficient g is 1, so the
    baseline b is 1 and removes that noise at the sampling policy, up to rounding; the KL term's value is unchanged."""
    args = make_args(tmp_path, kl_mode="loss", kl_estimator="k1", critic="separate")
    trainer, rollout = moved_policy_rollout(tiny_path, prompts, args)
    term, grads = kl_loss_term(trainer, rollout)
    before = max(float(g.abs().max()) for g in grads.values() if g is not None)
    baseline = kl_loss_baseline(trainer.kl_plan, rollout, trainer.accelerator)[0]
    with_baseline, grads = kl_loss_term(trainer, rollout, baseline=baseline)
    after = max(float(g.abs().max()) for g in grads.values() if g is not None)
    assert with_baseline == pytest.approx(term, rel=1e-6)
    # what remains is w - 1: the log-probs read while decoding and a training forward differ by rounding
    assert before > 1e-3 and after < 1e-4 * before, (before, after)


def test_the_loss_coefficient_is_beta_over_the_advantage_std_within_a_floor(tiny_path, prompts, tmp_path):
    """`kl_loss_scale="advantage_std"`: the loss-mode coefficient is beta / s, s the advantages' std. When the
    advantages collapse (every sample scored alike), s falls to the whitening's epsilon (1e-4) and beta / s
    would reach 1e4 beta; s is floored at 0.01, so the coefficient stays within 100 beta."""
    from types import SimpleNamespace

    args = make_args(tmp_path, kl_mode="loss", kl_estimator="k3", gamma=1.0, lam=1.0, whiten_rewards=False)
    trainer = make_trainer(tiny_path, prompts, args)
    mask = torch.ones(4, 3)
    rollout = SimpleNamespace(response_mask=mask, values=torch.zeros(4, 3), log_ratio=torch.zeros(4, 3))
    rewards = SimpleNamespace(scorable=torch.ones(4, dtype=torch.bool))
    scores = torch.zeros(4, 3)
    scores[:, -1] = torch.tensor([1.0, -1.0, 0.5, -0.5])  # advantages: each sequence's score on all its tokens
    spread = trainer.compute_advantages(rollout, rewards, SimpleNamespace(token_rewards=scores, coef=0.1))
    std = float(torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat_interleave(3).std())
    assert spread.metrics["policy/advantage_std"] == pytest.approx(std, rel=1e-6)
    assert spread.kl_loss_coef == pytest.approx(0.1 / std, rel=1e-6)
    collapsed = trainer.compute_advantages(rollout, rewards, SimpleNamespace(token_rewards=torch.zeros(4, 3), coef=0.1))
    assert collapsed.metrics["policy/advantage_std"] == pytest.approx(1e-4)
    assert collapsed.kl_loss_coef == pytest.approx(0.1 / 0.01)


def test_seq_mean_token_sum_norm_divides_by_response_length_not_the_padded_width(tiny_path, prompts, tmp_path):
    """`seq-mean-token-sum-norm` normalises by a constant, `num_seqs * response_length` (Dr. GRPO, verl): the same
    rollout padded with masked columns gives the same KL term."""
    args = make_args(
        tmp_path,
        kl_mode="loss",
        kl_estimator="k1",
        kl_loss_agg_mode="seq-mean-token-sum-norm",
        critic="separate",
        response_length=6,
    )
    trainer, rollout = moved_policy_rollout(tiny_path, prompts, args)
    pad_id = trainer.processing_class.pad_token_id

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, 3), value=value)

    wide = dataclasses.replace(
        rollout,
        responses=pad(rollout.responses, pad_id),
        response_mask=pad(rollout.response_mask, 0),
        query_responses=pad(rollout.query_responses, pad_id),
        attention_mask=pad(rollout.attention_mask, 0),
        logp=pad(rollout.logp, 0.0),
        ref_logp=pad(rollout.ref_logp, 0.0),
        values=pad(rollout.values, 0.0),
        log_ratio=pad(rollout.log_ratio, 0.0),
    )
    k1_sum = float(((rollout.logp - rollout.ref_logp) * rollout.response_mask).sum())
    expected = k1_sum / (4 * 6)
    assert abs(k1_sum) > 1e-3
    assert kl_loss_term(trainer, rollout)[0] == pytest.approx(expected, rel=1e-4)
    assert kl_loss_term(trainer, wide)[0] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("mode", ["reward", "none"])
def test_reward_and_none_modes(tiny_path, prompts, tmp_path, mode):
    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_mode=mode, kl_coef=0.5))
    trainer.train()
    log = last_log(trainer)
    assert "loss/kl" not in log
    if mode == "reward":
        # non-score reward is exactly -beta * mean per-sequence sum of k1 (the controller statistic)
        assert log["objective/non_score_reward"] == pytest.approx(-0.5 * log["kl/value"], rel=1e-5, abs=1e-9)
    else:
        assert log["objective/non_score_reward"] == 0.0


def test_adaptive_coefficient_follows_target_fixed_stays(tiny_path, prompts, tmp_path):
    common = dict(
        kl_controller="adaptive", kl_coef=0.1, kl_controller_kwargs={"horizon": 8}, max_steps=3, kl_target_unit="token"
    )

    def steps(trainer):
        return [(h["kl/value"], h["kl/coef"], h["kl/coef_next"]) for h in trainer.state.log_history if "kl/coef" in h]

    # a tiny target: once the policy has moved, KL is above it and beta must rise at every such update;
    # a huge target: beta must fall at every update
    high = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_target=1e-9, **common))
    high.train()
    low = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_target=1e3, **common))
    low.train()
    rises = [nxt > coef for kl, coef, nxt in steps(high) if kl > 1e-9]
    assert len(rises) >= 2 and all(rises)
    # Ziegler's step with the error clipped at +0.2 and n_steps / horizon = 4 / 8
    kl, coef, nxt = steps(high)[-1]
    assert nxt == pytest.approx(coef * (1 + 0.2 * 4 / 8), rel=1e-12)
    assert all(nxt < coef for _, coef, nxt in steps(low))
    assert low.kl_controller.value == pytest.approx(0.1 * 0.9**3, rel=1e-12)
    fixed = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_coef=0.1, max_steps=2))
    fixed.train()
    assert fixed.kl_controller.value == 0.1
    assert [coef for _, coef, _ in steps(fixed)] == [0.1, 0.1]


def test_resume_continues_coefficient(tiny_path, prompts, tmp_path):
    kw = dict(kl_controller="exponential", kl_target=1e-6, kl_coef=0.1, kl_target_unit="token", save_strategy="steps")
    full = make_trainer(tiny_path, prompts, make_args(tmp_path, max_steps=2, save_steps=1, **kw))
    full.train()
    coefs = [h["kl/coef"] for h in full.state.log_history if "kl/coef" in h]
    assert coefs[1] != coefs[0]  # it did adapt
    ckpt = os.path.join(full.args.output_dir, "checkpoint-1")
    with open(os.path.join(ckpt, "kl_controller.json")) as f:
        saved = json.load(f)["kl_controller"]
    resumed = make_trainer(tiny_path, prompts, make_args(tmp_path, max_steps=2, save_steps=1, **kw))
    assert resumed.kl_controller.value == 0.1
    resumed.train(resume_from_checkpoint=ckpt)
    resumed_coefs = [h["kl/coef"] for h in resumed.state.log_history if "kl/coef" in h]
    # the resumed run's update 2 used the coefficient saved after update 1, not the initial 0.1
    assert resumed_coefs[-1] == pytest.approx(coefs[1], rel=1e-12)
    assert saved["value"] == pytest.approx(coefs[1], rel=1e-12) and saved["n_updates"] == 1
    assert resumed.state.global_step == 2


def test_peft_adapter_reference_matches_frozen_copy(tiny_path, prompts, tmp_path):
    peft = pytest.importorskip("peft")
    from klppo.models import load_causal_lm

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path, critic="shared")
    adapter_ref = make_trainer(tiny_path, prompts, args, peft_config=lora)
    copy_ref = make_trainer(tiny_path, prompts, args, peft_config=lora, ref_model=load_causal_lm(tiny_path))
    assert adapter_ref.ref_model is None and adapter_ref.use_adapter_reference
    batch = adapter_ref.prompt_batch(prompts["prompt"][:4])
    torch.manual_seed(0)
    rollout_a = adapter_ref.rollout(batch)
    scored_b = copy_ref.score(rollout_a.sequences())
    torch.testing.assert_close(rollout_a.ref_logp, scored_b.ref_logp, rtol=1e-5, atol=1e-5)
    # at step 0 (LoRA B = 0) the policy equals the reference
    torch.testing.assert_close(rollout_a.logp, rollout_a.ref_logp, rtol=1e-5, atol=1e-5)
    # only adapter and value-head weights train; training changes them and not the base
    adapter_ref.train()
    names = [n for n, p in adapter_ref.model.named_parameters() if p.requires_grad]
    assert names and all("lora" in n or "value_head" in n for n in names)


def test_nonfinite_reward_skips_update_then_aborts(tiny_path, prompts, tmp_path):
    def nan_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    args = make_args(tmp_path, max_steps=3, max_nonfinite_updates=2)
    trainer = make_trainer(tiny_path, prompts, args, reward_funcs=nan_reward)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(RuntimeError, match="non-finite"):
        trainer.train()
    assert trainer.nonfinite_skips == 2
    for name, param in trainer.model.named_parameters():
        assert torch.equal(before[name], param), f"{name} changed during a skipped update"


def test_shared_critic_and_perplexity_eval(tiny_path, prompts, tmp_path):
    args = make_args(tmp_path, critic="shared", eval_strategy="steps", eval_steps=1, max_steps=1)
    trainer = make_trainer(tiny_path, prompts, args, eval_dataset=prompts.select(range(4)), heldout_texts=["a b c"] * 4)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval/perplexity" in h]
    assert evals and math.isfinite(evals[0]["eval/perplexity"]) and evals[0]["eval/perplexity"] > 1
    assert "eval/scores" in evals[0]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(kl_estimator="k4"), "k1"),
        (dict(kl_mode="sideways"), "reward"),
        (dict(kl_controller="magic"), "adaptive"),
        (dict(kl_loss_agg_mode="sum"), "token-mean"),
        (dict(kl_controller="adaptive"), "kl_target"),
        (dict(kl_controller="pid", kl_target=-1.0), "kl_target"),
        (dict(kl_mode="none", kl_controller="adaptive", kl_target=1.0), "nothing to adapt"),
        (dict(critic="both"), "separate"),
        (dict(kl_target_unit="nats"), "sequence"),
        (dict(save_strategy="epoch"), "save_steps"),
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **overrides)


def test_biased_combination_warns_once(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        make_args(tmp_path, kl_mode="loss", kl_estimator="k1")
    messages = [r.getMessage() for r in caplog.records if "KL configuration" in r.getMessage()]
    assert len(messages) == 1


def test_training_arguments_klppo_does_not_act_on_warn_once_with_what_to_do(tmp_path, caplog, monkeypatch):
    from klppo.ppo import config as config_module

    monkeypatch.setattr(config_module, "_WARNED", set())
    with caplog.at_level("WARNING"):
        make_args(tmp_path)
        assert not [r for r in caplog.records if "has no effect in klppo" in r.getMessage()]
        make_args(tmp_path, eval_on_start=True, neftune_noise_alpha=5.0)
        make_args(tmp_path, eval_on_start=True)
    messages = [r.getMessage() for r in caplog.records if "has no effect in klppo" in r.getMessage()]
    assert len(messages) == 2 and "evaluate_policy()" in messages[0] and "neftune_noise_alpha=5.0" in messages[1]


def test_resuming_a_checkpoint_without_optimizer_state_says_so(tiny_path, prompts, tmp_path, caplog):
    """A checkpoint saved with save_only_model=True resumes with a fresh optimizer and schedule, and one warning
    says so; a full checkpoint resumes without it."""
    for only_model in (False, True):
        out = tmp_path / f"only_model_{only_model}"
        args = make_args(out, save_strategy="steps", save_steps=1, save_only_model=only_model)
        make_trainer(tiny_path, prompts, args).train()
        resumed = make_trainer(tiny_path, prompts, make_args(out, max_steps=2, save_only_model=only_model))
        caplog.clear()
        with caplog.at_level("WARNING"):
            resumed.train(resume_from_checkpoint=True)
        warned = [r for r in caplog.records if "holds no optimizer state" in r.getMessage()]
        assert len(warned) == int(only_model) and resumed.state.global_step == 2


@pytest.mark.parametrize("kl_mode, warned", [("reward", True), ("both", False), ("loss", False)])
def test_full_in_the_reward_warns_only_without_full_in_the_loss(tmp_path, caplog, kl_mode, warned):
    """`full` in the reward misses the part of the gradient that only the loss path sees; with kl_mode='both' the
    loss adds it, and the warning that asks for it would be wrong."""
    with caplog.at_level("WARNING"):
        make_args(tmp_path, kl_mode=kl_mode, kl_estimator="full", kl_controller="fixed")
    messages = [r.getMessage() for r in caplog.records if "KL configuration" in r.getMessage()]
    assert bool([m for m in messages if "full also in the loss" in m]) is warned


def test_missing_eos_penalty_without_stop_token_warns_once_with_what_happens(tmp_path, caplog, monkeypatch):
    """TRL 1.12's `missing_eos_penalty` with no stop token is accepted, with one warning that says what klppo then
    does, once however often a config is built; a stop token, or no penalty, gives none."""
    from klppo.ppo import config as config_module

    monkeypatch.setattr(config_module, "_WARNED", set())
    with caplog.at_level("WARNING"):
        make_args(tmp_path, stop_token="eos", missing_eos_penalty=1.0)
        make_args(tmp_path, stop_token=None)
        assert not [r for r in caplog.records if "missing_eos_penalty" in r.getMessage()]
        args = make_args(tmp_path, stop_token=None, missing_eos_penalty=1.5, response_length=9)
        dataclasses.replace(args)
        make_args(tmp_path, stop_token=None, missing_eos_penalty=1.5)
    (message,) = [r.getMessage() for r in caplog.records if "missing_eos_penalty" in r.getMessage()]
    assert "\n" not in message
    for says in (
        "full response_length (9 tokens)",
        "not suppressed",
        "scored like any other token",
        "contains no EOS token anywhere has 1.5 subtracted",
        "stop_token='eos'",
    ):
        assert says in message, says


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def policy_favouring_eos(tiny_path, logit: float):
    """The tiny policy with a bias `logit` on its LM head's EOS output: EOS is a likely token at every position."""
    from klppo.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_path)
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[load_tokenizer(tiny_path).eos_token_id] = logit
    model.set_output_embeddings(biased)
    return model


@pytest.mark.parametrize("penalty", [None, 1.5])
def test_without_stop_token_eos_is_suppressed_unless_missing_eos_penalty_scores_it(
    tiny_path, prompts, tmp_path, penalty
):
    """`stop_token=None`: responses of `response_length` tokens. Alone (klppo's meaning), EOS is never sampled.
    With `missing_eos_penalty` (TRL 1.12's meaning), EOS is sampled like any token and does not end the response,
    nothing is masked out of the scored log-softmax (the scored distribution is the sampled one, EOS included),
    and exactly the responses that contain no EOS anywhere lose the penalty. The policy makes EOS likely (about
    0.2 per token)."""
    from klppo.models import load_tokenizer
    from klppo.ppo.scoring.logprobs import position_ids_from_mask

    tokenizer = load_tokenizer(tiny_path)
    eos = tokenizer.eos_token_id
    args = make_args(tmp_path, stop_token=None, missing_eos_penalty=penalty, response_length=8, temperature=1.0)
    trainer = KLPPOTrainer(
        model=policy_favouring_eos(tiny_path, 5.5),
        args=args,
        processing_class=tokenizer,
        train_dataset=prompts,
        reward_funcs=zero_reward,
    )
    assert trainer.sampler.generation_config.eos_token_id == []  # no token ends a response
    torch.manual_seed(0)
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"]))
    assert rollout.response_mask.all() and rollout.responses.shape[1] == 8  # nothing truncated
    has_eos = (rollout.responses == eos).any(dim=1)
    rewards = trainer.compute_rewards(rollout)
    if penalty is None:
        assert (
            trainer.sampler.suppressed_ids.tolist() == [eos]
            and eos in trainer.sampler.generation_config.suppress_tokens
        )
        assert not has_eos.any() and "objective/eos_frac" not in rewards.metrics
        return
    assert trainer.sampler.suppressed_ids is None and not trainer.sampler.generation_config.suppress_tokens
    assert (rollout.responses[:, :-1] == eos).any(), "EOS sampled, and the response went on after it"
    assert has_eos.any() and (~has_eos).any()
    torch.testing.assert_close(rewards.scores, torch.where(has_eos, 0.0, -penalty))
    assert rewards.metrics["objective/eos_frac"] == pytest.approx(has_eos.float().mean().item())
    # every scored log-prob is the full softmax(logits / T)'s, as the tokens were sampled
    seq = rollout.sequences()
    with torch.no_grad():
        logits = trainer.model.policy(
            input_ids=seq.query_responses,
            attention_mask=seq.attention_mask,
            position_ids=position_ids_from_mask(seq.attention_mask),
        ).logits
    full = torch.log_softmax(logits[:, seq.context_length - 1 : -1].float(), -1).gather(2, seq.responses[..., None])[
        ..., 0
    ]
    for logp in (rollout.logp, rollout.ref_logp, trainer.score(seq).logp):
        torch.testing.assert_close(logp, full, rtol=1e-4, atol=1e-4)


def test_log_probs_are_recomputed_under_mixed_precision_set_by_accelerate(tiny_path, prompts, tmp_path, monkeypatch):
    """A float32 policy reads its sampling log-probs from generation; under bf16 autocast they are recomputed, also
    when only accelerate's config asks for bf16 (as `accelerate launch` with `mixed_precision: bf16` does)."""
    assert make_trainer(tiny_path, prompts, make_args(tmp_path / "fp32")).logprobs_from_generation
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = make_args(tmp_path / "bf16")
    assert not args.bf16  # the arguments do not know
    trainer = make_trainer(tiny_path, prompts, args)
    assert trainer.accelerator.mixed_precision == "bf16" and not trainer.logprobs_from_generation


@pytest.mark.parametrize(
    "critic, stop_token, penalty",
    [("shared", "eos", None), ("separate", "eos", None), ("shared", None, None), ("shared", None, 1.0)],
)
def test_generation_logprobs_and_values_match_a_scoring_forward(
    tiny_path, prompts, tmp_path, critic, stop_token, penalty
):
    """Old log-probs (and a shared critic's values) are read from generation; they must equal what a
    separate forward pass over the finished sequences gives. With fixed-length responses (stop_token None)
    both mask the suppressed end-of-sequence token, unless missing_eos_penalty has it sampled."""
    args = make_args(
        tmp_path, critic=critic, temperature=0.7, response_length=8, stop_token=stop_token, missing_eos_penalty=penalty
    )
    trainer = make_trainer(tiny_path, prompts, args)
    batch = trainer.prompt_batch(prompts["prompt"][:6])
    torch.manual_seed(1)
    rollout = trainer.rollout(batch)
    mask = rollout.response_mask.bool()
    scored = trainer.score(rollout.sequences())  # every score from forward passes over the finished sequences
    torch.testing.assert_close(rollout.logp[mask], scored.logp[mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rollout.values[mask], scored.values[mask], rtol=1e-4, atol=1e-4)
    assert rollout.logp[mask].abs().sum() > 0
    # the share of responses that reach EOS means something only when responses can hold it
    eos_can_appear = stop_token is not None or penalty is not None
    assert ("objective/eos_frac" in trainer.compute_rewards(rollout).metrics) == eos_can_appear


def test_sample_categorical_draws_exactly_the_given_probabilities(monkeypatch):
    """Two-level inverse transform sampling: frequencies within 5 standard errors of the probabilities (a block size
    that does not divide the vocabulary), tokens of probability 0 never drawn, and a uniform draw that reaches the
    total by rounding still lands on the last token of positive probability."""
    from klppo.ppo.generation.sampling import sample_categorical

    p = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.0, 0.05, 0.35, 0.0, 0.0])
    n = 200_000
    torch.manual_seed(0)
    freq = torch.bincount(sample_categorical(p.repeat(n, 1), block=3), minlength=p.numel()).double() / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert (freq - p.double()).abs().le(5 * se + 1e-12).all(), (freq, p)
    assert freq[p == 0].sum() == 0
    # an unnormalised row (total 0.37) is sampled in proportion: 1/4 and 3/4
    torch.manual_seed(1)
    draws = sample_categorical(torch.tensor([[0.0925, 0.0, 0.2775]]).repeat(n, 1), block=2)
    share = (draws == 2).double().mean()
    assert abs(share - 0.75) < 5 * (0.75 * 0.25 / n) ** 0.5 and set(draws.tolist()) == {0, 2}
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    assert sample_categorical(p[None], block=3).item() == 7  # u == total mass: the last positive token, not a 0


@pytest.mark.parametrize("draw", ["inverse_cdf", "exponential_race"])
def test_generation_samples_softmax_of_the_logits_over_temperature(tiny_model_and_tokenizer, draw):
    """The rollout's sampler (greedy `generate` with `TemperatureSampler` last, either draw) samples from
    `softmax(logits / T)` without the suppressed tokens: first-token frequencies over 4,000 samples within 5 standard
    errors of the exact probabilities of a forward pass, and a suppressed token never drawn. The log-probs read at
    each decoding step are those of the drawn tokens, and the kept logits are the scaled ones."""
    from transformers import GenerationConfig

    from klppo.ppo.generation.sampling import generate_responses

    model, tokenizer = tiny_model_and_tokenizer
    enc = tokenizer(["The tiny model says"], return_tensors="pt")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # a peaked distribution (top tokens 0.05-0.26), not near uniform
        logits = model(**enc).logits[0, -1] / 0.7
    suppressed = torch.tensor([int(logits.argmax())])  # the most likely token
    logits[suppressed] = float("-inf")
    probs = torch.softmax(logits.double(), -1)
    config = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=1,
        pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=suppressed.tolist(),
    )
    n = 4000
    torch.manual_seed(0)
    out = generate_responses(
        model,
        enc.input_ids.repeat(n, 1),
        enc.attention_mask.repeat(n, 1),
        config,
        with_logprobs=True,
        keep_logits=True,
        draw=draw,
    )
    tokens = out.tokens
    freq = torch.bincount(tokens[:, 0], minlength=probs.numel()).double() / n
    assert freq[suppressed].sum() == 0
    top = probs.topk(20).indices
    se = (probs[top] * (1 - probs[top]) / n).sqrt()
    assert (freq[top] - probs[top]).abs().le(5 * se).all(), (freq[top], probs[top])
    torch.testing.assert_close(out.logp[:, 0], probs.log()[tokens[:, 0]].float(), rtol=1e-4, atol=1e-4)
    expected = logits.clamp(min=torch.finfo(logits.dtype).min)  # suppressed: the lowest finite value
    torch.testing.assert_close(out.logits[0, 0], expected, rtol=1e-5, atol=1e-5)
    assert out.finite


def test_exponential_race_draws_exactly_the_given_probabilities():
    """The race `argmax(w / E)`, E ~ Exp(1): frequencies within 5 standard errors of `w / sum(w)` for an
    unnormalised row, and a token of weight 0 never drawn."""
    from klppo.ppo.generation.sampling import sample_exponential_race

    w = torch.tensor([0.0, 0.2, 0.0, 0.4, 0.6, 0.0, 0.1, 0.7])  # total 2
    p = (w / w.sum()).double()
    n = 200_000
    torch.manual_seed(0)
    freq = torch.bincount(sample_exponential_race(w.repeat(n, 1)), minlength=w.numel()).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert (freq - p).abs().le(5 * se + 1e-12).all(), (freq, p)
    assert freq[w == 0].sum() == 0


def test_only_plain_temperature_sampling_is_accepted():
    """klppo scores `softmax(logits / T)`, so generation must sample exactly that: plain temperature sampling, counting
    what the model's own generation config fills into unset fields (as `generate` does); anything that truncates or
    reshapes the distribution is refused."""
    from transformers import GenerationConfig

    from klppo.ppo.generation.sampling import default_draw, plain_sampling_temperature

    plain = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=4)
    assert plain_sampling_temperature(plain) == 0.7
    # the caller's explicit values win over the model's, as in `generate`
    assert plain_sampling_temperature(plain, GenerationConfig(temperature=0.2, top_p=0.9)) == 0.7
    for model_default in (
        {"min_p": 0.05},
        {"typical_p": 0.9},
        {"epsilon_cutoff": 3e-4},
        {"penalty_alpha": 0.6},
        {"repetition_penalty": 1.2},
        {"no_repeat_ngram_size": 3},
        {"min_new_tokens": 2},
        {"min_length": 30},
    ):
        assert plain_sampling_temperature(plain, GenerationConfig(**model_default)) is None, model_default
    # the rollout's own config sets those processors to neutral values, which the model's defaults do not replace
    from types import SimpleNamespace

    from klppo.ppo.generation.sampling import make_generation_config

    tokenizer = SimpleNamespace(pad_token_id=3)
    ours = make_generation_config(SimpleNamespace(response_length=4, temperature=0.7), tokenizer, stop_token_id=2)
    assert plain_sampling_temperature(ours, GenerationConfig(repetition_penalty=1.3, no_repeat_ngram_size=2)) == 0.7
    assert plain_sampling_temperature(ours, GenerationConfig(min_length=30)) == 0.7  # min_new_tokens=0 overrides it
    unset_top_k = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=4)  # transformers' top-k 50
    two_per_prompt = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, num_return_sequences=2)
    for other in (unset_top_k, two_per_prompt, GenerationConfig(do_sample=False)):
        assert plain_sampling_temperature(other) is None
    assert default_draw("cpu") == "inverse_cdf" and default_draw("cuda") == "exponential_race"


@pytest.mark.parametrize("stop", [True, False])
def test_the_rollouts_generation_config_makes_generate_warn_nothing(tiny_model_and_tokenizer, caplog, stop):
    """The rollout's config, with or without a stop token, draws no warning from `generate` (one would repeat at
    every update of every run), and no processor beyond the sampler's."""
    from types import SimpleNamespace

    from klppo.ppo.generation.sampling import generate_responses, make_generation_config

    model, tokenizer = tiny_model_and_tokenizer
    enc = tokenizer(["a", "b"], return_tensors="pt", padding=True)
    args = SimpleNamespace(response_length=3, temperature=0.7)
    config = make_generation_config(args, tokenizer, stop_token_id=tokenizer.eos_token_id if stop else None)
    with caplog.at_level("WARNING"):
        out = generate_responses(model, enc.input_ids, enc.attention_mask, config, with_logprobs=True)
    assert out.tokens.shape == (2, 3) and out.finite
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


def test_sampling_from_non_finite_logits_says_the_weights_diverged(tiny_model_and_tokenizer):
    from transformers import GenerationConfig

    from klppo.ppo.generation.sampling import generate_responses
    from klppo.ppo.safety.nonfinite import TrainingDiverged

    model, tokenizer = tiny_model_and_tokenizer
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    enc = tokenizer(["a", "b"], return_tensors="pt", padding=True)
    config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=3, pad_token_id=tokenizer.pad_token_id
    )
    with pytest.raises(TrainingDiverged, match="weights have diverged"):
        generate_responses(model, enc.input_ids, enc.attention_mask, config, with_logprobs=True)
    assert not generate_responses(model, enc.input_ids, enc.attention_mask, config, check_finite=False).finite


@pytest.mark.parametrize("merge", [True, False])
def test_a_lora_policy_samples_merged_and_its_base_weights_come_back_bit_for_bit(tiny_path, prompts, tmp_path, merge):
    """With `merge_adapter_for_generation`, every LoRA layer runs merged while sampling; the log-probs read from
    generation still equal a scoring pass through the unmerged adapter, and afterwards the base weights (the
    adapter-disabled reference) are the very same bits and no layer is left merged."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    args = make_args(tmp_path, critic="shared", temperature=0.7, response_length=8, merge_adapter_for_generation=merge)
    trainer = make_trainer(tiny_path, prompts, args, peft_config=lora)
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped).policy
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)  # an adapter that moves the policy away from the base
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    seen = []
    # every pass with the adapter on (generation here; the reference pass disables it)
    hooks = [
        layer.register_forward_pre_hook(lambda m, a: seen.append(m.merged) if not m.disable_adapters else None)
        for layer in layers
    ]
    torch.manual_seed(1)
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:6]))
    for hook in hooks:
        hook.remove()
    assert layers and seen and set(seen) == {merge}
    mask = rollout.response_mask.bool()
    scored = trainer.score(rollout.sequences())
    torch.testing.assert_close(rollout.logp[mask], scored.logp[mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rollout.values[mask], scored.values[mask], rtol=1e-4, atol=1e-4)
    assert (rollout.logp - rollout.ref_logp)[mask].abs().max() > 0.05  # the adapter matters here
    assert not any(layer.merged for layer in layers)
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if "lora_" not in n)


def test_lora_layers_sharing_a_base_weight_sample_unmerged(tiny_path):
    """Two LoRA layers on one base weight (as with tied embeddings) would merge each other's update: such a model
    samples unmerged, and its weights stay as they were."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    from klppo.models import load_causal_lm
    from klppo.ppo.generation.static_cache import merged_lora

    model = peft.get_peft_model(load_causal_lm(tiny_path), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    with merged_lora(model):
        assert all(layer.merged for layer in layers)  # the plain case merges
    layers[1].get_base_layer().weight = layers[0].get_base_layer().weight  # now shared
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with merged_lora(model):
        assert not any(layer.merged for layer in layers)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_evaluation_does_not_change_the_training_run(tiny_path, prompts, tmp_path):
    kw = dict(heldout_texts=["some held-out words"] * 2, eval_dataset=prompts.select(range(4)))
    plain = make_trainer(tiny_path, prompts, make_args(tmp_path, max_steps=2), **kw)
    plain.train()
    evaluated = make_trainer(tiny_path, prompts, make_args(tmp_path, max_steps=2), **kw)
    evaluated.evaluate_policy()  # samples eval completions before training
    evaluated.train()
    keys = ("kl/value", "objective/scores", "loss/policy")
    logs = [[[h[k] for k in keys] for h in t.state.log_history if "kl/value" in h] for t in (plain, evaluated)]
    assert logs[0] == logs[1]


def test_pid_anti_windup_constants_reach_the_controller(tmp_path):
    from klppo.kl import build_kl_controller

    args = make_args(
        tmp_path, kl_controller="pid", kl_target=1.0, kl_controller_kwargs={"integral_limit": 3.0, "error_clip": 0.5}
    )
    state = build_kl_controller(args).state_dict()["hparams"]
    assert state["integral_limit"] == 3.0 and state["error_clip"] == 0.5


def test_nonfinite_loss_skips_the_optimizer_step(tiny_path, prompts, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path, max_steps=2, max_nonfinite_updates=5))
    original = trainer.loss_function

    def nan_loss_function():
        def nan_loss(*args, **kwargs):
            loss, parts, sample = original()(*args, **kwargs)
            return loss * float("nan"), parts, sample

        return nan_loss

    monkeypatch.setattr(trainer, "loss_function", nan_loss_function)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.nonfinite_skips == 2
    for name, param in trainer.model.named_parameters():
        assert torch.equal(before[name], param), f"{name} changed by a non-finite loss"


def test_learning_rate_defaults_differ_for_lora_and_full_fine_tuning(tiny_path, prompts, tmp_path):
    from peft import LoraConfig

    from klppo.ppo.config import DEFAULT_FULL_LEARNING_RATE, DEFAULT_LORA_LEARNING_RATE

    args = make_args(tmp_path, learning_rate=None)
    full = make_trainer(tiny_path, prompts, args)
    assert full.args.learning_rate == DEFAULT_FULL_LEARNING_RATE == 3e-5
    assert full.args.automatic["learning_rate"] == 3e-5
    assert args.learning_rate is None and "learning_rate" not in args.automatic  # the caller's config is left as it was
    lora = make_trainer(
        tiny_path,
        prompts,
        make_args(tmp_path, learning_rate=None),
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )
    assert lora.args.learning_rate == DEFAULT_LORA_LEARNING_RATE == 5e-4
    lora.train()
    assert lora.state.log_history[0]["lr"] == 5e-4
    assert make_trainer(tiny_path, prompts, make_args(tmp_path, learning_rate=1e-2)).args.learning_rate == 1e-2


def test_a_model_object_trains_with_the_default_config(tiny_model_and_tokenizer, prompts, tmp_path):
    """The common pattern `KLPPOTrainer(model=AutoModelForCausalLM.from_pretrained(...))` with every default,
    including a separate critic initialised from the policy: the critic copies the object's weights."""
    model, tokenizer = tiny_model_and_tokenizer
    model.config._name_or_path = ""  # as for a model built in memory: no path to reload from
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # weights that differ from anything on disk
    args = KLPPOConfig(
        output_dir=str(tmp_path / "obj"),
        max_steps=1,
        per_device_train_batch_size=2,
        response_length=4,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
    )
    trainer = KLPPOTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=prompts, reward_funcs=length_reward
    )
    critic_embed = trainer.model.critic.backbone.embed_tokens.weight
    assert (
        torch.equal(critic_embed, model.model.embed_tokens.weight)
        and critic_embed is not model.model.embed_tokens.weight
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_none_rewards_are_not_applicable_as_in_trl(tiny_path, prompts, tmp_path, caplog):
    """None: that function does not apply to the sample; the others combine by their weights; a sample that
    no function applies to gets score 0, no policy gradient (advantage 0) and a warning."""

    def odd_only(prompts, completions, completion_ids=None, **kwargs):
        return [None if i % 2 == 0 else 1.0 for i in range(len(completions))]

    def first_only(prompts, completions, completion_ids=None, **kwargs):
        return [2.0 if i == 0 else None for i in range(len(completions))]

    trainer = make_trainer(
        tiny_path, prompts, make_args(tmp_path, reward_weights=[1.0, 0.5]), reward_funcs=[odd_only, first_only]
    )
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:4]))
    with caplog.at_level("WARNING"):
        rewards = trainer.compute_rewards(rollout)
    metrics = rewards.metrics
    assert rewards.scores.tolist() == [1.0, 1.0, 0.0, 1.0]  # 0.5 * 2; 1; nothing; 1
    assert rewards.scorable.tolist() == [True, True, False, True]
    assert metrics["rewards/odd_only"] == 1.0 and metrics["rewards/first_only"] == 2.0  # applicable values only
    assert any("1 of 4 completions got None from every reward function" in r.getMessage() for r in caplog.records)
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    advantages = trainer.compute_advantages(rollout, rewards, penalty)
    assert torch.all(advantages.advantages[2] == 0)
    trainer.train()  # no abort: None is not a non-finite value
    assert trainer.nonfinite_skips == 0


def test_a_wrong_reward_result_stops_with_the_function_named(tiny_path, prompts, tmp_path):
    def short(prompts, completions, completion_ids=None, **kwargs):
        return [1.0]

    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path), reward_funcs=short)
    with pytest.raises(ValueError, match="'short' returned 1 values for 4 completions"):
        trainer.train()


def test_perplexity_of_a_diverged_model_is_inf_not_an_error(tiny_model_and_tokenizer):
    from klppo.evaluation import heldout_perplexity

    model, tokenizer = tiny_model_and_tokenizer
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)  # logits so large that the mean NLL overflows exp
    with pytest.warns(UserWarning, match="not finite"):
        assert heldout_perplexity(model, tokenizer, ["some held-out words here"] * 2) == math.inf


def test_a_diverging_update_is_undone_and_the_log_says_so(tiny_path, prompts, tmp_path, caplog):
    """lr 1e20: the first optimizer step of an update goes through and a later one is non-finite. The whole
    update is rolled back (weights and optimizer state), so "restored" in the log is true, and checkpoints
    hold finite weights."""
    args = make_args(
        tmp_path,
        learning_rate=1e20,
        max_grad_norm=0.0,
        max_steps=2,
        num_ppo_epochs=3,
        num_mini_batches=2,
        gradient_accumulation_steps=1,
        save_strategy="steps",
        save_steps=1,
        max_nonfinite_updates=5,
        nonfinite_rollback=True,  # full fine-tuning: off by default
    )
    trainer = make_trainer(tiny_path, prompts, args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.nonfinite_skips == 2
    assert sum("restored to the start of the update" in r.getMessage() for r in caplog.records) == 2
    for name, param in trainer.model.named_parameters():
        if name in before:
            assert torch.equal(before[name], param), f"{name} changed by an undone update"
    from safetensors.torch import load_file

    saved = load_file(os.path.join(args.output_dir, "checkpoint-2", "klppo_trainable.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_an_update_that_leaves_overflowing_logits_is_undone_by_the_next_rollout(
    tiny_path, prompts, tmp_path, caplog, monkeypatch
):
    """An update whose loss and gradients were finite can still leave weights whose logits overflow. No extra forward
    pass looks for that after each update: the next rollout's own forwards find it, the update is undone from its
    copy and the rollout sampled again from the policy before it. Only the end of training checks with a forward of
    its own (one micro-batch), before anything samples from or saves the policy."""
    import klppo.ppo.safety.nonfinite as safety_module

    args = make_args(tmp_path, max_steps=3, nonfinite_rollback=True, max_nonfinite_updates=5)
    trainer = make_trainer(tiny_path, prompts, args)
    head = trainer.model.policy.get_output_embeddings().weight
    optimise, checks = trainer.optimise, []

    def optimise_then_blow_up(*a, **k):
        result = optimise(*a, **k)
        if trainer.state.global_step == 0:  # the first update leaves finite weights with overflowing logits
            with torch.no_grad():
                head.fill_(1e38)
        return result

    checked = safety_module.policy_outputs_finite
    monkeypatch.setattr(trainer, "optimise", optimise_then_blow_up)
    monkeypatch.setattr(safety_module, "policy_outputs_finite", lambda *a, **k: checks.append(1) or checked(*a, **k))
    before = head.detach().clone()
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == 3 and trainer.nonfinite_skips == 1
    assert checks == [1]  # the end of training's own check, and no other
    assert any(
        "after update 1" in r.getMessage() and "restored to the start of that update" in r.getMessage()
        for r in caplog.records
    )
    assert torch.isfinite(head).all() and head.abs().max() < 1e3 and not torch.equal(head, before)
    assert trainer.state.log_history[1]["train/skipped_update"] == 1.0


def test_rollback_is_on_by_default_with_lora_and_off_for_full_fine_tuning(tiny_path, prompts, tmp_path):
    """The undo copy costs 3x the trainable weights: taken by default only when they are a small share (LoRA with
    the shared critic).
    Without it, an update whose steps leave a policy with non-finite logits stops training, saying how many of its
    steps were applied and how to fix the run, and nothing is saved from then on."""
    from peft import LoraConfig

    from klppo.ppo.safety.nonfinite import TrainingDiverged

    lora = make_trainer(
        tiny_path, prompts, make_args(tmp_path, critic="shared"), peft_config=LoraConfig(r=4, target_modules=["q_proj"])
    )
    assert lora.rollback_updates
    # a separately trained critic is a full copy of the model: its undo copy is not small
    separate = make_trainer(
        tiny_path,
        prompts,
        make_args(tmp_path, critic="separate"),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
    )
    assert not separate.rollback_updates
    args = make_args(
        tmp_path,
        learning_rate=1e20,
        max_grad_norm=0.0,
        max_steps=1,
        num_ppo_epochs=3,
        num_mini_batches=2,
        gradient_accumulation_steps=1,
        max_nonfinite_updates=5,
    )
    full = make_trainer(tiny_path, prompts, args)
    assert not full.rollback_updates
    assert make_trainer(tiny_path, prompts, make_args(tmp_path, nonfinite_rollback=True)).rollback_updates
    with pytest.raises(TrainingDiverged, match=r"after 1 optimizer step\(s\).*learning_rate.*nonfinite_rollback"):
        full.train()
    full.save_model(str(tmp_path / "final"))
    assert not os.path.exists(tmp_path / "final")


def test_kl_guard_ends_an_update_once_the_kl_passes_its_bound(tiny_path, prompts, tmp_path, caplog):
    """With `kl_guard=True`, a mini-batch whose KL at the current policy passes `kl_target`, and which the update
    has pushed up, takes no step and ends the update. Full fine-tuning: the first mini-batch of update 1 is at the
    reference (KL 0), so it steps; update 2's rollout already reads above the target of 1.5e-6 nats, yet its first
    mini-batch steps too (the update has not raised it yet: a guard that fired there would freeze the policy for
    good); after a step the KL passes the target within each update."""
    kw = dict(max_steps=2, num_ppo_epochs=2, num_mini_batches=2, kl_target=1.5e-6, kl_controller="fixed")
    guarded = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_guard=True, **kw))
    assert type(guarded.kl_guard).lower_at == 1.0 and guarded.kl_guard.upper_on  # at the target itself
    with caplog.at_level("INFO"):
        guarded.train()
    fired = [h["kl/guard_fired"] for h in guarded.state.log_history if "kl/guard_fired" in h]
    assert fired == [1.0, 1.0]
    messages = [r.getMessage() for r in caplog.records if "KL guard" in r.getMessage()]
    steps = [int(m.split("after ")[1].split(" ")[0]) for m in messages]
    assert len(steps) == 2 and min(steps) >= 1 and guarded.lr_scheduler.last_epoch == sum(steps) < 8
    free = make_trainer(tiny_path, prompts, make_args(tmp_path, **kw))  # a fixed controller: the guard is off
    free.train()
    assert free.lr_scheduler.last_epoch == 8 and not any("kl/guard_fired" in h for h in free.state.log_history)
    with pytest.raises(ValueError, match="kl_guard"):
        make_args(tmp_path, kl_guard=True)  # no kl_target


def test_the_guards_low_side_ends_an_update_that_pulls_the_kl_below_its_bound(tiny_path, prompts, tmp_path, caplog):
    """The guard's low side: once a rollout's reading has reached `kl_target`, a mini-batch whose KL at the current
    policy has been pushed down and below the target takes no step and ends the update. A fixed beta of 50 on a
    `k2` loss term under full fine-tuning: update 1 starts at the reference (the term's gradient is 0 there, so the
    reward moves the policy away), update 2's term pulls it back. The upper side is turned off here (guards
    registered under names of their own, whose class turns that side off), so that the low side acts alone.

    The target comes from a probe run that computes exactly what the guarded run computes up to the guard's first
    firing: the same statistic (`full`), and a guard that records the KL it would judge at each mini-batch of update 2
    (the rollout's reading plus the update's change on the mini-batch's tokens) and never fires. The target sits
    halfway between update 2's reading and the lowest KL a pushed-down mini-batch reached: both sides hold a margin
    of at least 1% of the reading, far above rounding, measured on the host that runs the test, whatever its kernels
    (the guarded run repeats the probe's computation exactly). (A fixed 10% margin
    between two different statistics, `k2` in the probe and `full` in the guarded run, was crossed on an AVX2 host.)"""
    from klppo.ppo.safety.kl_guard import KLGuard, register_kl_guard, unregister_kl_guard

    events = []

    class Recorder(KLGuard):
        upper = False

        def observe(self, reading):
            events.append(("reading", reading))

        def check(self, kl_sum, kl_count, kl_rollout, reading, change_sq=None):
            events.append(("judged", reading + (kl_sum - kl_rollout) / kl_count, kl_sum - kl_rollout, kl_count))

    class LowSideOnly(KLGuard):
        upper = False

    register_kl_guard("recorder")(Recorder)
    register_kl_guard("low_side_only")(LowSideOnly)
    kw = dict(
        max_steps=3,
        num_ppo_epochs=2,
        num_mini_batches=2,
        kl_controller="fixed",
        kl_coef=50.0,
        learning_rate=1e-2,
        kl_mode="loss",
        kl_estimator="k2",
        kl_statistic="full",
    )
    try:
        probe = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_target=1.0, kl_guard="recorder", **kw))
        probe.train()
        readings = [e[1] for e in events if e[0] == "reading"]
        second = [i for i, e in enumerate(events) if e[0] == "reading"][1]
        update2 = [e for e in events[second + 1 :] if e[0] == "judged"][: 2 * 2 - 1]  # its steps after the first
        r2 = readings[1]
        pulled = [now for _, now, change, count in update2 if -change > 1e-2 * max(r2 * count, 1e-12)]
        assert readings[0] == pytest.approx(0.0, abs=1e-6) and r2 > 0.05  # update 1 left the reference
        assert pulled and min(pulled) < 0.98 * r2, (r2, update2)  # update 2 pulls the KL back (0.93 r2 on AVX2)
        target = (r2 + min(pulled)) / 2
        both = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_target=target, kl_guard=True, **kw))
        assert both.kl_guard.lower_on and both.kl_guard.upper_on  # kl_guard=True: both sides, at the target
        guarded = make_trainer(
            tiny_path, prompts, make_args(tmp_path, kl_target=target, kl_guard="low_side_only", **kw)
        )
        assert isinstance(guarded.kl_guard, LowSideOnly) and not guarded.kl_guard.upper_on
        with caplog.at_level("INFO"):
            guarded.train()
    finally:
        unregister_kl_guard("recorder")
        unregister_kl_guard("low_side_only")
    guarded_readings = [h["kl/value"] for h in guarded.state.log_history if "kl/value" in h]
    assert guarded_readings[:2] == pytest.approx(readings[:2], rel=1e-9)  # the same computation up to there
    fired = [h["kl/guard_low_fired"] for h in guarded.state.log_history if "kl/guard_low_fired" in h]
    assert fired[:2] == [0.0, 1.0] and guarded.kl_guard.low_armed
    assert not any("kl/guard_fired" in h for h in guarded.state.log_history)  # the upper side stays off
    messages = [r.getMessage() for r in caplog.records if "fell below" in r.getMessage()]
    assert messages and int(messages[0].split("after ")[1].split(" ")[0]) >= 1
    assert guarded.lr_scheduler.last_epoch < probe.lr_scheduler.last_epoch == 12


def test_the_guard_holds_the_target_by_default_with_the_equilibrium_and_tracking_controllers(
    tiny_path, prompts, tmp_path
):
    """Unset, `kl_guard` resolves to True with the equilibrium and tracking controllers (the defaults with a kl_target) and
    to False with every other controller and without a target; False turns it off and True turns it on with any
    controller; resolving a resolved config again changes nothing; True without a target is an error that names
    `kl_guard`. On, the trainer's guard holds the target itself on both sides and clears the momentum."""
    import dataclasses

    assert make_args(tmp_path, kl_target=4.0).experimental.kl_guard is True
    assert make_args(tmp_path, kl_target=4.0, kl_controller="tracking").experimental.kl_guard is True
    assert make_args(tmp_path, kl_target=4.0, kl_controller="equilibrium").experimental.kl_guard is True
    for controller in ("adaptive", "pid", "exponential", "fixed"):
        assert make_args(tmp_path, kl_target=4.0, kl_controller=controller).experimental.kl_guard is False
    assert make_args(tmp_path).experimental.kl_guard is False
    assert make_args(tmp_path, kl_target=4.0, kl_controller="pid", kl_guard=True).experimental.kl_guard is True
    off = make_args(tmp_path, kl_target=4.0, kl_guard=False)
    assert off.kl_controller == "equilibrium" and off.experimental.kl_guard is False
    assert dataclasses.replace(off).experimental.kl_guard is False  # stays off when resolved again
    assert dataclasses.replace(make_args(tmp_path, kl_target=4.0)).experimental.kl_guard is True
    assert make_args(tmp_path, kl_guard=False).experimental.kl_guard is False  # off needs no target
    with pytest.raises(ValueError, match="kl_guard.*kl_target"):
        make_args(tmp_path, kl_guard=True)
    with pytest.raises(ValueError, match="kl_guard.*kl_target"):
        make_args(tmp_path, kl_controller="fixed", kl_guard=True)
    guard = make_trainer(tiny_path, prompts, make_args(tmp_path, kl_target=4.0)).kl_guard
    assert guard.upper_on and guard.lower_on and (guard.target, guard.lower_at) == (4.0, 1.0)
    assert guard.clears_momentum is True
    for args in (off, make_args(tmp_path, kl_target=4.0, kl_controller="pid")):
        guard = make_trainer(tiny_path, prompts, args).kl_guard
        assert not guard.upper_on and not guard.lower_on


def as_written_before_kl_controller_kwargs(checkpoint: str) -> str:
    """`checkpoint` with its saved settings as a checkpoint from before `kl_controller_kwargs` and `kl_guard` has
    them: the old fields in their place."""
    path = os.path.join(checkpoint, "kl_controller.json")
    with open(path) as f:
        state = json.load(f)
    settings = {k: v for k, v in state["settings"].items() if k not in ("kl_guard", "kl_controller_kwargs")}
    settings.update(kl_horizon=10000, kl_guard_margin=0.0, kl_guard_low_margin=0.0, kl_guard_reset_momentum=True)
    state["settings"] = settings
    with open(path, "w") as f:
        json.dump(state, f)
    return checkpoint


def test_the_default_guard_fires_in_training_and_a_changed_guard_setting_is_named_on_resume(
    tiny_path, prompts, tmp_path, caplog
):
    """The default controller's guard acts in `train()` (4 steps per update, a target the first step
    passes). Resumed with the same settings, nothing is reported; with `kl_guard` or `kl_controller_kwargs`
    changed, a warning names each (both are combined with the checkpoint's state, not refused); a checkpoint
    written before these two settings existed resumes without a word about them."""
    kw = dict(
        kl_target=1e-6,
        num_mini_batches=2,
        num_ppo_epochs=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
    )
    args = make_args(tmp_path, **kw)
    assert (
        args.kl_controller == "equilibrium" and args.experimental.kl_guard is True and args.kl_controller_kwargs is None
    )
    trainer = make_trainer(tiny_path, prompts, args)
    trainer.train()
    assert [h["kl/guard_fired"] for h in trainer.state.log_history if "kl/guard_fired" in h] == [1.0, 1.0]
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")

    def resume(name, **changes):  # at its last update: loads and checks, trains nothing
        caplog.clear()
        resumed = make_trainer(
            tiny_path, prompts, make_args(tmp_path, output_dir=str(tmp_path / name), **{**kw, **changes})
        )
        with caplog.at_level("WARNING"):
            resumed.train(resume_from_checkpoint=checkpoint)
        assert resumed.state.global_step == 2
        return " ".join(r.getMessage() for r in caplog.records)

    messages = resume("same")
    assert "kl_guard" not in messages and "kl_controller_kwargs" not in messages
    messages = resume("changed", kl_guard=False, kl_controller_kwargs={"coef_min": 0.001})
    assert "kl_guard changed from True to False" in messages
    assert "kl_controller_kwargs changed from None to {'coef_min': 0.001}" in messages
    as_written_before_kl_controller_kwargs(checkpoint)
    messages = resume("old")
    assert "kl_guard" not in messages and "kl_controller_kwargs" not in messages and "kl_horizon" not in messages


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kl_guard_does_not_freeze_a_policy_whose_rollout_already_reads_above_the_bound(
    tiny_path, prompts, tmp_path, seed
):
    """A rollout whose KL is already far above the guard's bound (the target): the update still steps (the first
    mini-batch, at the rollout's own policy, has not been pushed up), so a higher beta can bring the policy back.
    A guard that fired there would take no step in this update or any later one."""
    args = make_args(
        tmp_path,
        kl_guard=True,
        kl_target=1.5e-3,
        kl_controller="fixed",
        num_ppo_epochs=2,
        num_mini_batches=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
    )
    trainer = make_trainer(tiny_path, prompts, args)
    with torch.no_grad():
        head = trainer.accelerator.unwrap_model(trainer.model).policy.get_output_embeddings().weight
        head.add_(0.5 * torch.randn_like(head, generator=torch.Generator().manual_seed(seed)))
    trainer.setup_optimisation(1)
    torch.manual_seed(seed)
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:8]))
    rewards = trainer.compute_rewards(rollout)
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    assert penalty.metrics["kl/k1"] > 100 * 1.5e-3  # far above the bound before any step
    advantages = trainer.compute_advantages(rollout, rewards, penalty)
    result = trainer.optimise(rollout, advantages, kl_reading=penalty.metrics["kl/value"])
    assert result.applied_steps >= 1


def guarded_update(tiny_path, prompts, args, kl_reading="rollout", reset_momentum=True):
    """One rollout of 8 prompts (seed 0) and its PPO epochs under `args`; returns (trainer, penalty, result).
    `kl_reading` is passed to `optimise`: a number, None, or "rollout" for the rollout's own reading;
    `reset_momentum` is set on the trainer's guard."""
    trainer = make_trainer(tiny_path, prompts, args)
    trainer.kl_guard.clears_momentum = reset_momentum
    trainer.setup_optimisation(1)
    torch.manual_seed(0)
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:8]))
    rewards = trainer.compute_rewards(rollout)
    penalty = trainer.apply_kl(rollout, rewards)
    penalty.metrics.update(trainer.update_controller(rollout, rewards, penalty))
    reading = penalty.metrics["kl/value"] if kl_reading == "rollout" else kl_reading
    result = trainer.optimise(rollout, trainer.compute_advantages(rollout, rewards, penalty), kl_reading=reading)
    return trainer, penalty, result


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_kl_guard_reads_the_rollout_reading_plus_the_change_the_update_made(tiny_path, prompts, tmp_path, unit):
    """The guard's KL is the rollout's reading (the controller's statistic, passed by `ppo_update`) plus the
    change the update made on the mini-batch's tokens, in `kl_target_unit`. Full fine-tuning from the reference:
    - target 1.5e-6: after one step the mini-batch's own KL passes the target, so the guard fires given no reading
      or the rollout's own (about 0); given a reading far below the target, the same change stays below it and
      every step is taken;
    - target 1.5: the mini-batch's own KL after a step stays below the target, so the guard holds still given no
      reading; given a reading above the target, the update's rise fires it after one step."""
    applied = {}
    for target, reading in ((1.5e-6, "none"), (1.5e-6, "low"), (1.5e-6, "rollout"), (1.5, "none"), (1.5, "high")):
        args = make_args(
            tmp_path,
            kl_guard=True,
            kl_target=target,
            kl_target_unit=unit,
            kl_controller="fixed",
            num_ppo_epochs=2,
            num_mini_batches=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
        )
        kl_reading = {"none": None, "low": -1e3, "high": 2.0, "rollout": "rollout"}[reading]
        _, penalty, result = guarded_update(tiny_path, prompts, args, kl_reading)
        assert abs(penalty.metrics["kl/value"]) < 1e-6  # the rollout is the reference's own
        applied[target, reading] = (
            result.applied_steps,
            result.metrics["kl/guard_fired"],
            result.metrics["kl/during_update"],
        )
    assert applied[1.5e-6, "none"][:2] == (1, 1.0) and applied[1.5e-6, "rollout"][:2] == (1, 1.0)
    assert applied[1.5e-6, "low"][:2] == (4, 0.0)
    assert applied[1.5, "none"][:2] == (4, 0.0) and applied[1.5, "none"][2] < 1.5  # the level stayed below
    assert applied[1.5, "high"][:2] == (1, 1.0)


@pytest.mark.parametrize("reset", [True, False])
def test_kl_guard_clears_the_optimizers_momentum_when_it_fires(tiny_path, prompts, tmp_path, reset):
    """When the guard fires, Adam's first moments are zeroed (the push that made it fire does not carry into the
    next update's steps) and the second moments kept; with the guard's `reset_momentum` set to False both are
    kept."""
    args = make_args(
        tmp_path,
        kl_guard=True,
        kl_target=1.5e-6,
        kl_controller="fixed",
        num_ppo_epochs=2,
        num_mini_batches=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
    )
    trainer, _, result = guarded_update(tiny_path, prompts, args, kl_reading=0.0, reset_momentum=reset)
    assert (result.applied_steps, result.metrics["kl/guard_fired"]) == (1, 1.0)
    states = [s for s in trainer.optimizer.optimizer.state.values() if "exp_avg" in s]
    assert states
    first = max(float(s["exp_avg"].abs().max()) for s in states)
    second = max(float(s["exp_avg_sq"].abs().max()) for s in states)
    assert second > 0
    assert (first == 0) if reset else (first > 0)


def test_a_resumed_run_continues_the_tracking_controller_exactly(tiny_path, prompts, tmp_path):
    """Resumed from checkpoint-1 or checkpoint-2, a run ends with the same full controller state (EMA, integral,
    trend history, hold / armed flags, beta), the same armed state of the guard's low side and the same per-update
    log as the run that was never interrupted. Each trainer's guard has its low bound at a tenth of the target
    (a `KLGuard` whose `lower_at` is 0.1 in place of the default one), which update 2's reading reaches."""
    from klppo.ppo.safety.kl_guard import KLGuard

    class TenthLowBound(KLGuard):
        lower_at = 0.1

    kw = dict(kl_target=0.02, kl_coef=0.1, kl_target_unit="token", save_strategy="steps", save_steps=1, max_steps=3)

    def trainer_in(name, **changes):
        trainer = make_trainer(
            tiny_path, prompts, make_args(tmp_path, output_dir=str(tmp_path / name), **{**kw, **changes})
        )
        assert trainer.args.experimental.kl_guard is True
        trainer.run.guard = TenthLowBound(trainer.args.kl_target)
        return trainer

    whole = trainer_in("whole")
    whole.train()
    assert whole.args.kl_controller == "equilibrium"
    saved = [
        json.load(open(tmp_path / "whole" / f"checkpoint-{n}" / "kl_controller.json"))["kl_guard_low_armed"]
        for n in (1, 2)
    ]
    assert saved == [False, True]  # update 1 reads 0 (the policy is the reference); update 2's reading arms it
    keys = ("kl/value", "kl/coef", "kl/coef_next", "objective/scores", "loss/policy", "kl/guard_low_fired")
    first = [[h[k] for k in keys] for h in whole.state.log_history if "kl/value" in h]
    for n in (1, 2):
        resumed = trainer_in(f"resumed{n}")
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{n}"))
        assert resumed.kl_controller.state_dict() == whole.kl_controller.state_dict()
        assert resumed.kl_guard.low_armed is whole.kl_guard.low_armed is True
        # the resumed log holds the updates up to the checkpoint from it, then its own
        again = [[h[k] for k in keys] for h in resumed.state.log_history if "kl/value" in h]
        assert len(first) == 3 and again == first
    # the flag comes from the checkpoint, not from a later reading: resumed at its last update, no update runs
    ended = trainer_in("ended", max_steps=2)
    ended.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert ended.state.global_step == 2 and ended.kl_guard.low_armed is True


def _sequence_classifier(tmp_path, name: str, config) -> str:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    path = tmp_path / name
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path


def test_reward_critic_needs_the_policy_vocabulary_and_causal_attention(tiny_path, prompts, tmp_path):
    """`critic_init="reward"` feeds the policy's token ids to a copy of the reward model: a causal reward model of
    the policy's tokenizer trains; one with another vocabulary, or a bidirectional one, is refused with the fix."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoTokenizer, BertConfig, PreTrainedTokenizerFast

    same = _sequence_classifier(tmp_path, "same", AutoConfig.from_pretrained(tiny_path, num_labels=1))
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(same)
    args = make_args(tmp_path, critic="separate", critic_init="reward")
    trainer = make_trainer(tiny_path, prompts, args, reward_funcs=str(same))
    before = {n: p.detach().clone() for n, p in trainer.model.critic.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.critic.named_parameters())

    other = _sequence_classifier(tmp_path, "other", AutoConfig.from_pretrained(tiny_path, num_labels=1))
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "good": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary differs from the policy's.*critic_init='policy'"):
        make_trainer(
            tiny_path, prompts, make_args(tmp_path, critic="separate", critic_init="reward"), reward_funcs=str(other)
        )

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    bert = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    bidirectional = _sequence_classifier(tmp_path, "bert", bert)
    tokenizer.save_pretrained(bidirectional)
    with pytest.raises(ValueError, match="not a causal"):
        make_trainer(
            tiny_path,
            prompts,
            make_args(tmp_path, critic="separate", critic_init="reward"),
            reward_funcs=str(bidirectional),
        )


def test_the_kv_cache_generation_decodes_into(tiny_path, prompts, tmp_path, caplog):
    """`cache_implementation`: "auto" decodes into the dynamic cache on a CPU (transformers compiles on accelerators
    only); "static" makes one cache per batch size of (longest prompt, at most max_prompt_length) + response_length
    positions and compiles with `generation_compile_config` over klppo's defaults; the scoring forward then gives the
    sampling log-probs (nothing is read inside the compiled step), and they equal an independent scoring pass's. A smaller batch decodes padded to
    the rollout's size. Without a max_prompt_length, "static" is refused and "auto" keeps the dynamic cache."""
    from peft import LoraConfig

    from klppo.ppo.generation.static_cache import supports_static_cache

    auto = make_trainer(tiny_path, prompts, make_args(tmp_path, critic="shared"))
    assert auto.sampler.static_caches is None and auto.kl_plan.read_while_decoding
    args = make_args(
        tmp_path,
        cache_implementation="static",
        max_prompt_length=8,
        critic="shared",
        experimental={"generation_compile_config": {"mode": "default"}},
    )
    trainer = make_trainer(tiny_path, prompts, args, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert trainer.sampler.static_caches is not None and trainer.sampler.static_caches.max_len == 8 + 6
    config = trainer.sampler.generation_config.compile_config
    assert (config.mode, config.dynamic, config.backend) == ("default", False, "inductor")
    assert not trainer.kl_plan.read_while_decoding
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:3]))  # 3 rows: padded to the rollout's 4
    assert rollout.responses.shape[0] == 3 and set(trainer.sampler.static_caches.caches) == {4}
    scored = trainer.score(rollout.sequences())
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.logp[mask], scored.logp[mask], rtol=1e-5, atol=1e-5)
    assert supports_static_cache(trainer.model.policy) and not supports_static_cache(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a `max_prompt_length`"):
        make_args(tmp_path, cache_implementation="static", max_prompt_length=None)
    with pytest.raises(ValueError, match="no field 'modes'.*mode, fullgraph"):
        make_args(tmp_path, experimental={"generation_compile_config": {"modes": "default"}})
    with pytest.raises(ValueError, match="'auto', 'static', 'dynamic'"):
        make_args(tmp_path, cache_implementation="offloaded")


def test_updates_with_a_skipped_step_count_as_a_streak_without_rollback(tiny_path, prompts, tmp_path, monkeypatch):
    """Full fine-tuning (no undo copy), two mini-batches per update, the second one's loss non-finite: every update
    applies one step and skips one. The next rollout finds the policy finite, but that does not end the streak of
    skipped updates: the second such update in a row stops training, as `max_nonfinite_updates=2` says."""
    from klppo.ppo.safety.nonfinite import TrainingDiverged

    args = make_args(tmp_path, max_steps=4, num_mini_batches=2, gradient_accumulation_steps=1, max_nonfinite_updates=2)
    trainer = make_trainer(tiny_path, prompts, args)
    assert not trainer.rollback_updates
    original, calls = trainer.loss_function, []

    def second_step_nan(*a, **k):
        loss, parts, sample = original()(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) % 2 == 0 else loss), parts, sample

    monkeypatch.setattr(trainer, "loss_function", lambda: second_step_nan)
    with pytest.raises(TrainingDiverged, match="2 PPO updates in a row"):
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.nonfinite_skips == 2


def test_a_stop_token_is_eos_or_any_one_token_given_as_its_text(tiny_path, prompts, tmp_path):
    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path, stop_token="<|im_start|>"))
    assert (
        trainer.sampler.stop_token_id
        == trainer.processing_class.convert_tokens_to_ids("<|im_start|>")
        != trainer.processing_class.eos_token_id
    )
    assert (
        make_trainer(tiny_path, prompts, make_args(tmp_path)).sampler.stop_token_id
        == trainer.processing_class.eos_token_id
    )
    with pytest.raises(ValueError, match="not one token of this tokenizer.*'eos'"):
        make_trainer(tiny_path, prompts, make_args(tmp_path, stop_token="no such token here"))
    with pytest.raises(ValueError, match="`stop_token` must be 'eos'"):
        make_args(tmp_path, stop_token="")


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_activation_checkpointing_comes_back_after_decoding_with_its_kwargs_even_when_a_rollout_raises(
    tiny_path, prompts, tmp_path, monkeypatch, critic
):
    """Decoding runs with activation checkpointing off; after each rollout it is on again in every part of the
    actor-critic with the kwargs the run gave (not transformers' defaults), and so after a rollout that raised."""
    # use_reentrant=True: transformers' default is False
    args = make_args(
        tmp_path, critic=critic, activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}
    )
    trainer = make_trainer(tiny_path, prompts, args)
    model = trainer.model

    def checkpointing() -> list[dict]:
        return [
            m._gradient_checkpointing_func.keywords
            for m in model.modules()
            if getattr(m, "gradient_checkpointing", False)
        ]

    on = checkpointing()
    assert on and all(k == {"use_reentrant": True} for k in on)
    batch = trainer.prompt_batch(list(prompts.select(range(4))))
    seen, score = [], trainer.scorer.score

    def scoring(*a, **k):
        seen.append(model.is_activation_checkpointing)
        return score(*a, **k)

    monkeypatch.setattr(trainer.scorer, "score", scoring)
    trainer.rollout(batch)
    assert seen == [False] and checkpointing() == on

    def failing(*a, **k):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(trainer.scorer, "score", failing)
    with pytest.raises(RuntimeError, match="scoring failed"):
        trainer.rollout(batch)
    assert checkpointing() == on
    monkeypatch.setattr(trainer.scorer, "score", score)
    trainer.train()  # and it trains
    assert checkpointing() == on


# ---------------------------------------------------------------------------------------------- the API as users call it
def test_a_peft_policy_trains_with_a_separate_critic_started_from_its_merged_weights(tiny_path, prompts, tmp_path):
    """A policy that already carries a LoRA adapter (no `peft_config`) and the default separate critic: the critic
    starts from the policy's weights as they are (the adapter merged into a plain copy, every weight trainable),
    not from the PEFT wrapper, and an update runs."""
    import copy

    import peft

    from klppo.models import load_causal_lm, load_tokenizer

    policy = peft.get_peft_model(load_causal_lm(tiny_path), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    torch.manual_seed(0)
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # a trained adapter: not the identity
            torch.nn.init.normal_(param, std=0.1)
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    trainer = KLPPOTrainer(
        model=policy,
        args=make_args(tmp_path, critic="separate"),
        train_dataset=prompts,
        processing_class=load_tokenizer(tiny_path),
        reward_funcs=length_reward,
    )
    backbone = dict(trainer.model.critic.backbone.named_parameters())
    assert not any("lora" in name for name in backbone) and all(p.requires_grad for p in backbone.values())
    torch.testing.assert_close(
        backbone["layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"]
    )
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        load_causal_lm(tiny_path).model.layers[0].self_attn.q_proj.weight,
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_lora_folder_a_run_saved_is_a_policy_again(tiny_path, prompts, tmp_path):
    """The folder a LoRA run saves, given as `model`, loads as its base with the adapter, trainable (a PeftModel), its
    reference a frozen copy of that adapter; training goes on from it. A model whose adapter transformers loaded
    is refused with the way to load it."""
    import peft
    from transformers import AutoModelForCausalLM

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    first = make_trainer(tiny_path, prompts, make_args(tmp_path / "a"), peft_config=lora)
    first.train()
    first.save_model(str(tmp_path / "lora"))
    again = make_trainer(str(tmp_path / "lora"), prompts, make_args(tmp_path / "b"))
    policy = again.model.policy
    assert isinstance(policy, peft.PeftModel) and again.use_adapter_reference and again.ref_adapter_name == "ref"
    trained = {n: p for n, p in first.model.policy.named_parameters() if "lora" in n}
    loaded = dict(policy.named_parameters())
    assert all(torch.equal(p, loaded[n]) and loaded[n].requires_grad for n, p in trained.items())
    again.train()
    assert again.state.global_step == 1
    from klppo.models import TINY_MODEL, adapter_base

    assert adapter_base(str(tmp_path / "lora")) == TINY_MODEL  # the cache folder named by its id: portable
    critic = make_trainer(
        tiny_path, prompts, make_args(tmp_path / "d", critic="separate"), value_model=str(tmp_path / "lora")
    )
    assert not any("lora" in n for n, _ in critic.model.critic.backbone.named_parameters())
    with pytest.raises(ValueError, match="PeftModel.from_pretrained"):
        make_trainer(
            AutoModelForCausalLM.from_pretrained(tmp_path / "lora"),
            prompts,
            make_args(tmp_path / "c"),
            processing_class=again.processing_class,
        )


def test_a_second_train_call_says_what_to_do(tiny_path, prompts, tmp_path):
    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path))
    trainer.train()
    with pytest.raises(RuntimeError, match="build a new KLPPOTrainer from `trainer.model`"):
        trainer.train()


def test_evaluate_is_the_policy_evaluation(tiny_path, prompts, tmp_path):
    trainer = make_trainer(tiny_path, prompts, make_args(tmp_path, heldout_eval_texts=2), eval_dataset=prompts)
    metrics = trainer.evaluate()
    assert set(metrics) == set(trainer.evaluate_policy()) and math.isfinite(metrics["eval/perplexity"])
    assert trainer.state.log_history[-1]["eval/perplexity"] == metrics["eval/perplexity"]


def test_a_value_model_path_of_a_sequence_classifier_keeps_its_head(
    tiny_path, prompts, tmp_path, tiny_reward_model_path
):
    """`value_model` given as the path of a one-output sequence classifier is its backbone and its `score` head,
    as the same model given as a module is."""
    from transformers import AutoModelForSequenceClassification

    trainer = make_trainer(
        tiny_path, prompts, make_args(tmp_path, critic="separate"), value_model=str(tiny_reward_model_path)
    )
    score = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path).score.weight
    head = [p for n, p in trainer.model.critic.head.named_parameters() if n.endswith("weight")]
    assert len(head) == 1 and torch.equal(head[0].detach(), score.detach())


def test_inputs_a_user_can_get_wrong_are_named_at_init(tiny_path, prompts, tmp_path):
    from datasets import DatasetDict

    from klppo.models import load_causal_lm, load_tokenizer

    args = make_args(tmp_path)
    cases = [
        (dict(model=tiny_path, train_dataset="a b"), TypeError, "must be a datasets.Dataset"),
        (dict(model=tiny_path, train_dataset=DatasetDict({"train": prompts})), TypeError, "pass one split"),
        (dict(model=tiny_path, train_dataset=[1, 2]), ValueError, "row 0 holds int 1"),
        (dict(model=tiny_path, eval_dataset=Dataset.from_dict({"text": ["a"]})), ValueError, "`eval_dataset` needs"),
        (dict(model=str(tmp_path / "no" / "such" / "model")), ValueError, "does not exist"),
    ]
    policy = load_causal_lm(tiny_path)
    cases.append((dict(model=policy, ref_model=policy), ValueError, "is the policy itself"))
    tokenizer = load_tokenizer(tiny_path)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # a new token the embeddings do not have
    cases.append((dict(model=load_causal_lm(tiny_path), processing_class=tokenizer), ValueError, "outside the policy"))
    for kwargs, error, match in cases:
        kwargs = {"train_dataset": prompts, **kwargs}
        with pytest.raises(error, match=match):
            KLPPOTrainer(args=args, reward_funcs=length_reward, **kwargs)


def test_prompts_given_as_lists_are_datasets(tiny_path, prompts, tmp_path):
    texts = list(prompts["prompt"])
    trainer = make_trainer(tiny_path, texts, make_args(tmp_path, heldout_eval_texts=2), eval_dataset=texts[:4])
    assert list(trainer.train_dataset["prompt"]) == texts and list(trainer.eval_prompts["prompt"]) == texts[:4]
    assert math.isfinite(trainer.evaluate_policy()["eval/scores"])


def test_numbered_names_never_repeat():
    from klppo.rewards import unique_names

    assert unique_names(["f", "f_2", "f", "g", "f"]) == ["f", "f_2", "f_3", "g", "f_4"]


def test_reward_functions_of_the_same_name_log_apart(tiny_path, prompts, tmp_path):
    trainer = make_trainer(
        tiny_path,
        prompts,
        make_args(tmp_path),
        reward_funcs=[
            lambda completions, **kw: [1.0] * len(completions),
            lambda completions, **kw: [2.0] * len(completions),
        ],
    )
    assert trainer.reward_func_names == ["<lambda>", "<lambda>_2"]
    trainer.train()
    assert (last_log(trainer)["rewards/<lambda>"], last_log(trainer)["rewards/<lambda>_2"]) == (1.0, 2.0)
