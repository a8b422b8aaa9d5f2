"""The measured processes of `bench.py`: each measurement runs in a fresh process with an environment of its own
(one thread count, no GPU when the benchmark runs on the CPU), and the report records the machine and the checkout
they ran on."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


MACHINE_PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda": None}
if torch.cuda.is_available():
    info["cuda"] = torch.cuda.get_device_name(0)
    info["cuda_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
print(json.dumps(info))
"""


_MACHINE: dict = {}


def machine() -> dict:
    """The machine and torch build; the GPU is looked at in a process of its own, so that this one holds no CUDA
    context while the runs measure theirs."""
    if not _MACHINE:
        probe = subprocess.run([sys.executable, "-c", MACHINE_PROBE], capture_output=True, text=True, check=True)
        _MACHINE.update(
            cpu_count=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
            processor=platform.processor() or platform.machine(),
            **json.loads(probe.stdout.strip().splitlines()[-1]),
        )
        try:
            _MACHINE["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        except (ValueError, OSError):
            pass
    return dict(_MACHINE)


THREADS = {"n": 1}
DEVICE = {"name": "cpu"}


def git_revision() -> str | None:
    """The checkout's commit (with `-dirty` when tracked klppo files are modified)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "klppo"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("-dirty" if dirty else "")


def run_env(extra_env: dict | None = None) -> dict:
    """The environment of a measured process: one thread count, no GPU when the benchmark runs on the CPU, and
    `extra_env` on top (a None value removes the variable)."""
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    threads = str(THREADS["n"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if DEVICE["name"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key, value in (extra_env or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_json(cmd: list[str], log_path: Path, env: dict | None = None, **extra_env: str) -> dict:
    """Run one measurement in a fresh process, its output logged to `log_path`; return its JSON result, with the
    process's wall time from start to exit (imports included) as `process_s`."""
    out_path = log_path.with_suffix(".json")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(
            [*cmd, "--out", str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=run_env({**(env or {}), **extra_env}),
            check=False,
        )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {done.returncode}; log {log_path}):\n{tail}")
    return {**json.loads(out_path.read_text()), "process_s": seconds}
