"""Assets for `benchmarks/bench.py`: model folders, prompts and the peer's virtual environment.

Runs in klppo's own environment (never inside the peer's). Both sides of the benchmark load the
same local model folder (from `klppo.models`) and receive the same prompts as plain strings (a JSON
file written here), so they tokenize the same text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The peer pins: trl 1.12 is the last release with `trl.experimental.ppo.PPOTrainer`.
PEER_TORCH = "torch==2.13.0"
PEER_PACKAGES = ["trl==1.12.0", "transformers==5.23.0", "accelerate", "datasets", "peft"]

MODEL_NAMES = {"tiny": "klppo:tiny-llama", "smollm2": "klppo:smollm2-135m-instruct"}


def peer_venv_dir() -> Path:
    """The peer's virtual environment (`KLPPO_BENCH_PEER_VENV`, default ~/.cache/klppo/bench-peer-venv)."""
    default = Path.home() / ".cache" / "klppo" / "bench-peer-venv"
    return Path(os.environ.get("KLPPO_BENCH_PEER_VENV", default)).expanduser()


def peer_python() -> Path:
    return peer_venv_dir() / "bin" / "python"


def ensure_peer_venv(log=print) -> Path:
    """Create the peer's venv if needed: torch pinned first (an open pin pulls a CUDA build), then trl 1.12."""
    python = peer_python()
    check = [str(python), "-c", "import trl, peft; from trl.experimental.ppo import PPOTrainer; print(trl.__version__)"]
    if python.exists():
        done = subprocess.run(check, capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip() == "1.12.0":
            return python
    log(f"creating the peer venv at {peer_venv_dir()} (trl 1.12.0)")
    subprocess.run([sys.executable, "-m", "venv", str(peer_venv_dir())], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, PEER_TORCH], check=True)
    subprocess.run([*pip, PEER_TORCH, *PEER_PACKAGES], check=True)
    subprocess.run(check, check=True, capture_output=True)
    return python


def resolve_model(model: str) -> str:
    """The local HF folder of `tiny` (klppo:tiny-llama) or `smollm2` (klppo:smollm2-135m-instruct)."""
    from klppo.models import resolve_model_path

    return str(resolve_model_path(MODEL_NAMES[model]))


def load_prompts(n: int) -> list[str]:
    """`n` prompts from klppo's built-in training prompts (repeated if there are fewer), plain text."""
    from klppo.data import offline_prompts

    prompts = offline_prompts("train")
    return (prompts * (n // len(prompts) + 1))[:n]


def write_prompts(path: Path, n: int) -> Path:
    path.write_text(json.dumps(load_prompts(n), indent=0))
    return path
