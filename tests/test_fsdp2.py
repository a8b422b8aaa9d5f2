"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on CPU with gloo.

One process, `fully_shard` without accelerate: the actor-critic names its transformer blocks for the
transformer-based wrap, and a forward that enters through the policy instead of the FSDP root works only with the
root unsharded, and then gives the unsharded model's logits (generation likewise); a checkpoint's whole weights load
into the shards. The sharding runs in a subprocess (this file run as a script), so that its process group does not
leak into the other tests.

Two ranks, the trainer under accelerate's FSDP2, launched as the shipped `configs/accelerate/fsdp.yaml` launches it
(`accelerate launch`, which starts the ranks with torchrun), with 2 processes in float32. accelerate turns FSDP on
only on GPUs; on CPU ranks the worker (`dist_trainer_worker.fsdp_on_cpu`) does for them what accelerate does for
GPUs, and from there every step is accelerate's and klppo's own code:

- sampling where one rank's response ends at the stop token after 2 tokens while the other's runs to full length,
  and an evaluation whose one prompt only one rank holds: the ranks keep stepping together, each rank's tokens are
  those it samples alone from the same seed, and the evaluation scores as one process does;
- then one PPO update of a saved rollout (2 mini-batches x gradient accumulation 2, SGD) ends with DDP's weights and
  coefficient;
- the tiny job saves a checkpoint, resumes from it in a new run to the uninterrupted run's weights and controller
  state, and saves a policy that loads with `from_pretrained`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import once_per_session
from test_trainer_distributed import WORKER, free_port, read_engine_run, run, update_difference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP_CONFIG = os.path.join(ROOT, "configs", "accelerate", "fsdp.yaml")


def test_fsdp2_root_unsharded_for_off_root_forwards(tiny_model_path, tmp_path):
    out = tmp_path / "fsdp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["no_split_modules"] == ["LlamaDecoderLayer"]
    assert result["wrapped_blocks"] == 2  # the tiny Llama's two decoder layers, found from that name
    assert result["sharded_root_param"] is True
    assert "DTensor" in result["error_without_unshard"]  # the pitfall: the root's weights are still sharded
    assert result["logits_match"] is True and result["generation_matches"] is True
    assert result["resharded_after"] is True
    assert result["root_forward_after_off_root_matches"] is True
    assert result["loaded_logits_match"] is True and result["loaded_differs_from_before"] is True


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_actor_critic_ties_its_lm_head_again_after_the_meta_device(lora):
    """accelerate's FSDP2 preparation with `cpu_ram_efficient_loading` (as `configs/accelerate/fsdp.yaml` sets it)
    moves the model to the meta device, which unties a tied LM head from its embedding, then calls the model's
    `tie_weights`: the actor-critic's ties the policy's again (a PEFT model's too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from klppo.models import resolve_model_path
    from klppo.ppo.actor_critic import ActorCritic, ValueHead

    policy = AutoModelForCausalLM.from_pretrained(resolve_model_path("klppo:tiny-llama-vllm-tied"))
    base = policy
    if lora:
        policy = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj"]))
    model = ActorCritic(policy, value_head=ValueHead(base.config.hidden_size))

    def tied() -> bool:
        return base.lm_head.weight is base.model.embed_tokens.weight

    assert tied()
    model.to(torch.device("meta"))
    assert not tied()  # what accelerate re-ties
    model.tie_weights()
    assert tied()


@pytest.mark.ranks
@pytest.mark.slow
def test_fsdp2_trains_a_tied_lm_head_as_its_embedding(tmp_path):
    """Under the shipped FSDP2 config (2 processes, float32), full fine-tuning of a model whose LM head is its
    embedding: after 2 updates the head is still the embedding's parameter on every rank, and it moved."""
    from klppo.models import resolve_model_path

    resolve_model_path("klppo:tiny-llama-vllm-tied")  # built once here, not by both ranks at once
    fsdp_launch(["tied", str(tmp_path)], tmp_path)
    for rank in range(2):
        record = json.loads((tmp_path / f"tied_rank{rank}.json").read_text())
        assert record["tied"] is True and record["moved"] > 1e-3, record


def fsdp_launch(worker_args: list[str], tmp_path, timeout: float = 600) -> str:
    """The worker on 2 CPU ranks under FSDP2: the shipped FSDP config, with 2 processes and no mixed precision.
    Returns its stderr."""
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        FSDP_CONFIG,
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
    return run([*launcher, WORKER, *worker_args], tmp_path, timeout=timeout)[1]


@pytest.fixture(scope="session")
def fsdp_engine_run(engine_rollout, tiny_model_path, tmp_path_factory):
    """The worker's `engine` mode under FSDP2, with sampling first: rank 0's response ends at the stop token after 2
    tokens while rank 1's runs to full length. Returns its folder and, as one process makes them alone (no engine),
    each rank's rollout and the evaluation."""
    import dist_trainer_worker as worker

    def build(out):
        # the stop token: the 2nd token rank 0 samples on its own, one that rank 1 never samples (the random tiny
        # model puts a chance of about 1e-3 on each token, so its own end-of-sequence token would almost never end a
        # response)
        trainer = worker.engine_trainer(str(out))
        for seed in range(20):
            tokens = [worker.sample_alone(trainer, rank, seed).responses[0].tolist() for rank in range(2)]
            stop = tokens[0][1]
            if stop != tokens[0][0] and stop not in tokens[1]:
                break
        else:
            pytest.fail("no seed gave a stop token that ends rank 0's response only")
        trainer = worker.engine_trainer(str(out), stop)
        alone = [worker.sample_alone(trainer, rank, seed) for rank in range(2)]
        assert alone[0].responses.tolist() == [tokens[0][:2]] and alone[1].responses.tolist() == [tokens[1]]
        # rank 0 is done after 2 tokens, rank 1 after 6: unless rank 0 steps on until rank 1 is done, their
        # weight gathers pair up wrongly, and the run fails or hangs (the timeout); likewise in the evaluation,
        # whose one prompt only rank 0 holds
        fsdp_launch(["engine", str(engine_rollout), str(out), str(seed), str(stop)], out, timeout=180)
        torch.save((alone, trainer.evaluate_policy()), out / "alone.pt")

    out = once_per_session(tmp_path_factory, "fsdp2_engine", build)
    alone, evaluation = torch.load(out / "alone.pt", weights_only=False)
    return out, alone, evaluation


@pytest.mark.ranks
@pytest.mark.slow
def test_fsdp2_sampling_with_ranks_that_finish_at_different_steps(fsdp_engine_run):
    out, alone, evaluation = fsdp_engine_run
    ranks, _ = read_engine_run(out)
    assert all(r["fsdp_enabled"] and r["fsdp2"] for r in ranks) and [r["steps_sampling"] for r in ranks] == [0, 0]
    # a rollout that raised first left the sharded model scoring as before
    assert all(r["failed_rollout"] == "scoring failed" and r["after_failed_rollout_difference"] == 0.0 for r in ranks)
    sampled = [r["sampled"] for r in ranks]
    assert sampled[0]["response_mask"] == [[1, 1]] and sampled[1]["response_mask"] == [[1] * 6]
    for rank, own in zip(sampled, alone):  # each rank's tokens are those it samples alone
        assert rank["responses"] == own.responses.tolist()
        torch.testing.assert_close(torch.tensor(rank["logp"]), own.logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(rank["ref_logp"]), own.ref_logp, rtol=0, atol=1e-5)
    # the evaluation's score is rank 0's one sample (rank 1's copy weighs nothing), as one process scores it
    assert ranks[0]["eval"] == ranks[1]["eval"]
    assert ranks[0]["eval"]["eval/scores"] == pytest.approx(evaluation["eval/scores"], rel=1e-12)
    assert ranks[0]["eval"]["eval/perplexity"] == pytest.approx(evaluation["eval/perplexity"], rel=1e-5)


@pytest.mark.ranks
@pytest.mark.slow
def test_fsdp2_update_equals_ddp(fsdp_engine_run, ddp_update):
    ddp_ranks, ddp_weights = read_engine_run(ddp_update)
    ranks, weights = read_engine_run(fsdp_engine_run[0])
    assert [r["fsdp2"] for r in ranks] == [True, True] and [r["fsdp2"] for r in ddp_ranks] == [False, False]
    assert all(r["world"] == 2 for r in ranks + ddp_ranks)
    assert [r["steps"] for r in ranks] == [r["steps"] for r in ddp_ranks] == [2, 2]  # one step per mini-batch
    assert [r["coef_after"] for r in ranks] == [r["coef_after"] for r in ddp_ranks]
    assert ranks[0]["kl_value"] == pytest.approx(ddp_ranks[0]["kl_value"], rel=1e-9, abs=1e-12)
    # float32 and the same reductions: measured equal to DDP's bit for bit
    difference = update_difference(weights, ddp_weights)
    assert difference < 1e-6, f"FSDP2's update differs from DDP's by {difference:.2e} of its L2 norm"


def trainable(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "klppo_trainable.safetensors"))


def fsdp_train_tiny(out, tmp_path, *extra: str) -> str:
    """`scripts/train.py` (the worker's `cli` mode) on the tiny job: 3 updates, checkpoints at 2 and at the end. The
    KL is `full`: scoring then runs the policy through the FSDP2 root (for its logits), which leaves the root's
    weights whole until the next backward; a resume must load into the shards all the same. The reward varies
    (the tiny model's sentiment is 0 everywhere, and the exact KL of a policy equal to its reference is 0)."""
    return fsdp_launch(
        [
            "cli",
            "--config",
            os.path.join(ROOT, "configs", "tiny.yaml"),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--save_strategy",
            "steps",
            "--save_steps",
            "2",
            "--kl_estimator",
            "full",
            "--reward_funcs",
            "dist_trainer_worker:token_reward",
            *extra,
        ],
        tmp_path,
    )


@pytest.mark.ranks
@pytest.mark.slow
def test_fsdp2_tiny_job_saves_and_resumes_exactly(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    stderr = fsdp_train_tiny(whole, tmp_path)
    assert "returned a view" not in stderr  # FSDP2 warns at every forward of a module whose output is a view
    assert json.loads((whole / "summary.json").read_text())["updates"] == 3
    state = json.loads((whole / "trainer_state.json").read_text())
    assert sum("eval/perplexity" in h for h in state["log_history"]) == 2  # evaluated at updates 2 and 3
    assert (whole / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()  # Trainer saved through accelerate's FSDP
    model = AutoModelForCausalLM.from_pretrained(whole)  # the final save: the whole policy, a plain model
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    final, last = trainable(whole), trainable(whole / "checkpoint-3")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    assert any(not torch.equal(last[k], trainable(whole / "checkpoint-2")[k]) for k in last)  # the 3rd update moved

    fsdp_train_tiny(resumed, tmp_path, "--resume_from_checkpoint", str(whole / "checkpoint-2"))
    assert (resumed / "checkpoint-3").is_dir() and not (resumed / "checkpoint-2").exists()
    for folder in (resumed, resumed / "checkpoint-3"):
        again = trainable(folder)
        assert again.keys() == final.keys()
        for name, value in final.items():
            torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=f"{name} differs after resuming")
    states = [json.loads((d / "checkpoint-3" / "kl_controller.json").read_text()) for d in (whole, resumed)]
    assert states[0] == states[1]  # controller, monitors and guards


def _run(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from klppo.models import tiny_model_and_tokenizer
    from klppo.ppo.actor_critic import ActorCritic, ValueHead
    from klppo.ppo.distributed import load_full_weights, root_unsharded

    os.environ.update(
        MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=os.environ.get("MASTER_PORT", "29591")
    )
    dist.init_process_group("gloo")
    model, _ = tiny_model_and_tokenizer()
    actor_critic = ActorCritic(model, value_head=ValueHead(model.config.hidden_size))
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    expected = model(ids).logits.detach().clone()
    expected_generation = model.generate(ids, max_new_tokens=4, do_sample=False)

    mesh = init_device_mesh("cpu", (1,))
    blocks = set(actor_critic._no_split_modules)
    wrapped = 0
    for module in actor_critic.modules():  # what accelerate's transformer-based wrap does with those names
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
            wrapped += 1
    fully_shard(actor_critic, mesh=mesh)
    result = {
        "no_split_modules": actor_critic._no_split_modules,
        "wrapped_blocks": wrapped,
        "sharded_root_param": isinstance(model.lm_head.weight, DTensor),
    }
    try:
        model(ids)
        result["error_without_unshard"] = ""
    except RuntimeError as err:
        result["error_without_unshard"] = str(err)[:200]
    with torch.no_grad(), root_unsharded(actor_critic):
        logits = model(ids).logits
        generation = model.generate(ids, max_new_tokens=4, do_sample=False)
    result["logits_match"] = bool(torch.allclose(logits, expected, atol=1e-6))
    result["generation_matches"] = bool(torch.equal(generation, expected_generation))
    result["resharded_after"] = isinstance(model.lm_head.weight, DTensor)
    # after those off-root forwards, the actor-critic's own forward (the PPO loss) still works, with the same logits
    with torch.no_grad():
        root_logits = actor_critic(ids)[0]
    result["root_forward_after_off_root_matches"] = bool(torch.allclose(root_logits, expected, atol=1e-6))
    # resuming: a checkpoint's whole weights go into the sharded actor-critic
    torch.manual_seed(1)
    other, _ = tiny_model_and_tokenizer(seed=1)
    saved = {f"policy.{name}": value for name, value in other.state_dict().items()}
    load_full_weights(actor_critic, saved)
    with torch.no_grad(), root_unsharded(actor_critic):
        reloaded = model(ids).logits
    result["loaded_logits_match"] = bool(torch.allclose(reloaded, other(ids).logits, atol=1e-6))
    result["loaded_differs_from_before"] = not bool(torch.allclose(reloaded, expected, atol=1e-3))
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _run(sys.argv[1])


@pytest.mark.ranks
@pytest.mark.slow
def test_fsdp2_critic_warmup_leaves_the_policy_out(tmp_path):
    """Critic warm-up under FSDP2 with the shared critic (its head reads the trunk detached): two warm-up updates
    under AdamW with weight decay leave the policy's gathered weights equal bit for bit, with no optimizer state,
    while the critic moves; the PPO update after them moves the policy; both ranks end with the same weights."""
    fsdp_launch(["warmup", str(tmp_path), "shared"], tmp_path)
    runs = [json.loads((tmp_path / f"warmup_rank{r}.json").read_text()) for r in range(2)]
    for run_ in runs:
        assert run_["world"] == 2
        assert run_["policy_held"] and run_["policy_without_optimizer_state"]
        assert run_["critic_moved"] and run_["policy_moved_after"]
    assert runs[0]["checksum"] == runs[1]["checksum"]
