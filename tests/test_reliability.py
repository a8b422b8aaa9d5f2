"""Crash safety end to end: atomic checkpoints, resume from the latest complete one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klppo.ppo.run.checkpoint import CHECKPOINT_FILES, STAGING_DIR

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def train_args(out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(TINY),
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--eval_strategy",
        "no",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def train_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *train_args(out, *extra)]


def test_latest_checkpoint_skips_incomplete_folders(tiny_model_and_tokenizer, tmp_path, caplog):
    from datasets import Dataset

    from klppo import KLPPOConfig, KLPPOTrainer

    model, tokenizer = tiny_model_and_tokenizer
    out = tmp_path / "out"
    for step, files in ((1, CHECKPOINT_FILES), (2, CHECKPOINT_FILES), (3, ("config.json",)), (10, ())):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}")
    args = KLPPOConfig(output_dir=str(out), report_to="none", use_cpu=True, disable_tqdm=True, critic="shared")
    trainer = KLPPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions),
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 4}),
    )
    with caplog.at_level("WARNING"):
        assert trainer.latest_checkpoint() == str(out / "checkpoint-2")
    skipped = [r.getMessage() for r in caplog.records if "incomplete checkpoint" in r.getMessage()]
    assert len(skipped) == 2 and "checkpoint-10" in skipped[0] and "checkpoint-3" in skipped[1]
    # why klppo does not use transformers' own: it takes an empty folder for the newest checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) != str(out / "checkpoint-2")


@pytest.mark.slow
def test_killed_at_random_moments_then_resumed_from_the_latest(tmp_path):
    """Kill a training run (saving after every update) at several moments, including while it saves; every
    checkpoint folder left behind is complete, and `--resume_from_checkpoint true` finishes the run."""
    from klppo.cli import cli

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out = tmp_path / "out"
    start = time.time()
    proc = subprocess.Popen(train_cmd(out), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.wait(timeout=600)
    full_run = time.time() - start
    assert proc.returncode == 0
    for i, fraction in enumerate((0.7, 0.9)):  # late in the run: saving happens after each update
        target = tmp_path / f"killed{i}"
        proc = subprocess.Popen(
            train_cmd(target), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(fraction * full_run)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        folders = [p for p in target.glob("checkpoint-*")] if target.exists() else []
        for folder in folders:
            missing = [f for f in CHECKPOINT_FILES if not (folder / f).is_file()]
            assert not missing, f"{folder} is incomplete after a kill: {missing}"
        if folders:  # resumed in process, as `scripts/train.py` runs it
            assert cli(train_args(target, "--resume_from_checkpoint", "true")) == 0
            assert (target / "checkpoint-6").is_dir() and not (target / STAGING_DIR).exists()


def test_a_second_run_on_the_same_output_dir_stops_at_once(tmp_path):
    """A live process holding the folder's lock stops a second run at once, naming its pid; once that process has
    ended (killed, not released), the lock is free; the same process may take it again inside its own hold."""
    from klppo.ppo.run.lock import LOCK_NAME, OWNER_NAME, OutputDirInUse, OutputDirLock

    out = tmp_path / "out"
    out.mkdir()
    holder = (
        "import sys, time; from klppo.ppo.run.lock import OutputDirLock\n"
        "with OutputDirLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", holder, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse, match=f"pid {other.pid}"):
            with OutputDirLock(str(out)):
                pass
        assert (out / OWNER_NAME).exists()  # not ours: left alone
    finally:
        other.kill()
        other.wait()
    assert (out / LOCK_NAME).exists()  # a killed run leaves its files, not its lock
    with OutputDirLock(str(out)) as lock:
        assert lock.held
        with OutputDirLock(str(out)) as inner:  # the same process again (the CLI around the trainer)
            assert not inner.held
        assert (out / OWNER_NAME).exists()  # still held by the outer one
    assert not (out / OWNER_NAME).exists()


@pytest.mark.slow
def test_two_cli_runs_racing_on_one_folder(tmp_path, capsys):
    from klppo.cli import cli

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out = tmp_path / "out"
    first = subprocess.Popen(
        train_cmd(out, "--max_steps", "400", "--save_strategy", "no"),  # long enough to still run meanwhile
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (out / ".klppo.lock").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.2)
    code = cli(train_args(out))  # the second run, in process, as `scripts/train.py` runs it
    still_running = first.poll() is None
    first.kill()
    first.wait()
    assert still_running, "the first run ended before the second one started: the race was not tested"
    stderr = capsys.readouterr().err
    assert code == 2 and "Another klppo run" in stderr and stderr.count("error:") == 1


def test_resume_with_changed_settings_says_what_it_does(tmp_path, capsys, caplog):
    """In process, as `scripts/train.py` runs it: a changed target is taken and said; a changed unit is refused in
    one paragraph with exit 2."""
    from klppo.cli import cli

    out = tmp_path / "out"
    assert cli(train_args(out, "--max_steps", "2")) == 0
    with caplog.at_level("WARNING"):
        code = cli(train_args(out, "--max_steps", "3", "--kl_target", "2.0", "--resume_from_checkpoint", "true"))
    assert code == 0, capsys.readouterr().err[-2000:]
    assert any("kl_target changed from 1.0 to 2.0" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    code = cli(train_args(out, "--max_steps", "4", "--kl_target_unit", "token", "--resume_from_checkpoint", "true"))
    refused = capsys.readouterr().err
    assert code == 2 and "kl_target_unit: checkpoint 'sequence', now 'token'" in refused
    assert refused.count("error:") == 1 and "Traceback" not in refused


def test_non_finite_weights_are_never_saved(tiny_model_and_tokenizer, tmp_path, caplog):
    import torch
    from datasets import Dataset

    from klppo import KLPPOConfig, KLPPOTrainer

    model, tokenizer = tiny_model_and_tokenizer
    args = KLPPOConfig(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, disable_tqdm=True, critic="shared"
    )
    trainer = KLPPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions),
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 4}),
    )
    with torch.no_grad():
        next(p for p in trainer.model.parameters() if p.requires_grad).fill_(float("nan"))
    with caplog.at_level("WARNING"):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists()
    assert any("not finite" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rows", [[], ["", ""]])
def test_empty_prompt_sets_are_refused_early(tmp_path, rows):
    import json

    from klppo.data import load_prompt_dataset

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    with pytest.raises(ValueError, match="empty|no non-empty prompt"):
        load_prompt_dataset(str(path))
