"""scripts/train.py end to end on configs/tiny.yaml, its error messages, and the `klppo` command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def run_script(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env, cwd=str(cwd)
    )


def test_tiny_config_end_to_end(tmp_path):
    summary_file = tmp_path / "summary.json"
    proc = run_script(
        "--config", TINY, "--output_dir", str(tmp_path / "out"), "--summary_file", str(summary_file), cwd=tmp_path
    )
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


def test_cli_flag_overrides_yaml(tmp_path, capsys):
    """Command-line flags override the YAML. tiny.yaml sets the adaptive controller's constants
    (`kl_controller_kwargs: {horizon: 64}`), which another controller refuses, so a switch of controller clears
    them (JSON, as every mapping on a command line)."""
    from klppo.cli import cli, parse

    with pytest.raises(ValueError, match="'fixed' has no constant 'horizon'"):
        parse(["--config", TINY, "--output_dir", str(tmp_path / "out"), "--kl_controller", "fixed"])
    _, args, _ = parse(
        [
            "--config",
            TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--kl_controller",
            "pid",
            "--kl_controller_kwargs",
            '{"kp": 0.2}',
        ]
    )
    assert args.kl_controller == "pid" and args.kl_controller_kwargs == {"kp": 0.2}
    code = cli(
        [
            "--config",
            TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
            "--kl_controller",
            "fixed",
            "--kl_controller_kwargs",
            "{}",
            "--disable_tqdm",
            "true",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err[-4000:]
    assert "klppo run summary: 1 PPO updates" in out.out
    assert "controller=fixed" in out.out


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
        # settings klppo's loop cannot honour, refused at parse time
        (dict(lr_scheduler_type="reduce_lr_on_plateau"), "'linear' (the default)"),
        (dict(lr_scheduler_type="greedy"), "'linear' (the default)"),
        (dict(optim="schedule_free_adamw"), "'adamw_torch' (the default)"),
        # refused once the model and rewards are loaded
        (dict(critic="separate", critic_init="reward"), "needs a reward model among `reward_funcs`"),
        (dict(stop_token="</s>"), "is not one token of this tokenizer"),
        (dict(save_strategy="best"), "save_strategy='steps'"),
        (dict(load_in_4bit=True), "does not train quantized models"),
        # transformers cannot build the schedule (its own arguments missing)
        (dict(lr_scheduler_type="warmup_stable_decay"), "--lr_scheduler_kwargs"),
    ],
)
def test_bad_input_gives_one_clean_message(tmp_path, capsys, changes, expected):
    """In process, through the script's entry point (`klppo.cli.cli`): an exception would fail the test."""
    from klppo.cli import cli

    code = cli(["--config", write_config(tmp_path, **changes), "--output_dir", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert code == 2
    assert expected in stderr
    assert stderr.count("error:") == 1 and (stderr.startswith("error:") or "\nerror:" in stderr)


def test_none_on_a_command_line_is_none():
    """`None` (or `null`) for an optional field on a command line means None, as in YAML: transformers' parser
    would keep the text, and `--stop_token None` would then stop responses at the token 'None'."""
    from klppo.cli import parse

    script_args, training_args, _ = parse(
        [
            "--config",
            TINY,
            "--output_dir",
            "out",
            "--stop_token",
            "None",
            "--dataset_test_split",
            "null",
            "--hub_model_id",
            "None",
        ]
    )
    assert (training_args.stop_token, script_args.dataset_test_split, training_args.hub_model_id) == (None, None, None)
    assert parse(["--config", TINY, "--output_dir", "out", "--stop_token", "eos"])[1].stop_token == "eos"


@pytest.mark.parametrize("targets", [["q_proj"], ["q_proj", "v_proj"]])
def test_lora_on_one_named_module_kind(tmp_path, targets):
    """`--lora_target_modules q_proj` puts LoRA on every q_proj, as a list of two names does on both (TRL's
    ModelConfig turns a one-name list into a string, which PEFT would read as a whole-name pattern)."""
    from klppo.cli import build_trainer, parse

    parsed = parse(
        [
            "--config",
            TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--use_peft",
            "true",
            "--lora_target_modules",
            *targets,
        ]
    )
    trainer = build_trainer(*parsed)
    adapted = {
        name.split(".")[-1] for name, module in trainer.model.policy.named_modules() if hasattr(module, "lora_A")
    }
    assert adapted == set(targets)


def test_the_model_loading_flags_reach_the_loader(tmp_path):
    """TRL's ModelConfig flags for loading (`attn_implementation`, `model_revision`) are passed on, as TRL's scripts
    pass them."""
    from klppo.cli import build_trainer, parse

    parsed = parse(["--config", TINY, "--output_dir", str(tmp_path / "out"), "--attn_implementation", "eager"])
    assert build_trainer(*parsed).model.policy.config._attn_implementation == "eager"
    parsed = parse(["--config", TINY, "--output_dir", str(tmp_path / "out")])
    assert build_trainer(*parsed).model.policy.config._attn_implementation == "sdpa"


def test_the_script_exits_2_with_one_paragraph_on_a_user_error(tmp_path):
    """The same through `scripts/train.py` as a process: its exit status and stderr."""
    proc = run_script(
        "--config", write_config(tmp_path, kl_estimator="k5"), "--output_dir", str(tmp_path / "out"), cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "k1" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") or "\nerror:" in proc.stderr


@pytest.mark.parametrize("name", ["default.yaml", "fixed_reward.yaml", "lists.yaml", "pid_loss.yaml", "qwen_hub.yaml"])
def test_every_experiment_config_parses(name):
    """Each shipped YAML is valid for the parser (fields, choices, KL checks), without loading models."""
    from klppo.cli import parse

    argv = ["--config", os.path.join(ROOT, "configs", name)]
    if "bf16: true" in open(argv[1]).read():
        argv += ["--bf16", "false"]  # a GPU config: TrainingArguments refuses bf16 on this CPU machine
    script_args, training_args, model_args = parse(argv)
    assert training_args.kl_estimator and model_args.model_name_or_path


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    """The README's Python example, on the tiny model and one update, runs as written: it trains one PPO update,
    logs the KL coefficient and statistic, and prints them."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("### From Python")
    code = readme[
        readme.index("```python", start) + len("```python") : readme.index("```", readme.index("```python", start) + 9)
    ]
    for old, new in (
        ("klppo:smollm2-135m-instruct", "klppo:tiny-llama"),
        ("max_steps=10", "max_steps=1"),
        ("response_length=24", "response_length=4"),
        ('output_dir="out"', f'output_dir="{tmp_path}"'),
    ):
        assert old in code, f"the README example no longer has {old!r}: update this test"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README example", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    logged = [h for h in trainer.state.log_history if "kl/coef" in h]
    assert len(logged) == 1 and math.isfinite(logged[0]["kl/value"]) and logged[0]["kl/coef"] == 0.07
    assert capsys.readouterr().out.strip().splitlines()[-1].split() == [
        str(trainer.kl_controller.value),
        str(logged[0]["kl/value"]),
    ]


@pytest.mark.ranks
@pytest.mark.slow
def test_tiny_config_under_torchrun_two_processes(tmp_path):
    """The same script under `torchrun --nproc_per_node 2` (gloo on CPU) runs and exits cleanly."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        SCRIPT,
        "--config",
        TINY,
        "--output_dir",
        str(tmp_path / "out"),
        "--per_device_train_batch_size",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("klppo run summary") == 1  # printed by the main process only
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["updates"] == 2


@pytest.mark.parametrize("case", ["yaml", "lr", "folder"])
def test_more_user_errors_are_one_paragraph(tmp_path, capsys, case):
    """Invalid YAML (with line and column), a negative learning rate, a missing local model folder: exit 2,
    one `error:` paragraph, no traceback (in process: an exception would fail the test)."""
    from klppo.cli import cli

    args = ["--config", TINY, "--output_dir", str(tmp_path / "out")]
    if case == "yaml":
        bad = tmp_path / "bad.yaml"
        bad.write_text("model_name_or_path: klppo:tiny-llama\nkl_coef: [0.1\n")
        args = ["--config", str(bad)]
    elif case == "lr":
        args += ["--learning_rate=-1e-4"]
    else:
        args += ["--model_name_or_path", str(tmp_path / "no" / "such" / "model")]
    code = cli(args)
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert stderr.count("error:") == 1
    expected = {"yaml": "line", "lr": "learning_rate", "folder": "does not exist"}[case]
    assert expected in stderr


def test_a_diverging_full_fine_tune_saves_no_diverged_model_and_ends_in_one_paragraph(tmp_path, capsys):
    """learning_rate 1e20 on the tiny config (full fine-tuning: no rollback copy): the first update's steps leave
    finite weights whose logits are not finite. The run stops there with one `error:` paragraph naming the fix and
    exit 2, and no model it saved (checkpoint or final) gives non-finite logits."""
    from klppo.cli import cli

    out = tmp_path / "out"
    code = cli(
        [
            "--config",
            TINY,
            "--output_dir",
            str(out),
            "--learning_rate",
            "1e20",
            "--max_steps",
            "3",
            "--save_strategy",
            "steps",
            "--save_steps",
            "1",
            "--disable_tqdm",
            "true",
        ]
    )
    stderr = capsys.readouterr().err
    assert code == 2 and stderr.count("error:") == 1, stderr[-4000:]
    assert "diverged" in stderr and "learning_rate" in stderr and "nonfinite_rollback" in stderr
    import torch
    from transformers import AutoModelForCausalLM

    saved = [p.parent for p in out.rglob("config.json")]
    ids = torch.tensor([[1, 2, 3, 4]])
    for folder in saved:
        logits = AutoModelForCausalLM.from_pretrained(str(folder))(ids).logits
        assert torch.isfinite(logits).all(), f"{folder} gives non-finite logits"


@pytest.mark.parametrize("returned", ["[1.0]", "['good'] * len(completions)"])
def test_a_wrong_reward_result_is_one_paragraph(tmp_path, capsys, returned):
    """A reward function returning the wrong number of values, or strings: exit 2 and one `error:` paragraph that
    names the function, as for other user errors (in process: an exception would fail the test)."""
    from klppo.cli import cli

    (tmp_path / "bad_reward.py").write_text(f"def bad(prompts, completions, **kwargs):\n    return {returned}\n")
    code = cli(
        [
            "--config",
            TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--reward_funcs",
            str(tmp_path / "bad_reward.py") + ":bad",
            "--disable_tqdm",
            "true",
        ]
    )
    stderr = capsys.readouterr().err
    assert code == 2 and stderr.count("error:") == 1, stderr[-4000:]
    assert "Reward function 'bad' returned" in stderr


def test_a_prompt_file_smaller_than_a_rollout_batch_is_cycled_and_summarised_as_text(tmp_path, capsys):
    """A JSONL of 3 conversational prompts with a rollout of 8 sequences: the prompts are cycled (no error), and the
    summary shows each prompt's text, not a Python list of messages."""
    from klppo.cli import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"Tell me about {w}."}]}) + "\n"
            for w in ("rain", "bread", "trains")
        )
    )
    code = cli(
        [
            "--config",
            TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--dataset_name",
            str(prompts),
            "--dataset_test_split",
            "None",
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "1",
            "--disable_tqdm",
            "true",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["updates"] == 1
    assert summary["prompts"] and all(p.startswith("Tell me about ") for p in summary["prompts"])
    assert "'role'" not in out.out


def test_wandb_without_credentials_logs_every_update_offline(tmp_path, monkeypatch):
    """`report_to: wandb` with no credentials (no `WANDB_API_KEY`, no `~/.netrc`): the run logs offline into
    ./wandb, says so once, and wandb receives every update's KL, controller and PPO-health figures (finite), the
    evaluation's and the completions table; the wandb run is finished when the script returns."""
    import wandb

    import klppo.ppo.run.callbacks as callbacks
    from klppo.cli import cli

    monkeypatch.setenv("WANDB_MODE", "")  # so that the test's end restores the variable as it was
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setattr(callbacks, "_WANDB_NOTICE_GIVEN", False)
    monkeypatch.chdir(tmp_path)
    logged, log = [], wandb.Run.log  # `wandb.init` binds the module's `wandb.log` to its run's
    monkeypatch.setattr(wandb.Run, "log", lambda run, data, *a, **k: logged.append(data) or log(run, data, *a, **k))
    with pytest.warns(UserWarning, match="wandb has no credentials here: logging offline") as notices:
        code = cli(
            [
                "--config",
                TINY,
                "--output_dir",
                str(tmp_path / "out"),
                "--report_to",
                "wandb",
                "--num_sample_generations",
                "2",
                "--disable_tqdm",
                "true",
            ]
        )
    assert code == 0
    assert len([n for n in notices if "no credentials" in str(n.message)]) == 1
    assert os.environ["WANDB_MODE"] == "offline" and wandb.run is None
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    updates = [d for d in logged if "train/kl/coef" in d]
    assert [d["train/global_step"] for d in updates] == [1, 2]
    for d in updates:
        for name in (
            "kl/coef",
            "kl/value",
            "kl/k1",
            "kl/k3",
            "objective/scores",
            "objective/rlhf_reward",
            "policy/approxkl",
            "policy/clipfrac",
            "policy/entropy",
            "loss/policy",
            "loss/value",
            "val/clipfrac",
            "time/update",
        ):
            assert math.isfinite(d[f"train/{name}"]), (name, d)
    # transformers' callback files every key but `eval_*` under "train/"
    assert any(math.isfinite(d.get("train/eval/perplexity", math.nan)) for d in logged)
    assert any(isinstance(d.get("completions"), wandb.Table) for d in logged)


def test_config_takes_the_name_of_a_shipped_config(tmp_path, capsys, monkeypatch):
    """`--config tiny` (or `tiny.yaml`, `--config=tiny`) reads the config klppo ships, the repository's
    `configs/tiny.yaml`; a file of that name in the working folder comes first; a missing one lists the names."""
    from klppo.cli import cli, parse, resolve_config, shipped_configs

    assert {"default", "tiny", "fixed_reward", "pid_loss", "qwen_hub"} <= set(shipped_configs())
    assert os.path.samefile(shipped_configs()["tiny"], TINY)
    by_path = parse(["--config", TINY, "--output_dir", str(tmp_path)])
    for argv in (["--config", "tiny"], ["--config", "tiny.yaml"], ["--config=tiny"]):
        assert parse([*argv, "--output_dir", str(tmp_path)]) == by_path, argv
    (tmp_path / "tiny").write_text("max_steps: 7\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_config("tiny") == "tiny" and resolve_config("no_such_config") == "no_such_config"
    assert parse(["--config", "tiny", "--output_dir", str(tmp_path)])[1].max_steps == 7
    assert cli(["--config", "no_such_config"]) == 2
    assert "name a config klppo ships: " in capsys.readouterr().err


def test_the_klppo_command_dispatches_to_train(monkeypatch, capsys):
    """`klppo train ARGS` and `klppo ARGS` (ARGS starting with an option) run the training entry point; `klppo` alone
    and `--help` print the usage, `--version` the version, an unknown command exits 2."""
    import klppo
    import klppo.cli as cli_module

    calls = []
    monkeypatch.setattr(cli_module, "cli", lambda argv=None: calls.append(argv) or 0)
    assert cli_module.command(["train", "--config", "tiny"]) == 0
    assert cli_module.command(["--config", "tiny", "--max_steps", "1"]) == 0
    assert calls == [["--config", "tiny"], ["--config", "tiny", "--max_steps", "1"]]
    assert cli_module.command([]) == 2 and "usage: klppo train --config" in capsys.readouterr().out
    assert cli_module.command(["--help"]) == 0 and "tiny" in capsys.readouterr().out
    assert cli_module.command(["--version"]) == 0 and capsys.readouterr().out.strip() == f"klppo {klppo.__version__}"
    assert cli_module.command(["grpo"]) == 2 and "unknown command 'grpo'" in capsys.readouterr().err
    assert len(calls) == 2


@pytest.mark.parametrize("module", ["klppo", "klppo.cli"])
def test_python_m_klppo_prints_the_usage(module, tmp_path):
    """`python -m klppo` and `python -m klppo.cli` are the command (`--help` prints its usage); `train --help` lists
    the fields."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: klppo train --config" in proc.stdout and "tiny" in proc.stdout
    if module == "klppo":
        proc = subprocess.run(
            [sys.executable, "-m", module, "train", "--help"],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(tmp_path),
            timeout=300,
        )
        assert proc.returncode == 0 and "--kl_controller" in proc.stdout and "--dataset_name" in proc.stdout
