"""The workload both benchmark runners share (importable without third-party packages: it runs in klppo's
environment by `bench_klppo.py` and in the peer's by `bench_peer.py`, so both read the same options and load,
time and report the workload the same way; third-party imports happen inside the functions)."""

from __future__ import annotations

import argparse
import resource


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model-path", required=True, help="local HF folder of the base causal LM")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    parser.add_argument("--workload", choices=["a", "b"], default="a")
    parser.add_argument("--updates", type=int, default=3, help="measured PPO updates")
    parser.add_argument("--warmup", type=int, default=1, help="PPO updates run first and not measured")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per PPO update")
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--num-ppo-epochs", type=int, default=2)
    parser.add_argument("--num-mini-batches", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="dtype every model is loaded in; bfloat16 also sets the trainer's `bf16` flag",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser


DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def torch_dtype(args):
    import torch

    return getattr(torch, DTYPES[args.dtype])


def resolve_device(args) -> str:
    """`args.device`, or cuda when a GPU is visible and cpu otherwise (set on `args` too)."""
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def synchronize(args) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU): update boundaries are then exact on both sides."""
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def workload_settings(args, lora: bool, **extra) -> dict:
    """The settings record both runners write, so that their reports can be compared field by field."""
    return {
        "batch_size": args.batch_size,
        "response_length": args.response_length,
        "num_ppo_epochs": args.num_ppo_epochs,
        "num_mini_batches": args.num_mini_batches,
        "temperature": args.temperature,
        "learning_rate": args.learning_rate,
        "kl_coef": args.kl_coef,
        **extra,
        "dtype": args.dtype,
        "device": args.device,
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha} if lora else None,
    }


def repeated_prompts(args) -> list[str]:
    """The prompts of `--prompts`, repeated to fill `warmup + updates` rollout batches."""
    import json

    with open(args.prompts) as f:
        prompts = json.load(f)
    n = args.batch_size * (args.warmup + args.updates)
    return (prompts * (n // len(prompts) + 1))[:n]


def load_causal_lm(args):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch_dtype(args))


def load_scalar_head(args, pad_token_id: int):
    """A sequence-classification model with one output built from the base (TRL's value / reward layout)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(args.model_path, num_labels=1, dtype=torch_dtype(args))
    model.config.pad_token_id = pad_token_id
    return model


def lora_config(args):
    """The LoRA adapter of workload (b), the same on both sides."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )


def versions() -> dict:
    import importlib.metadata
    import platform

    import torch
    import transformers
    import trl

    found = {}
    for name in ("accelerate", "peft", "datasets"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        **found,
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def timing_record(args, per_update: list[dict], wall_key: str, setup_s: float) -> dict:
    """The timing fields both runners report: per-phase medians over the measured updates (after
    `warmup`), the median wall time per update and tokens per second from it; apart from them, the
    setup (loading the models, building the trainer) and the first update, which pays for lazy
    initialisation (CUDA kernels chosen and compiled, memory pools grown) and is a warm-up update
    whenever `warmup >= 1`."""
    import statistics

    measured = per_update[args.warmup :]
    keys = sorted({k for u in measured for k in u if k.startswith("time/")})
    phases = {k: statistics.median(u.get(k, 0.0) for u in measured) for k in keys}
    seconds = phases[wall_key]
    return {
        "warmup": args.warmup,
        "updates": args.updates,
        "setup_s": setup_s,
        "first_update_s": per_update[0][wall_key] if per_update else None,
        "time_per_update_s": seconds,
        "phases_s": phases,
        "tokens_per_s": args.batch_size * args.response_length / seconds,
        "tokens_per_s_definition": "batch_size * response_length / median wall time per update",
        "per_update_s": [u[wall_key] for u in per_update],
        "per_update": per_update,
    }


def memory_record(args, rss_start: float, rss_setup: float) -> dict:
    """Peak RSS, and on a GPU the peak of the memory torch allocated and of what its caching allocator
    reserved from the driver (the figure `nvidia-smi` would show, less the CUDA context), over the whole run."""
    import torch

    cuda = args.device == "cuda"
    return {
        "peak_rss_mb": peak_rss_mb(),
        "rss_at_start_mb": rss_start,
        "rss_after_setup_mb": rss_setup,
        "cuda_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "cuda_peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
    }


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON (and write it to `out`)."""
    import json

    text = json.dumps(result, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text)
