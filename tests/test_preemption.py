"""SIGTERM keeps the run's work: the run stops after the update it is in, every rank after the same one, saves that
update's checkpoint, writes its summary, says it was stopped (last line, exit status 143), and a resume goes on to the
end as if nothing had happened. Each launch the README documents is ended the way a scheduler ends a job: SIGTERM to
the launched process's whole process group, and whatever is left killed as soon as the launched process exits (a
Kubernetes container stops with its main process; a SLURM job step ends with its task). A rank that cannot finish
its update (blocked in a collective) exits at the grace period or at a second SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from klppo.ppo.run.checkpoint import CHECKPOINT_FILES
from klppo.ppo.run.preemption import DUPLICATE_WINDOW_S, EXIT_STOPPED, StopRequest, shutdown_grace_s

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# the reward's call that sends the signal: the summary's first snapshot makes calls 1 and 2 (the eval prompts' scores,
# the sample completions), each update's rollout one more, so the signal comes during update 2, and the run stops
# after it
SIGTERM_AT, STOPPED_AFTER = 4, 2

# a reward function that writes a line per call to `KLPPO_TEST_CALLS_DIR/calls-rank<RANK>` and, at its
# `KLPPO_TEST_SIGTERM_AT`th call on rank `KLPPO_TEST_SIGTERM_RANK` (0 by default), sends SIGTERM: as a scheduler does,
# to the process group whose id (the launched process's pid) the file `KLPPO_TEST_SIGTERM_GROUP` holds, or to its own
# process alone without it; it then waits (60 s at most) until its own process has the signal (a launcher forwards it
# to its ranks), so that the run stops after this update whatever the machine's load
REWARD = """
import os, signal, time

CALLS = [0]


def reward(prompts, completions, completion_ids=None, **kwargs):
    CALLS[0] += 1
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(os.environ["KLPPO_TEST_CALLS_DIR"], f"calls-rank{rank}"), "a") as calls:
        calls.write(f"{CALLS[0]}\\n")
    at = int(os.environ.get("KLPPO_TEST_SIGTERM_AT", "0"))
    if at and CALLS[0] == at and rank == os.environ.get("KLPPO_TEST_SIGTERM_RANK", "0"):
        group = os.environ.get("KLPPO_TEST_SIGTERM_GROUP")
        if group:
            with open(group) as pid:
                os.killpg(int(pid.read()), signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
        request = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)  # klppo's StopRequest
        deadline = time.monotonic() + 60
        while request is not None and not request.requested and time.monotonic() < deadline:
            time.sleep(0.05)
    return [len(ids) / 8.0 for ids in completion_ids]
"""


def train_args(out: Path, reward: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(TINY),
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--save_strategy",
        "no",
        "--eval_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--reward_funcs",
        f"{reward}:reward",
        "--report_to",
        "none",
        *extra,
    ]


@pytest.fixture
def reward_file(tmp_path, tiny_model_path) -> Path:
    """The reward function's file; the tiny model is built before any rank starts (ranks would race to build it)."""
    path = tmp_path / "sigterm_reward.py"
    path.write_text(REWARD)
    return path


def env(**extra) -> dict:
    """The subprocesses' environment: one thread, no wandb, and this checkout's klppo first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path, **extra}


@dataclass
class Ended:
    returncode: int
    stdout: str
    stderr: str


def run_as_scheduler(
    cmd: list[str], tmp_path: Path, name: str, *, signal_group: bool = False, timeout: float = 600, **environ
) -> Ended:
    """Run `cmd` as a scheduler runs a job: in a process group (a session) of its own; with `signal_group`, the reward
    function sends SIGTERM to that whole group (`KLPPO_TEST_SIGTERM_GROUP`); and as soon as the launched process has
    exited, whatever is left of the job is killed (the group, and every process started under it: torch's agent
    starts its ranks in sessions of their own). Past `timeout` seconds everything is killed and the test fails."""
    import psutil

    calls = tmp_path / f"{name}-calls"
    calls.mkdir()
    group = tmp_path / f"{name}.pgid"
    environ = {"KLPPO_TEST_CALLS_DIR": str(calls), **environ}
    if signal_group:
        environ["KLPPO_TEST_SIGTERM_GROUP"] = str(group)
    stdout, stderr = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(**environ), stdout=out, stderr=err, start_new_session=True)
    group.with_suffix(".tmp").write_text(str(proc.pid))
    group.with_suffix(".tmp").replace(group)
    seen: dict[int, psutil.Process] = {}
    timed_out = False
    try:
        launched = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(psutil.Error):
                seen.update((p.pid, p) for p in launched.children(recursive=True))
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
    finally:  # what is left of the job, at once
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for process in seen.values():
            with contextlib.suppress(psutil.Error):
                process.kill()
        proc.wait(timeout=60)
    ended = Ended(proc.returncode, stdout.read_text(), stderr.read_text())
    if timed_out:
        pytest.fail(f"{' '.join(cmd)} did not end in {timeout} s:\n{ended.stdout[-3000:]}\n{ended.stderr[-6000:]}")
    return ended


def reward_calls(tmp_path: Path, name: str, rank: int) -> int:
    """How many times the reward function was called on `rank` in the run `name` of `run_as_scheduler`."""
    path = tmp_path / f"{name}-calls" / f"calls-rank{rank}"
    return len(path.read_text().split()) if path.is_file() else 0


def check_stopped_run(out: Path, stdout: str) -> int:
    """The stopped run's promises: the last line says so and names the update; that update's checkpoint is complete
    (controller state included) and is the newest; the summary says where it stopped. Returns the update."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("klppo: stopped by SIGTERM after update "), last
    step = int(last.split("after update ")[1].split(" ")[0])
    assert step == STOPPED_AFTER, step
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
    return [
        x
        for h in state["log_history"]
        if "kl/coef" in h
        for x in (h["step"], h["kl/coef"], h["kl/value"], h["loss/policy"])
    ]


@pytest.mark.slow
def test_sigterm_stops_after_the_update_saves_it_and_a_resume_finishes_the_run(tmp_path, reward_file):
    """One process, `python scripts/train.py` (the README's launch for one process): SIGTERM to its process group in
    the middle of update 2, the rest killed as soon as it exits; the run finishes that update, saves it and exits
    143. Resumed, it goes on to update 6, and its logged figures and final weights equal those of a run never
    stopped."""
    from safetensors.torch import load_file

    script = [sys.executable, str(ROOT / "scripts" / "train.py")]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    done = run_as_scheduler(
        script + train_args(stopped, reward_file),
        tmp_path,
        "stop",
        signal_group=True,
        KLPPO_TEST_SIGTERM_AT=str(SIGTERM_AT),
    )
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    check_stopped_run(stopped, done.stdout)
    assert not (stopped / "model.safetensors").exists()  # the final model is not written: the run did not finish
    resumed = run_as_scheduler(
        script + train_args(stopped, reward_file, "--resume_from_checkpoint", "true"), tmp_path, "resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    uninterrupted = run_as_scheduler(script + train_args(whole, reward_file), tmp_path, "whole")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert final_log(stopped) == pytest.approx(final_log(whole), rel=1e-6, abs=1e-9)
    a, b = load_file(str(stopped / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-6, name


def accelerate_launch(tmp_path: Path, reward_file: Path, out: Path, *extra: str) -> list[str]:
    """`accelerate launch` with 2 CPU processes (a multi-process config: torch's elastic agent, which forwards a
    signal to its ranks and waits for them) running `scripts/train.py`."""
    from test_trainer_distributed import free_port

    config = tmp_path / "ddp.yaml"
    config.write_text(
        "distributed_type: MULTI_GPU\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
        "machine_rank: 0\nuse_cpu: false\n"
    )
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "scripts" / "train.py"),
        *train_args(out, reward_file, *extra),
    ]


def torchrun(reward_file: Path, out: Path, *extra: str) -> list[str]:
    """`torchrun` with 2 CPU processes (torch's elastic agent) running `scripts/train.py`."""
    from test_trainer_distributed import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "scripts" / "train.py"),
        *train_args(out, reward_file, *extra),
    ]


def check_ranks_stopped(done: Ended, out: Path, tmp_path: Path, name: str) -> None:
    """Both ranks of the 2-rank run `name` stopped after the same update, whose one checkpoint is saved."""
    check_stopped_run(out, done.stdout)
    assert done.stdout.count("klppo: stopped by SIGTERM") == 1  # printed by the first rank only
    # every rank calls the reward as often (the summary's snapshot, then once per update): the same update
    assert reward_calls(tmp_path, name, 0) == reward_calls(tmp_path, name, 1) == SIGTERM_AT
    assert done.returncode != 0  # torch's agent: 1 when its ranks exit 143, or when it got the signal itself


@pytest.mark.slow
@pytest.mark.ranks
def test_sigterm_to_the_launchers_process_group_stops_every_rank_after_the_same_update(tmp_path, reward_file):
    """2 CPU ranks under `accelerate launch` (torch's elastic agent): SIGTERM to the launcher's process group during
    update 2, the rest killed as soon as the launcher exits. The agent forwards it to its ranks and waits for them:
    both stop after update 2, one checkpoint of it is saved, the summary is written, and the resume goes on to the
    end."""
    out = tmp_path / "out"
    done = run_as_scheduler(
        accelerate_launch(tmp_path, reward_file, out),
        tmp_path,
        "stop",
        signal_group=True,
        KLPPO_TEST_SIGTERM_AT=str(SIGTERM_AT),
    )
    check_ranks_stopped(done, out, tmp_path, "stop")
    resumed = run_as_scheduler(
        accelerate_launch(tmp_path, reward_file, out, "--resume_from_checkpoint", "true"), tmp_path, "resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6


@pytest.mark.slow
@pytest.mark.ranks
def test_sigterm_to_one_rank_alone_stops_every_rank_after_the_same_update(tmp_path, reward_file):
    """2 CPU ranks under `torchrun`; SIGTERM reaches the second rank alone, during update 2 (the first rank, which
    saves, never gets it): the all-reduce at the end of the update tells every rank, so both stop after update 2, with
    one checkpoint, and the launcher exits once they have. Were each rank to act on its own flag, the first would go
    on to update 3 and the ranks would meet different collectives."""
    out = tmp_path / "out"
    done = run_as_scheduler(
        torchrun(reward_file, out),
        tmp_path,
        "stop",
        timeout=300,
        KLPPO_TEST_SIGTERM_AT=str(SIGTERM_AT),
        KLPPO_TEST_SIGTERM_RANK="1",
    )
    check_ranks_stopped(done, out, tmp_path, "stop")
    # the agent, not signalled itself, reports each rank's exit status: 143 for the rank that exits first; the other
    # exits 143 too, unless the agent, seeing the first one gone, ended it first (SIGTERM, -15, once train() has
    # returned); which rank exits first depends on the machine's load
    statuses = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (-?\d+)", done.stderr))
    assert set(statuses) <= {"0", "1"} and str(EXIT_STOPPED) in statuses.values(), done.stderr[-6000:]
    assert all(s in (str(EXIT_STOPPED), "-15") for s in statuses.values()), done.stderr[-6000:]


@pytest.mark.slow
def test_accelerates_single_process_launcher_exits_at_the_signal_without_waiting_for_its_script(tmp_path):
    """Why the README launches one process with `python scripts/train.py`: `accelerate launch` on one process (its
    simple launcher) starts the script as a child and dies at SIGTERM to its group (status -15) without waiting, so a
    scheduler ends the job while the script is still saving. A script that takes 3 s to save after SIGTERM is killed
    before it has saved; run alone, it saves."""
    script = tmp_path / "saves_at_sigterm.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(3), open('saved', 'w').close(), sys.exit(143)))\n"
        "os.killpg(int(open(os.environ['KLPPO_TEST_SIGTERM_GROUP']).read()), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    config = tmp_path / "one.yaml"
    config.write_text(
        "distributed_type: 'NO'\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 1\n"
        "machine_rank: 0\nuse_cpu: true\n"
    )
    launched = run_as_scheduler(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script)],
        tmp_path,
        "accelerate",
        signal_group=True,
        timeout=120,
    )
    assert launched.returncode == -signal.SIGTERM and not (tmp_path / "saved").exists(), launched.stderr[-3000:]
    alone = run_as_scheduler([sys.executable, str(script)], tmp_path, "python", signal_group=True, timeout=120)
    assert alone.returncode == EXIT_STOPPED and (tmp_path / "saved").exists(), alone.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("ending", ["grace period", "second signal"])
def test_a_rank_blocked_in_a_collective_exits_at_sigterm(tmp_path, ending):
    """A rank waiting in a gloo barrier for a peer that will never come (stopped: a dead machine leaves its
    connections open) never gets back to the interpreter, so no Python handler runs. The watcher still ends it with
    status 143: `grace_s` after SIGTERM (not before), or at once at a second SIGTERM, more than
    `DUPLICATE_WINDOW_S` after the first."""
    import psutil

    from test_trainer_distributed import free_port

    grace = 3.0 if ending == "grace period" else 120.0
    worker = [sys.executable, str(ROOT / "tests" / "blocked_rank_worker.py")]
    port = str(free_port())
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ranks = []
    try:
        for rank in (1, 0):
            with open(logs[rank], "w") as log:
                ranks.append(
                    subprocess.Popen(
                        [*worker, str(rank), port, str(grace)],
                        env=env(),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        peer, blocked = ranks
        deadline = time.monotonic() + 240
        while "waiting" not in logs[0].read_text():
            assert blocked.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # in the barrier
        assert blocked.poll() is None and psutil.Process(peer.pid).status() == psutil.STATUS_STOPPED
        signalled = time.monotonic()
        blocked.send_signal(signal.SIGTERM)
        if ending == "second signal":
            time.sleep(1.0)
            blocked.send_signal(signal.SIGTERM)  # the launcher forwarding the first: not a second request
            time.sleep(DUPLICATE_WINDOW_S)
            assert blocked.poll() is None
            signalled = time.monotonic()
            blocked.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            blocked.wait(timeout=grace + 60)
        waited = time.monotonic() - signalled
        text = logs[0].read_text()
        assert blocked.returncode == EXIT_STOPPED, (blocked.returncode, text[-3000:])
        why = "a second SIGTERM" if ending == "second signal" else "the run has not stopped"
        assert "the barrier returned" not in text and f"klppo: {why}" in text, text[-3000:]
        # the upper bounds leave room for a loaded machine; without the watcher the rank waits the barrier's 300 s
        if ending == "grace period":
            assert grace - 0.1 <= waited <= grace + 20, waited
        else:
            assert waited <= 10, waited
    finally:
        for process in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)


def test_the_watcher_ends_the_process_at_a_second_sigterm_or_at_the_grace_period(monkeypatch):
    """In this process, with the exit recorded instead: a first SIGTERM is recorded and ends nothing; another within
    the duplicate window (the launcher forwarding it) neither; one after it ends the process, and so does the grace
    period. `uninstall` gives the handler back and stops the watcher; outside `train()` nothing is installed."""
    exits = []

    monkeypatch.setattr(StopRequest, "_exit", staticmethod(exits.append))
    monkeypatch.setattr("klppo.ppo.run.preemption.DUPLICATE_WINDOW_S", 1.0)
    before = signal.getsignal(signal.SIGTERM)

    def signalled(request, wait):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(wait)
        return request.requested

    request = StopRequest()
    try:
        assert request.install() and signal.getsignal(signal.SIGTERM) == request._handle
        assert signalled(request, 0.3) and not exits
        assert signalled(request, 0.9) and not exits  # 0.3 s after the first
        assert signalled(request, 0.5) and exits == ["a second SIGTERM"]  # 1.5 s after the first
        watcher = request._watcher
    finally:
        request.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before and not watcher.is_alive()
    exits.clear()
    request = StopRequest(grace_s=0.5)
    try:
        request.install()
        assert signalled(request, 0.2) and not exits
        time.sleep(0.6)
        assert len(exits) == 1 and exits[0].startswith("the run has not stopped 0.5 s after SIGTERM")
    finally:
        request.uninstall()
    exits.clear()
    request = StopRequest(grace_s=0.1)
    request.install()
    watcher = request._watcher
    request.uninstall()
    time.sleep(0.3)
    assert not exits and not watcher.is_alive() and signal.getsignal(signal.SIGTERM) == before
    assert not StopRequest().requested


def test_the_grace_period_is_torch_elastic_shutdown_timeout(monkeypatch):
    """Several ranks have `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (torch's agent kills them then), 30 by default."""
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert shutdown_grace_s() == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    assert shutdown_grace_s() == 90.0


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

    args = klppo_config(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=5,
        response_length=4,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        num_sample_generations=0,
        enable_jit_checkpoint=True,
    )
    before = signal.getsignal(signal.SIGTERM)
    trainer = KLPPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"] * 4}),
    )
    assert signal.getsignal(signal.SIGTERM) == before  # transformers' JIT handler is gone
    assert not any(type(c).__name__ == "JITCheckpointCallback" for c in trainer.callback_handler.callbacks)
    trainer.train()
    assert trainer.stop_request.grace_s is None  # one process: no peer to wait for, no deadline of its own
    assert trainer.stopped_by_signal == 2 and trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "kl_controller.json").is_file()
    assert signal.getsignal(signal.SIGTERM) == before
    off = klppo_config(output_dir=str(tmp_path / "off"), report_to="none", use_cpu=True, checkpoint_on_sigterm=False)
    assert off.experimental.checkpoint_on_sigterm is False
