"""`klppo.integrations.trl.add_kl_control` on TRL's own GRPOTrainer and RLOOTrainer (tiny Llama, CPU): on the
one-token bandit the default (equilibrium) controller holds a target KL, measured exactly from the logits, at the
beta whose fixed point has it; beta moves toward the target, `kl/coef` is logged every step, a resumed run continues

with the checkpointed controller, beta = 0 and fields that are not the controller's are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from klppo.integrations.trl import (
    CONTROLLER_STATE_NAME,
    add_kl_control,
    controller_fields,
)
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.ppo.advantages import advantage_slope
from klppo.testing.bandit import (
    PROMPT,
    coefficient_for_target,
    grpo_coefficient_for_target,
    in_set,
    kl,
    one_token_reward,
    tilted,
)

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

TRAINERS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


def even_reward(prompts, completions, completion_ids=None, **kwargs):
    """The fraction of even token ids: varies between completions of the tiny random model."""
    return [sum(i % 2 == 0 for i in ids) / max(1, len(ids)) for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


PROMPTS = ["The day was", "My friend said", "A letter came", "It rained"] * 4


@pytest.fixture(scope="module")
def prompts():
    return Dataset.from_dict({"prompt": PROMPTS})


def make_trainer(kind, tiny_path, prompts, output_dir, **overrides):
    config_cls, trainer_cls = TRAINERS[kind]
    base = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=5,
        logging_steps=1,
        report_to="none",
        beta=0.05,
        learning_rate=1e-3,
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    args = config_cls(**{**base, **overrides})
    return trainer_cls(model=tiny_path, reward_funcs=even_reward, args=args, train_dataset=prompts)


def step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "kl/coef" in h]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_beta_moves_toward_the_target_and_kl_coef_is_logged_every_step(kind, tiny_path, prompts, tmp_path):
    """The tracking controller, target far below TRL's KL (1e-6 nats per token, with a learning rate that moves the
    policy): beta ends above where it started. Far above (100 per token): beta falls and never
    rises. The exponential controller moves beta up after every reading above the target and down after every
    reading below (RLOO's k1 reading can be negative)."""
    below = add_kl_control(
        make_trainer(kind, tiny_path, prompts, tmp_path / "below", learning_rate=1e-2),
        kl_controller="tracking",
        kl_target=1e-6,
        kl_target_unit="token",
    )
    below.train()
    logs = step_logs(below)
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5]  # kl/coef on every step
    assert logs[0]["kl/coef"] == 0.05  # beta starts from the trainer's own
    assert all(h["kl/value"] == h["kl"] and h["kl/target"] == 1e-6 for h in logs)  # TRL's KL is the reading
    assert below.beta > 0.05 and below.beta == below.kl_control.controller.value

    above = add_kl_control(
        make_trainer(kind, tiny_path, prompts, tmp_path / "above"),
        kl_controller="tracking",
        kl_target=100.0,
        kl_target_unit="token",
    )
    above.train()
    coefs = [h["kl/coef"] for h in step_logs(above)] + [above.beta]
    assert all(b <= a for a, b in zip(coefs, coefs[1:])) and above.beta < 0.05, coefs

    target = 1e-4
    steady = add_kl_control(
        make_trainer(kind, tiny_path, prompts, tmp_path / "exp", learning_rate=1e-2),
        kl_controller="exponential",
        kl_target=target,
        kl_target_unit="token",
        kl_controller_kwargs={"rate": 100.0},
    )
    assert steady.kl_control.controller.rate == 100.0
    steady.train()
    logs = step_logs(steady)
    coefs = [h["kl/coef"] for h in logs] + [steady.beta]
    for h, before, after in zip(logs, coefs, coefs[1:]):
        assert (after > before) if h["kl/value"] > target else (after < before), (h["kl/value"], before, after)
    assert any(h["kl/value"] > target for h in logs) and any(h["kl/value"] < target for h in logs)


def bandit_state(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact `log softmax` of the policy's and the reference's next token after the bandit's prompt (float64)."""
    ids = torch.tensor([trainer.processing_class(PROMPT)["input_ids"]])
    with torch.no_grad():
        logp, ref = (
            torch.log_softmax(m(input_ids=ids).logits[0, -1].double(), -1) for m in (trainer.model, trainer.ref_model)
        )
    return logp, ref


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("start", [0.2, 5.0])
def test_equilibrium_holds_a_bandit_target_at_the_beta_of_its_fixed_point(kind, start, tiny_path, tmp_path):
    """One-token bandit (reward 1 for token ids divisible by 4), 64 completions in groups of 4 per step, the target
    KL(pi*_0.5 || ref), beta from 5x below and 5x above beta*. beta* is the coefficient whose fixed point has that
    KL: for RLOO (k1 in the reward) the tilt's, 0.5; for GRPO (k3 in the loss, group-normalised advantages) the
    forward-KL optimum's at beta / Delta_G(q). The KL at the end, exact from the logits, is within 15% of the target,
    and beta's second-half mean within x/1.3 of beta*: measured 0.93x-0.97x and 1.08x (RLOO), 1.18x (GRPO). (A fixed
    beta* itself ends GRPO at 1.14-1.21x the target KL: the noise of the steps adds KL.)"""
    config_cls, trainer_cls = TRAINERS[kind]
    args = config_cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=64,
        num_generations=4,
        max_completion_length=1,
        max_steps=200,
        logging_steps=1,
        report_to="none",
        beta=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = trainer_cls(
        model=tiny_path,
        reward_funcs=one_token_reward(),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 64}),
    )
    logp, ref = bandit_state(trainer)
    reward = in_set(torch.arange(ref.shape[0]))
    target = kl(tilted(ref, reward, 0.5), ref)
    if kind == "rloo":
        beta_star = coefficient_for_target(ref, reward, target)
    else:
        beta_star = grpo_coefficient_for_target(ref, reward, target, group=4, forward=True)
    assert kl(logp, ref) < 1e-6 and beta_star == pytest.approx(0.5 if kind == "rloo" else 0.629, abs=1e-3)
    trainer.beta = start * beta_star
    add_kl_control(trainer, kl_target=target, kl_target_unit="token")
    assert trainer.kl_control.settings.kl_controller == "equilibrium"
    trainer.train()
    logp, ref = bandit_state(trainer)
    logs = step_logs(trainer)
    second = [h["kl/coef"] for h in logs[len(logs) // 2 :]]
    assert kl(logp, ref) == pytest.approx(target, rel=0.15)
    assert 1 / 1.3 < sum(second) / len(second) / beta_star < 1.3
    assert max(h["kl/value"] for h in logs) <= 3 * target
    assert all("kl/coef_estimate" in h and 0 < h["kl/ess"] <= 1 for h in logs)


def read_batches(trainer) -> list:
    """Every batch the controller is handed, as (scores, log_ratios, lengths)."""
    seen, observe = [], trainer.kl_control.controller.observe_sequences
    trainer.kl_control.controller.observe_sequences = lambda *a, **k: (seen.append(a), observe(*a, **k))
    return seen


def test_the_sequences_read_are_trls(tiny_path, prompts, tmp_path):
    """RLOO: the reader's log-ratios and lengths give TRL's own logged KL (its token mean of k1), and its scores
    are TRL's rewards. GRPO: the scores are TRL's rewards times the slope of TRL's advantages on them."""
    for kind in ("rloo", "grpo"):
        trainer = add_kl_control(
            make_trainer(kind, tiny_path, prompts, tmp_path / kind, max_steps=3, learning_rate=1e-2), kl_target=1.0
        )
        seen = read_batches(trainer)
        trainer.train()
        assert len(seen) == 3  # one generation batch per step
        scores, log_ratios, lengths = seen[-1]  # after two updates: the policy has left the reference
        assert scores.shape == log_ratios.shape == lengths.shape == (4,)  # one generation batch
        assert lengths.min() >= 1 and log_ratios.abs().max() > 0
        rewards = torch.tensor(list(trainer._logs["rewards"]["even_reward"])[-4:], dtype=torch.float64)
        if kind == "rloo":
            assert float(log_ratios.sum() / lengths.sum()) == pytest.approx(step_logs(trainer)[-1]["kl"], rel=1e-5)
            assert torch.allclose(scores, rewards)
        else:
            advantages = torch.tensor(list(trainer._logs["advantages"])[-4:], dtype=torch.float64)
            slope = advantage_slope(advantages, rewards, 4)
            assert slope > 0 and torch.allclose(scores, rewards * slope)


def test_grpo_off_policy_and_several_generations_per_step_are_read(tiny_path, prompts, tmp_path):
    """Off-policy (one generation for two steps) the reader takes TRL's own log-probs of the sampling policy; two
    generations in one optimizer step are read together."""
    off = add_kl_control(
        make_trainer("grpo", tiny_path, prompts, tmp_path / "off", max_steps=4, steps_per_generation=2), kl_target=1.0
    )
    seen = read_batches(off)
    off.train()
    assert [len(batch[0]) for batch in seen] == [8, 8]  # a generation batch every second step
    two = add_kl_control(
        make_trainer(
            "grpo",
            tiny_path,
            prompts,
            tmp_path / "two",
            max_steps=2,
            gradient_accumulation_steps=2,
            steps_per_generation=1,
        ),
        kl_target=1.0,
    )
    seen = read_batches(two)
    two.train()
    assert [len(batch[0]) for batch in seen] == [8, 8]  # two generations of 4 per optimizer step
    assert all(torch.isfinite(t).all() for batch in seen for t in batch)


def test_grpo_settings_that_change_its_objective_get_the_tracking_controller(tiny_path, prompts, tmp_path, caplog):
    trainer = make_trainer("grpo", tiny_path, prompts, tmp_path, top_entropy_quantile=0.5)
    with caplog.at_level("WARNING", logger="klppo.integrations.trl"):
        add_kl_control(trainer, kl_target=1.0)
    assert trainer.kl_control.settings.kl_controller == "tracking" and trainer.kl_control.reader is None
    assert "top_entropy_quantile=0.5 masks the policy term" in caplog.text
    with pytest.raises(ValueError, match="'equilibrium'.*top_entropy_quantile.*kl_controller='tracking'"):
        add_kl_control(
            make_trainer("grpo", tiny_path, prompts, tmp_path, top_entropy_quantile=0.5),
            kl_controller="equilibrium",
            kl_target=1.0,
        )


def test_sequence_unit_is_the_token_mean_times_the_mean_completion_length(tiny_path, prompts, tmp_path):
    trainer = add_kl_control(
        make_trainer("rloo", tiny_path, prompts, tmp_path, max_steps=2), kl_target=1e-3, kl_controller="exponential"
    )
    assert trainer.kl_control.settings.kl_target_unit == "sequence"  # KLPPOConfig's default
    trainer.train()
    for h in step_logs(trainer):
        assert h["kl/value"] == pytest.approx(h["kl"] * h["completions/mean_length"], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_resume_continues_with_the_checkpointed_controller(kind, tiny_path, prompts, tmp_path):
    """4 steps saved every 2; a new trainer (another output folder) resumed from checkpoint-2 logs, at step 3,
    the coefficient the uninterrupted run logged there, not the trainer's initial beta."""
    kw = dict(kl_target=1e-6, kl_target_unit="token")
    full = add_kl_control(
        make_trainer(kind, tiny_path, prompts, tmp_path / "full", max_steps=4, save_strategy="steps", save_steps=2),
        **kw,
    )
    full.train()
    coefs = {h["step"]: h["kl/coef"] for h in step_logs(full)}
    checkpoint = tmp_path / "full" / "checkpoint-2"
    with open(checkpoint / CONTROLLER_STATE_NAME) as f:
        saved = json.load(f)["kl_controller"]
    assert saved["n_updates"] == 2 and saved["value"] == coefs[3] != 0.05

    resumed = add_kl_control(make_trainer(kind, tiny_path, prompts, tmp_path / "resumed", max_steps=4), **kw)
    assert resumed.beta == 0.05
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after = [h for h in step_logs(resumed) if h["step"] > 2]  # the history before comes from the checkpoint
    assert after[0]["step"] == 3 and after[0]["kl/coef"] == coefs[3]
    assert resumed.kl_control.controller.n_updates == 4


def test_beta_zero_is_refused(tiny_path, prompts, tmp_path):
    trainer = make_trainer("grpo", tiny_path, prompts, tmp_path, beta=0.0)
    with pytest.raises(ValueError, match=r"beta=0\.0.*no reference model and computes no KL.*positive beta"):
        add_kl_control(trainer, kl_target=0.05)


def test_only_controller_fields_are_taken_and_checked_like_klppoconfig(tiny_path, prompts, tmp_path):
    trainer = make_trainer("rloo", tiny_path, prompts, tmp_path)
    assert controller_fields() == ("kl_controller", "kl_controller_kwargs", "kl_target", "kl_target_unit")
    with pytest.raises(ValueError, match="does not take `kl_horizon`; its fields are: .*kl_controller_kwargs"):
        add_kl_control(trainer, kl_target=1.0, kl_horizon=64)  # a constant goes in kl_controller_kwargs
    with pytest.raises(ValueError, match="does not take `kl_guard`"):  # klppo's guard acts inside its own updates
        add_kl_control(trainer, kl_target=1.0, kl_guard=True)
    with pytest.raises(ValueError, match="'adaptive' has no constant 'kp'.*horizon"):
        add_kl_control(trainer, kl_controller="adaptive", kl_target=1.0, kl_controller_kwargs={"kp": 0.1})
    with pytest.raises(ValueError, match="starts from the trainer's own `beta`"):
        add_kl_control(trainer, kl_coef=0.1)
    with pytest.raises(ValueError, match="TRL decides where the KL acts"):
        add_kl_control(trainer, kl_mode="loss")
    with pytest.raises(ValueError, match="kl_target_unit.*Choose one of: 'token', 'sequence'"):
        add_kl_control(trainer, kl_target=1.0, kl_target_unit="batch")
    with pytest.raises(ValueError, match="needs a positive `kl_target`"):
        add_kl_control(trainer, kl_controller="adaptive")
    with pytest.raises(TypeError, match="GRPOTrainer and RLOOTrainer"):
        add_kl_control(object())
    assert getattr(trainer, "kl_control", None) is None  # nothing was registered by the refused calls


def test_the_example_runs_offline_on_the_tiny_model(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_kl_control.py"
    spec = importlib.util.spec_from_file_location("grpo_kl_control", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer = example.main(
        ["--model", "klppo:tiny-llama", "--max_steps", "2", "--batch", "16", "--output_dir", str(tmp_path)]
    )
    assert [h["step"] for h in step_logs(trainer)] == [1, 2]
    assert trainer.kl_control.settings.kl_controller == "equilibrium" and "kl/coef" in capsys.readouterr().out


@pytest.mark.ranks
def test_two_processes_read_every_ranks_completions_and_hold_one_beta(tiny_path, tmp_path):
    """torchrun, 2 processes (gloo), RLOO and GRPO with `add_kl_control`, 4 steps: each step's batch handed to the
    controller is both ranks' completions (8 = 2 x 4), the same on both ranks; beta is the same on both ranks at every
    step and after the last; the batch's log-ratios give TRL's logged KL (RLOO, gathered over ranks) and its scores
    are TRL's rewards (times the slope of TRL's advantages for GRPO)."""
    from test_trainer_distributed import free_port, run

    worker = str(Path(__file__).parent / "trl_kl_control_worker.py")
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            worker,
            str(tmp_path),
            str(tiny_path),
        ],
        tmp_path,
    )
    for kind in ("rloo", "grpo"):
        ranks = [json.loads((tmp_path / f"{kind}_rank{r}.json").read_text()) for r in range(2)]
        assert [r["world"] for r in ranks] == [2, 2]
        assert ranks[0]["batches"] == ranks[1]["batches"]
        betas = [r["coef"] + [r["final_beta"]] for r in ranks]
        assert betas[0] == betas[1]
        batches, record = ranks[0]["batches"], ranks[0]
        assert len(batches) == len(record["coef"]) == 4
        assert all(len(column) == 8 for batch in batches for column in batch)
        scores, log_ratios, lengths = (torch.tensor(c, dtype=torch.float64) for c in batches[-1])
        assert log_ratios.abs().max() > 0  # the policy has left the reference
        rewards = torch.tensor(record["rewards"][-8:], dtype=torch.float64)
        if kind == "rloo":
            assert float(log_ratios.sum() / lengths.sum()) == pytest.approx(record["kl"][-1], rel=1e-5)
            assert torch.allclose(scores, rewards)
        else:
            slope = advantage_slope(torch.tensor(record["advantages"][-8:], dtype=torch.float64), rewards, 4)
            assert slope > 0 and torch.allclose(scores, rewards * slope)
        # beta moved after the policy left the reference (the first step's KL is 0 and puts beta at its bound)
        assert len(set(record["coef"][2:] + [record["final_beta"]])) > 1
