"""The workload arguments shared by both benchmark runners (stdlib only: it is imported in klppo's
environment by `bench_klppo.py` and in the peer's by `bench_peer.py`, so both read the same options)."""

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
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser


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
        "dtype": "float32",
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha} if lora else None,
    }
