"""What a pip user gets: a wheel of this checkout, installed without its dependencies into a fresh virtual environment
that sees this environment's packages, runs `klppo train --config tiny` and `accelerate launch -m klppo --config tiny`
from a folder away from the checkout, with the installed klppo (not the checkout's)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def clean_env(home: Path) -> dict:
    """This process's environment without what would make the checkout importable, and with accelerate's and the
    hub's folders in `home` (no user config, nothing downloaded)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`(python of the fresh environment, its bin folder, a folder to run in, env)`."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "klppo", source / "klppo", ignore=ignore)
    shutil.copytree(ROOT / "configs", source / "configs", ignore=ignore)
    env = clean_env(work / "hf")

    def run(*cmd, **kwargs):
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600, **kwargs)
        assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
        return proc

    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        work / "dist",
        source,
        cwd=work,
    )
    (wheel,) = (work / "dist").glob("klppo-*.whl")
    venv = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel)
    # only now (pip must not see another klppo) the environment's packages: as plain path entries, after the fresh
    # environment's own site-packages, so that its klppo comes first and no other .pth file (an editable klppo) runs
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "base_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    folder = work / "run"
    folder.mkdir()
    return python, venv / "bin", folder, env


def test_the_wheel_ships_the_configs_and_klppo_resolves_to_it(installed):
    python, _, folder, env = installed
    code = (
        "import klppo, klppo.cli; print(klppo.__file__); "
        "print(sorted(klppo.cli.shipped_configs())); print(klppo.cli.config_folder())"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, configs, config_folder = proc.stdout.strip().splitlines()
    venv = python.parent.parent
    assert Path(where).is_relative_to(venv) and not Path(where).is_relative_to(ROOT)
    assert Path(config_folder).is_relative_to(venv) and Path(config_folder, "tiny.yaml").is_file()
    assert not Path(config_folder, "tiny.yaml").is_symlink()
    shipped = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert eval(configs) == shipped and {"default", "tiny"} <= set(shipped)
    for name in shipped:  # the one copy of truth: the repository's files, byte for byte
        assert Path(config_folder, f"{name}.yaml").read_bytes() == (ROOT / "configs" / f"{name}.yaml").read_bytes()


def test_the_console_script_trains_from_a_shipped_config(installed):
    python, bin_folder, folder, env = installed
    out = folder / "out-console"
    proc = subprocess.run(
        [
            str(bin_folder / "klppo"),
            "train",
            "--config",
            "tiny",
            "--max_steps",
            "1",
            "--output_dir",
            str(out),
            "--disable_tqdm",
            "true",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "klppo run summary: 1 PPO updates" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["updates"] == 1
    assert (out / "config.json").is_file()


def test_accelerate_launch_runs_the_module(installed):
    python, _, folder, env = installed
    out = folder / "out-accelerate"
    launch = [
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "klppo",
        "--config",
        "tiny",
        "--max_steps",
        "1",
        "--output_dir",
        str(out),
        "--disable_tqdm",
        "true",
    ]
    proc = subprocess.run([str(python), *launch], capture_output=True, text=True, env=env, cwd=folder, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "klppo run summary: 1 PPO updates" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["updates"] == 1
