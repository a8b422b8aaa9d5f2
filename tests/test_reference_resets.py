"""Reference resets (`ref_reset_steps`) and critic warm-up (`critic_warmup_steps`).

Resets: a frozen copy takes the policy's weights; a LoRA policy merges its adapter into the base weights and
starts a new one, so the policy does not move and the adapter-disabled policy is the policy of the reset. On the
one-token bandit with a fixed beta, k segments each trained to its optimum give `ref0 * exp(k r / beta) / Z`
(each segment tilts the previous optimum once more). A resumed run continues exactly, the reference included.
Warm-up: the first updates train the critic alone; the policy does not change, bit for bit, nor the coefficient.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from klppo import KLPPOTrainer
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.testing import klppo_config
from klppo.testing.bandit import bandit_trainer, kl, one_token_state, tilted

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

BETA = 0.5
PROMPTS = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"] * 4})


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [len(ids) / 8.0 + (ids[0] % 3 == 0) for ids in completion_ids]


def small_trainer(tiny_path, tmp_path, lora: bool = True, **overrides) -> KLPPOTrainer:
    args = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_ppo_epochs=2,
        max_steps=4,
        response_length=5,
        learning_rate=5e-2 if lora else 1e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        critic="shared",
        seed=0,
        lr_scheduler_type="constant",
    )
    args.update(overrides)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    return KLPPOTrainer(
        model=tiny_path, args=klppo_config(**args), train_dataset=PROMPTS, reward_funcs=length_reward, peft_config=peft
    )


@torch.no_grad()
def logits_of(trainer, reference: bool = False) -> torch.Tensor:
    """The policy's logits on four prompts, or the reference's (a frozen copy, or the adapter-disabled policy)."""
    ids = trainer.prompt_batch(PROMPTS["prompt"][:4])
    inputs = dict(input_ids=ids.input_ids, attention_mask=ids.attention_mask)
    policy = trainer.model.policy
    if not reference:
        return policy(**inputs).logits
    if trainer.ref_model is not None:
        return trainer.ref_model(**inputs).logits
    with policy.disable_adapter():
        return policy(**inputs).logits


@pytest.mark.parametrize("lora", [True, False])
def test_a_reset_makes_the_reference_the_policy_and_leaves_the_policy(tiny_path, tmp_path, lora):
    trainer = small_trainer(tiny_path, tmp_path, lora=lora, ref_reset_steps=2, max_steps=2)
    trainer.train()
    before = logits_of(trainer)
    assert not torch.allclose(before, logits_of(trainer, reference=True), atol=1e-3)  # training moved the policy
    trainer.reset_reference()
    torch.testing.assert_close(logits_of(trainer), before, rtol=0, atol=2e-5)  # merging rounds, nothing more
    torch.testing.assert_close(logits_of(trainer, reference=True), before, rtol=0, atol=2e-5)
    rollout = trainer.rollout(trainer.prompt_batch(PROMPTS["prompt"][:4]))
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.ref_logp[mask], rollout.logp[mask], rtol=0, atol=5e-5)
    assert trainer.reference_resets == 1 and trainer.run.initial_reference is not None
    if lora:  # a new adapter: B starts at zero again
        assert all(float(p.abs().max()) == 0 for n, p in trainer.model.policy.named_parameters() if "lora_B" in n)


def test_a_run_with_resets_logs_the_kl_to_the_initial_model_and_resumes_exactly(tiny_path, tmp_path):
    """Resets every 2 updates over 5: after each, `kl/value` restarts from near 0 while `kl/initial` (the KL to the
    model training started from) does not; resumed from checkpoint-3 (one reset behind it), the run ends with the
    same weights, reference, initial reference and controller state as the run that was never interrupted."""
    kw = dict(
        ref_reset_steps=2,
        max_steps=5,
        save_strategy="steps",
        save_steps=1,
        kl_target=0.5,
        kl_coef=0.1,
        kl_target_unit="sequence",
    )
    whole = small_trainer(tiny_path, tmp_path / "whole", **kw)
    whole.train()
    logs = [h for h in whole.state.log_history if "kl/value" in h]
    assert [h["kl/reference_resets"] for h in logs] == [0, 0, 1, 1, 2]
    assert logs[2]["kl/value"] < 1e-3 < logs[1]["kl/value"]  # to the new reference, which the policy is: 0 again
    assert logs[2]["kl/initial"] > 0.05 and "kl/initial" not in logs[1]  # to the initial model it is not
    resumed = small_trainer(tiny_path, tmp_path / "resumed", **{**kw, "output_dir": str(tmp_path / "resumed" / "out")})
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "out" / "checkpoint-3"))
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.reference_resets == whole.reference_resets == 2
    for name, tensor in whole.run.initial_reference.items():
        assert torch.equal(tensor, resumed.run.initial_reference[name]), name
    assert resumed.kl_controller.state_dict() == whole.kl_controller.state_dict()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole" / "out" / "checkpoint-5"))
    whole.save_model(str(tmp_path / "final"))  # a reset LoRA policy is saved merged, whole
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    ids = whole.prompt_batch(PROMPTS["prompt"][:4])
    torch.testing.assert_close(
        final(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits, logits_of(whole), rtol=0, atol=2e-5
    )
    assert saved is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        dict(kl_mode="reward", kl_estimator="k1"),
        # k2 in the loss has the reverse KL's gradient, so the same optimum; the learning rate restarts with the
        # reference (a cosine schedule of two cycles), as the loss-mode test of the single segment decays it
        dict(
            kl_mode="loss",
            kl_estimator="k2",
            lr_scheduler_type="cosine_with_restarts",
            lr_scheduler_kwargs={"num_cycles": 2},
        ),
    ],
    ids=["reward-k1", "loss-k2"],
)
def test_the_bandit_with_resets_lands_on_the_k_times_tilted_optimum(tiny_path, tmp_path, mode):
    """A fixed beta, a reset every 120 updates (240 in loss mode): each segment trains to the tilt of its
    reference, so after 2 segments the policy is `ref0 * exp(2 r / beta) / Z` (the tilt with beta / 2), measured
    exactly from the logits, while the reference of the second segment is the first segment's optimum."""
    steps = 120 if mode["kl_mode"] == "reward" else 240  # per segment: the single segment's count
    trainer = bandit_trainer(tiny_path, tmp_path, max_steps=2 * steps, ref_reset_steps=steps, **mode)
    start = one_token_state(trainer)
    once, twice = tilted(start["ref"], start["reward"], BETA), tilted(start["ref"], start["reward"], BETA / 2)
    assert kl(start["logp"], twice) > 1.0
    trainer.train()
    end = one_token_state(trainer)
    tolerance = 0.03 if mode["kl_mode"] == "reward" else 0.06  # the single segment's tolerances
    assert kl(end["ref"], once) < tolerance  # the reference is the first segment's optimum
    assert kl(end["logp"], twice) < tolerance
    assert trainer.reference_resets == 1


def test_critic_warmup_leaves_the_policy_and_the_coefficient_bit_for_bit(tiny_path, tmp_path):
    """Two warm-up updates with LoRA and the shared critic: the policy's weights (adapter and base) are equal bit for
    bit, the value head moved, the optimizer holds no state for the policy's weights, and the KL coefficient did
    not move; the third update moves the policy. The same with a separate critic under full fine-tuning."""
    for lora, critic in ((True, "shared"), (False, "separate")):
        trainer = small_trainer(
            tiny_path,
            tmp_path / critic,
            lora=lora,
            critic=critic,
            critic_warmup_steps=2,
            max_steps=2,
            kl_target=0.5,
            kl_coef=0.1,
            weight_decay=0.1,
        )
        policy = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
        critic_before = {
            n: p.detach().clone()
            for n, p in trainer.model.named_parameters()
            if p.requires_grad and not n.startswith("policy.")
        }
        trainer.train()
        for name, param in trainer.model.policy.named_parameters():
            assert torch.equal(param, policy[name]), name
        moved = [
            n
            for n, p in trainer.model.named_parameters()
            if n in critic_before and not torch.equal(p, critic_before[n])
        ]
        assert moved
        held = {id(p) for p in trainer.optimizer.optimizer.state}
        assert not any(id(p) in held for p in trainer.model.policy.parameters())
        assert trainer.kl_controller.value == 0.1
        logs = [h for h in trainer.state.log_history if "kl/value" in h]
        assert [h["train/critic_warmup"] for h in logs] == [1.0, 1.0]
        assert all(h["kl/coef_next"] == 0.1 for h in logs)
    trainer = small_trainer(tiny_path, tmp_path / "after", critic_warmup_steps=2, max_steps=3)
    policy = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(p, policy[n]) for n, p in trainer.model.policy.named_parameters() if n in policy)


def test_warmup_and_resets_refuse_what_they_cannot_do(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="critic_warmup_steps=2.*no critic"):
        klppo_config(**base, critic_warmup_steps=2, advantage_estimator="rloo")
    with pytest.raises(ValueError, match="critic_warmup_steps=2.*ddp_find_unused_parameters unset"):
        klppo_config(**base, critic_warmup_steps=2, ddp_find_unused_parameters=False)
    assert klppo_config(**base, critic_warmup_steps=2).ddp_find_unused_parameters is True
    assert klppo_config(**base).ddp_find_unused_parameters is False
    with pytest.raises(ValueError, match="ref_reset_steps.*>= 0"):
        klppo_config(**base, ref_reset_steps=-1)
    import os

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        with pytest.raises(ValueError, match="critic_warmup_steps` is not available under DeepSpeed"):
            klppo_config(**base, critic_warmup_steps=2)
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def test_the_drift_monitor_follows_the_target_in_force_after_a_resume_and_a_reset(tmp_path):
    """`kl_target` may change at a resume (the new one is used): the drift monitor then starts a new band at the new
    target, instead of the checkpoint's streak at the old one, and a reference reset builds it at the new one too."""
    from klppo import KLPPOConfig
    from klppo.ppo.plan import make_kl_plan
    from klppo.ppo.run.state import RunState

    def run_state(target, patience=5):
        args = KLPPOConfig(
            output_dir=str(tmp_path),
            report_to="none",
            kl_target=target,
            use_cpu=True,
            experimental={"kl_drift_patience": patience},
        )
        plan = make_kl_plan(args, torch.nn.Linear(2, 2), mixed_precision=False, vocab_size=8)
        return RunState.build(args, plan, None, log=False)

    saved = run_state(4.0)
    for _ in range(3):
        saved.drift.update(9.0)
    same, changed, patient = run_state(4.0), run_state(2.0), run_state(4.0, patience=9)
    for state in (same, changed, patient):
        state.load_state_dict(saved.state_dict())
    assert same.drift.state_dict() == saved.drift.state_dict()
    assert (patient.drift.patience, patient.drift.streak) == (9, 0)
    assert (changed.drift.target, changed.drift.streak) == (2.0, 0)
    changed.drift.target = 9.0  # the reset builds the monitor from the run's settings, not from the one it replaces
    reference = {"w": torch.ones(2)}
    changed.reference_reset(reference)
    assert changed.drift.target == 2.0 and changed.reference_resets == 1
    reference["w"] += 1  # the reference moves on; the state keeps it as it was before the first reset
    changed.reference_reset(reference)
    assert changed.reference_resets == 2 and torch.equal(changed.initial_reference["w"], torch.ones(2))
