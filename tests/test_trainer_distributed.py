"""Distributed invariance of the trainer (the idea of TRL's batch-size invariance tests).

For the same rollouts, 1 process x gradient accumulation 2 must give the same global KL statistic,
coefficient update and gradients as 2 processes (torchrun, gloo) x accumulation 1, although the two
ranks hold different numbers of response tokens. And in a real 2-process training run, both ranks hold
the same coefficient at every update (the equilibrium controller, which reads every rank's sequences).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

# its verdicts rest on training or controller arithmetic: run under a second kernel set too
pytestmark = pytest.mark.numerics

WORKER = os.path.join(os.path.dirname(__file__), "dist_trainer_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], tmp_path, timeout: float = 600) -> tuple[str, str]:
    """Run `cmd` (a launcher and its ranks) to success; returns its `(stdout, stderr)`. Past `timeout` seconds
    (ranks waiting on each other in a collective), the launcher and every process under it are killed and the test
    fails."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the ranks first (torchrun starts them outside the launcher's process group), while they are still its children
        launcher = psutil.Process(proc.pid)
        for process in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return stdout, stderr


def torchrun(args: list[str], tmp_path) -> None:
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            WORKER,
            *args,
        ],
        tmp_path,
    )


def read_engine_run(out) -> tuple[list[dict], dict]:
    """What the worker's `engine` mode wrote: each rank's record, and every weight before and after the update."""
    ranks = [json.loads((out / f"engine_rank{r}.json").read_text()) for r in range(2)]
    return ranks, torch.load(out / "weights.pt")


def update_difference(weights: dict, reference: dict) -> float:
    """The L2 norm of the difference between two engines' updates (`weights` and `reference`, as the `engine` mode
    saves them), relative to the reference update's norm. Both must start from the same weights."""
    assert weights.keys() == reference.keys()
    diff = ref = 0.0
    for name, (before, after) in weights.items():
        ref_before, ref_after = reference[name]
        torch.testing.assert_close(before, ref_before, rtol=0, atol=0, msg=f"{name} started elsewhere")
        diff += float(((after - before) - (ref_after - ref_before)).double().pow(2).sum())
        ref += float((ref_after - ref_before).double().pow(2).sum())
    assert ref > 0
    return (diff / ref) ** 0.5


@pytest.fixture(scope="module")
def rollout_file(tmp_path_factory):
    """One rollout of 4 sequences whose two halves hold different numbers of response tokens."""
    import dist_trainer_worker as worker

    out = tmp_path_factory.mktemp("rollout")
    trainer = worker.make_trainer(str(out))
    batch = trainer.prompt_batch(worker.PROMPTS["prompt"][:4])
    # an end-of-sequence token (probability about 1e-3 per token under the random tiny model) makes the halves
    # differ; 1,000 tries leave a chance of about e^-24 of finding none
    for seed in range(1000):
        torch.manual_seed(seed)
        rollout = trainer.rollout(batch)
        counts = rollout.response_mask.sum(dim=1)
        if counts[:2].sum() != counts[2:].sum():
            break
    else:
        pytest.fail("could not sample a rollout with unequal token counts per half")
    rewards = trainer.compute_rewards(rollout)
    path = out / "rollout.pt"
    torch.save((rollout, rewards), path)
    return path


@pytest.mark.ranks
@pytest.mark.slow
def test_one_process_accumulation_equals_two_processes(rollout_file, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run([sys.executable, WORKER, "update", str(rollout_file), str(one), "2"], tmp_path)
    torchrun(["update", str(rollout_file), str(two), "1"], tmp_path)

    single = json.loads((one / "update_rank0.json").read_text())
    ranks = [json.loads((two / f"update_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # the split is uneven, so naive averaging would differ
    for r in ranks:
        assert r["world"] == 2
        assert r["kl_value"] == pytest.approx(single["kl_value"], rel=1e-6)
        assert r["coef_after"] == pytest.approx(single["coef_after"], rel=1e-9)
    assert single["coef_after"] != single["coef_before"]

    d1 = torch.load(one / "deltas_world1.pt")
    d2 = torch.load(two / "deltas_world2.pt")
    assert d1.keys() == d2.keys()
    for name in d1:
        torch.testing.assert_close(d2[name], d1[name], rtol=2e-4, atol=1e-6, msg=f"gradient of {name} differs")
    # every parameter that gets a gradient moved; a separate critic's backbone gets none in this one SGD step,
    # because its value head starts at zero (the head itself moves)
    still = {name for name in d1 if not d1[name].abs().max() > 0}
    assert still == {name for name in d1 if name.startswith("critic.backbone.")}
    assert any(name.startswith("critic.head.") for name in d1) and all(
        d1[name].abs().max() > 0 for name in d1 if name.startswith(("policy.", "critic.head."))
    )


@pytest.mark.ranks
@pytest.mark.slow
def test_two_process_training_keeps_coefficients_identical(tmp_path):
    torchrun(["train", str(tmp_path)], tmp_path)
    runs = [json.loads((tmp_path / f"train_rank{r}.json").read_text()) for r in range(2)]
    assert runs[0]["world"] == 2
    assert len(runs[0]["coefs"]) == 4  # initial + 3 updates
    assert runs[0]["coefs"] == runs[1]["coefs"]
    assert len(set(runs[0]["coefs"])) > 1  # the coefficient moved
    assert runs[0]["kl"] == runs[1]["kl"]
    assert len(set(runs[0]["coefs"])) > 1  # the adaptive controller moved


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_critic_warmup_under_ddp(tmp_path, critic):
    """Under DDP the warm-up's losses leave the policy's weights out; with the find-unused setting klppo chooses,
    both ranks step through two warm-up updates (AdamW with weight decay: the policy still, with no optimizer state,
    the critic moving) and a PPO update (the policy moving), and end with the same weights."""
    torchrun(["warmup", str(tmp_path), critic], tmp_path)
    runs = [json.loads((tmp_path / f"warmup_rank{r}.json").read_text()) for r in range(2)]
    for run_ in runs:
        assert run_["world"] == 2 and run_["find_unused"] is True
        assert run_["policy_held"] and run_["policy_without_optimizer_state"]
        assert run_["critic_moved"] and run_["policy_moved_after"]
    assert runs[0]["checksum"] == runs[1]["checksum"]
