"""SIGTERM keeps the run's work: the run stops after the update it is in, every rank after the same one, saves that
update's checkpoint, writes its summary, says it was stopped (last line, exit status 143), and a resume goes on to the
end as if nothing had happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klppo.ppo.checkpoint import CHECKPOINT_FILES
from klppo.ppo.preemption import DUPLICATE_WINDOW_S, EXIT_STOPPED, StopRequest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

# a reward function that, at its Nth call in this process (`KLPPO_TEST_SIGTERM_AT`, counted on the first rank only),
# sends SIGTERM as a scheduler would: to the process, or with `KLPPO_TEST_SIGTERM_GROUP=1` to its whole process
# group (the launcher and every rank); without the variable it is a plain length reward
REWARD = '''
import os, signal

CALLS = [0]


def reward(prompts, completions, completion_ids=None, **kwargs):
    CALLS[0] += 1
    at = int(os.environ.get("KLPPO_TEST_SIGTERM_AT", "0"))
    if at and CALLS[0] == at and os.environ.get("RANK", "0") == "0":
        if os.environ.get("KLPPO_TEST_SIGTERM_GROUP") == "1":
            os.killpg(os.getpgid(0), signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
    return [len(ids) / 8.0 for ids in completion_ids]
'''


def train_args(out: Path, reward: Path, *extra: str) -> list[str]:
    return [
        "--config", str(TINY), "--output_dir", str(out), "--max_steps", "6", "--save_strategy", "no",
        "--eval_strategy", "no", "--disable_tqdm", "true", "--reward_funcs", f"{reward}:reward", "--report_to", "none",
        *extra,
    ]  # fmt: skip


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "sigterm_reward.py"
    path.write_text(REWARD)
    return path


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **extra}


def check_stopped_run(out: Path, stdout: str) -> int:
    """The stopped run's promises: the last line says so and names the update; that update's checkpoint is complete
    (controller state included) and is the newest; the summary says where it stopped. Returns the update."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("klppo: stopped by SIGTERM after update "), last
    step = int(last.split("after update ")[1].split(" ")[0])
    assert 1 <= step < 6
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints == [step], checkpoints
    folder = out / f"checkpoint-{step}"
    assert not [f for f in CHECKPOINT_FILES if not (folder / f).is_file()]
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step
    assert "kl_controller" in json.loads((folder / "kl_controller.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_after_update"] == step and summary["updates"] == step
    return step


def final_log(out: Path) -> list[float]:
    """Each update's step, coefficient, KL and policy loss, in order, from the run's final trainer state."""
    state = json.loads((out / "trainer_state.json").read_text())
    return [x for h in state["log_history"] if "kl/coef" in h
            for x in (h["step"], h["kl/coef"], h["kl/value"], h["loss/policy"])]  # fmt: skip


@pytest.mark.slow
def test_sigterm_stops_after_the_update_saves_it_and_a_resume_finishes_the_run(tmp_path, reward_file):
    """One process, `scripts/train.py`: SIGTERM in the middle of an update (from the reward function, at its 4th call,
    counting the summary's first snapshot); the run finishes that update, saves it and exits 143. Resumed, it
    goes on to update 6, and its logged figures and final weights equal those of a run never stopped."""
    from safetensors.torch import load_file

    script = [sys.executable, str(ROOT / "scripts" / "train.py")]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    done = subprocess.run(script + train_args(stopped, reward_file), cwd=tmp_path, env=env(KLPPO_TEST_SIGTERM_AT="4"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    check_stopped_run(stopped, done.stdout)
    assert not (stopped / "model.safetensors").exists()  # the final model is not written: the run did not finish
    resumed = subprocess.run(script + train_args(stopped, reward_file, "--resume_from_checkpoint", "true"),
                             cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    uninterrupted = subprocess.run(script + train_args(whole, reward_file), cwd=tmp_path, env=env(),
                                   capture_output=True, text=True, timeout=600)  # fmt: skip
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert final_log(stopped) == pytest.approx(final_log(whole), rel=1e-6, abs=1e-9)
    a, b = load_file(str(stopped / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-6, name


@pytest.mark.slow
@pytest.mark.ranks
def test_sigterm_to_the_launchers_process_group_stops_every_rank_after_the_same_update(tmp_path, reward_file):
    """2 CPU ranks under `accelerate launch` (torchrun's elastic agent, which forwards the signal to its ranks): the
    first rank sends SIGTERM to the whole process group during an update. Both ranks stop after the same update, one
    checkpoint of it is saved, the summary is written, and the resume goes on to the end."""
    config = tmp_path / "ddp.yaml"
    config.write_text("distributed_type: MULTI_GPU\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
                      "machine_rank: 0\nuse_cpu: false\n")  # fmt: skip
    from test_trainer_distributed import free_port

    def launch(out, *extra, **environ):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(ROOT / "scripts" / "train.py"),
               *train_args(out, reward_file, *extra)]  # fmt: skip
        # a session of its own: the group the signal goes to holds the launcher and its ranks, not pytest
        return subprocess.run(cmd, cwd=tmp_path, env=env(**environ), capture_output=True, text=True, timeout=900,
                              start_new_session=True)  # fmt: skip

    out = tmp_path / "out"
    started = time.time()
    done = launch(out, KLPPO_TEST_SIGTERM_AT="4", KLPPO_TEST_SIGTERM_GROUP="1")
    assert done.returncode != 0 and time.time() - started < 600
    check_stopped_run(out, done.stdout)
    assert done.stdout.count("klppo: stopped by SIGTERM") == 1  # printed by the first rank only
    resumed = launch(out, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6


def test_a_second_sigterm_stops_at_once_unless_it_is_the_first_one_forwarded(monkeypatch):
    """The handler records the first SIGTERM; another within the duplicate window is the launcher forwarding it;
    one after the window re-raises SIGTERM with its default action. Outside `train()` the handler is not installed."""
    kills, clock = [], [100.0]
    monkeypatch.setattr("klppo.ppo.preemption.os.kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr("klppo.ppo.preemption.time.monotonic", lambda: clock[0])
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    assert request.install() and signal.getsignal(signal.SIGTERM) == request._handle
    try:
        request._handle(signal.SIGTERM, None)
        assert request.requested and not kills
        clock[0] += DUPLICATE_WINDOW_S / 2
        request._handle(signal.SIGTERM, None)
        assert not kills
        clock[0] += DUPLICATE_WINDOW_S
        request._handle(signal.SIGTERM, None)
        assert kills == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not StopRequest().requested


def test_sigterm_in_process_stops_the_trainer_and_the_handler_is_given_back(tiny_model_and_tokenizer, tmp_path):
    """The Python API: a SIGTERM during an update stops `train()` after it, with `stopped_by_signal` set and that
    update's checkpoint written; the SIGTERM handler in place before `train()` is back after it. With
    `checkpoint_on_sigterm` off, no handler is installed. transformers' own `enable_jit_checkpoint` callback is
    replaced by klppo's handling, and its SIGTERM handler removed."""
    from datasets import Dataset

    from klppo import KLPPOTrainer
    from klppo.testing import klppo_config

    model, tokenizer = tiny_model_and_tokenizer
    calls = []

    def reward(prompts, completions, completion_ids=None, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return [len(ids) / 8.0 for ids in completion_ids]

    args = klppo_config(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=5,
                        response_length=4, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
                        num_sample_generations=0, enable_jit_checkpoint=True)  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)
    trainer = KLPPOTrainer(model=model, args=args, processing_class=tokenizer, reward_funcs=reward,
                           train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"] * 4}))  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) == before  # transformers' JIT handler is gone
    assert not any(type(c).__name__ == "JITCheckpointCallback" for c in trainer.callback_handler.callbacks)
    trainer.train()
    assert trainer.stopped_by_signal == 2 and trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "kl_controller.json").is_file()
    assert signal.getsignal(signal.SIGTERM) == before
    off = klppo_config(output_dir=str(tmp_path / "off"), report_to="none", use_cpu=True, checkpoint_on_sigterm=False)
    assert off.experimental.checkpoint_on_sigterm is False
