"""scripts/train.py end to end on configs/tiny.yaml, and its error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def run_script(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env, cwd=str(cwd)
    )


def test_tiny_config_end_to_end(tmp_path):
    summary_file = tmp_path / "summary.json"
    proc = run_script("--config", TINY, "--output_dir", str(tmp_path / "out"), "--summary_file", str(summary_file), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "klppo run summary: 2 PPO updates" in proc.stdout
    assert "held-out perplexity" in proc.stdout
    summary = json.loads(summary_file.read_text())
    assert summary["updates"] == 2
    assert len(summary["coef_trajectory"]) == 3 and summary["coef_trajectory"][0] == 0.05
    assert len(summary["samples_before"]) == 2 and len(summary["samples_after"]) == 2
    # the saved policy is loadable with plain transformers
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))


def test_cli_flag_overrides_yaml(tmp_path):
    proc = run_script(
        "--config", TINY, "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--kl_controller", "fixed", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "klppo run summary: 1 PPO updates" in proc.stdout
    assert "controller=fixed" in proc.stdout


def write_config(tmp_path, **changes) -> str:
    with open(TINY) as f:
        config = yaml.safe_load(f)
    config.update(changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(kl_estimatr="k3"), "Unknown arguments from config file"),
        (dict(kl_estimator="k5"), "k1"),
        (dict(kl_controller="adaptive", kl_target=None), "kl_target"),
        (dict(reward_funcs=["no_such_module_xyz:reward"]), "no_such_module_xyz"),
        (dict(dataset_name="missing_prompts.jsonl"), "missing_prompts.jsonl"),
    ],
)
def test_bad_input_gives_one_clean_message(tmp_path, changes, expected):
    proc = run_script("--config", write_config(tmp_path, **changes), "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") or "\nerror:" in proc.stderr
