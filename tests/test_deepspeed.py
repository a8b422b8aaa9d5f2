"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU ranks (DeepSpeed's CPU accelerator, gloo), against DDP.

- One PPO update of 2 mini-batches x gradient accumulation 2 on the same saved rollout, with SGD (so that a wrong
  gradient scale shows in the weights): every engine takes 2 optimizer steps, moves the weights by the same update
  (within 1% of DDP's, in L2) and ends with the same coefficient.
- The tiny job under ZeRO-3, as `accelerate launch scripts/train.py` runs it: evaluation, checkpoints, the final
  save, and a resume from a checkpoint that reproduces the uninterrupted run's weights and controller state; and
  the same with LoRA and the adapter-disabled reference.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from test_trainer_distributed import WORKER, free_port, read_engine_run, run, update_difference

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import deepspeed  # noqa: E402,F401  (a test dependency, installed by scripts/setup.sh: missing, it fails)


def accelerate_config(tmp_path, stage: int) -> str:
    """The shipped CPU config for ZeRO-3; the same with ZeRO-2, written here."""
    if stage == 3:
        return os.path.join(ROOT, "configs", "accelerate", "deepspeed_zero3_cpu.yaml")
    path = tmp_path / f"zero{stage}.yaml"
    path.write_text(
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        f"  zero_stage: {stage}\n"
        f"  zero3_init_flag: {'true' if stage == 3 else 'false'}\n"
        "  offload_optimizer_device: none\n"
        "  offload_param_device: none\n"
        "mixed_precision: 'no'\n"
        "num_machines: 1\n"
        "num_processes: 2\n"
        "machine_rank: 0\n"
        "use_cpu: false\n"  # DeepSpeed runs on its CPU accelerator when there is no GPU
    )
    return str(path)


def accelerate_launch(config: str, script_args: list[str], tmp_path) -> None:
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config,
        "--main_process_port",
        str(free_port()),
    ]
    run(launcher + script_args, tmp_path)


@pytest.mark.ranks
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_update_equals_ddp(stage, engine_rollout, ddp_update, tmp_path):
    """One update of a saved rollout under ZeRO-2/3 equals DDP's. Before it each rank samples and scores a rollout
    of its own: under ZeRO-3 the scoring passes run on the weights gathered for generation, and must give what
    scoring through the engine gives (the sampled log-probs within float32's KV-cache difference); a rollout that raises
    first leaves the engine scoring as it did (ZeRO-3's hooks put back)."""
    accelerate_launch(
        accelerate_config(tmp_path, stage), [WORKER, "engine", str(engine_rollout), str(tmp_path), "0"], tmp_path
    )
    ddp_ranks, ddp_weights = read_engine_run(ddp_update)
    ranks, weights = read_engine_run(tmp_path)
    for r in ranks:  # ZeRO-3 scores the rollout on the gathered module, ZeRO-2 through the engine
        assert r["failed_rollout"] == "scoring failed" and r["after_failed_rollout_difference"] == 0.0
        assert r["rollout_scored_with"] == ["ActorCritic" if stage == 3 else "DeepSpeedEngine"]
        difference = r["rescored_difference"]
        assert difference["ref_logp"] < 1e-5 and difference["values"] < 1e-5 and difference["logp"] < 1e-4, difference
    assert [r["deepspeed"] for r in ranks] == [True, True] and ddp_ranks[0]["deepspeed"] is False
    assert all(r["world"] == 2 for r in ranks + ddp_ranks)
    # 2 mini-batches of 2 micro-batches: 2 optimizer steps, not one per micro-batch
    assert [r["steps"] for r in ranks] == [r["steps"] for r in ddp_ranks] == [2, 2]
    assert ranks[0]["coef_after"] == pytest.approx(ddp_ranks[0]["coef_after"], rel=1e-12)
    assert ranks[0]["kl_value"] == pytest.approx(ddp_ranks[0]["kl_value"], rel=1e-9, abs=1e-12)
    difference = update_difference(weights, ddp_weights)
    assert difference < 0.01, f"ZeRO-{stage}'s update differs from DDP's by {difference:.2%} (L2)"


def train_tiny(config: str, out, tmp_path, *extra: str) -> None:
    script = os.path.join(ROOT, "scripts", "train.py")
    args = [
        script,
        "--config",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--output_dir",
        str(out),
        "--use_cpu",
        "false",
        "--max_steps",
        "3",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--eval_steps",
        "1",
        *extra,
    ]
    accelerate_launch(config, args, tmp_path)


def trainable(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "klppo_trainable.safetensors"))


@pytest.mark.ranks
def test_zero3_tiny_job_evaluates_saves_and_resumes_exactly(tiny_model_path, tmp_path):  # built before the ranks start
    from transformers import AutoModelForCausalLM

    config = accelerate_config(tmp_path, 3)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_tiny(config, whole, tmp_path)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["updates"] == 3 and summary["perplexity_before"] > 0 and summary["perplexity_after"] > 0
    state = json.loads((whole / "trainer_state.json").read_text())
    assert any("eval/perplexity" in h for h in state["log_history"])
    # the final save is the full policy, loadable as a plain model with finite logits
    model = AutoModelForCausalLM.from_pretrained(whole)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    saved, last = trainable(whole), trainable(whole / "checkpoint-3")
    assert saved.keys() == last.keys() and all(v.numel() > 0 for v in saved.values())
    assert any(not torch.equal(last[k], trainable(whole / "checkpoint-2")[k]) for k in last)  # the 3rd update moved

    train_tiny(config, resumed, tmp_path, "--resume_from_checkpoint", str(whole / "checkpoint-2"))
    assert sorted(os.listdir(resumed)).count("checkpoint-3") == 1 and not (resumed / "checkpoint-2").exists()
    again = trainable(resumed / "checkpoint-3")
    for name, value in last.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=f"{name} differs after resuming")
    controllers = [
        json.loads((d / "checkpoint-3" / "kl_controller.json").read_text())["kl_controller"] for d in (whole, resumed)
    ]
    assert controllers[0] == controllers[1]


@pytest.mark.ranks
def test_zero3_lora_with_adapter_disabled_reference(tiny_model_path, tmp_path):
    out = tmp_path / "lora"
    train_tiny(
        accelerate_config(tmp_path, 3),
        out,
        tmp_path,
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--learning_rate",
        "0.01",
    )
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(v.numel() > 0 and torch.isfinite(v).all() for v in adapter.values())
    state = json.loads((out / "trainer_state.json").read_text())
    kls = [h["kl/k3"] for h in state["log_history"] if "kl/k3" in h]  # k3 >= 0: no sampling sign noise
    assert len(kls) == 3 and kls[0] < 1e-7  # the reference is the starting policy: no KL at the first rollout
    assert kls[-1] > 1e-4  # and the adapter has moved the policy away from it


def test_rollback_is_refused_under_deepspeed_at_parse_time(monkeypatch, tmp_path):
    from klppo import KLPPOConfig

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch` sets it
    with pytest.raises(ValueError, match="nonfinite_rollback=True is not available under DeepSpeed.*Leave"):
        KLPPOConfig(output_dir=str(tmp_path), experimental={"nonfinite_rollback": True}, report_to="none")


@pytest.mark.ranks
@pytest.mark.slow
def test_zero3_reads_the_lm_head_in_blocks_as_in_one(tiny_model_path, tmp_path):
    """ZeRO-3 with LoRA, the adapter-disabled reference and the exact KL in the loss and the reward: the LM heads read
    one position at a time (each block checkpointed, its logits made again in the backward pass, the partitioned head
    gathered by its hooks each time) train the adapter as one block does."""
    config = accelerate_config(tmp_path, 3)
    adapters = {}
    for name, budget in (("one", 256.0), ("blocks", 1e-6)):
        out = tmp_path / name
        train_tiny(
            config,
            out,
            tmp_path,
            "--use_peft",
            "true",
            "--lora_r",
            "4",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--learning_rate",
            "0.01",
            "--kl_mode",
            "both",
            "--kl_estimator",
            "full",
            "--reward_funcs",
            os.path.join(ROOT, "tests", "dist_trainer_worker.py") + ":token_reward",
            "--experimental",
            json.dumps({"logits_block_mb": budget}),
        )
        from safetensors.torch import load_file

        adapters[name] = load_file(out / "adapter_model.safetensors")
    assert adapters["one"].keys() == adapters["blocks"].keys()
    trained = [k for k in adapters["one"] if "lora_B" in k]  # zero at the start: what the updates wrote
    one = torch.cat([adapters["one"][k].flatten() for k in trained])
    blocks = torch.cat([adapters["blocks"][k].flatten() for k in trained])
    assert one.norm() > 1e-3
    assert (blocks - one).norm() / one.norm() < 1e-3
