"""How far the log-probs read from generation (KV cache) are from a recomputed forward pass, per dtype.

    python -m lab.bf16_logprobs --out results/bf16_logprobs

klppo can read the sampling policy's log-probs from `generate`'s own logits instead of a second forward pass. That
is exact only if the cached and uncached paths compute the same logits. This script samples responses from the
offline default model (SmolLM2-135M-Instruct) in float32 and in bfloat16, rescores the same sequences with one
forward pass, and reports the difference per token and the PPO ratio `exp(logp_forward - logp_generation)` it
would give at the first mini-batch (1 when the two agree).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset

from klppo import KLPPOConfig, KLPPOTrainer
from klppo.data import load_prompt_dataset
from klppo.models import OFFLINE_DEFAULT_MODEL, load_causal_lm, load_tokenizer, resolve_model_path


class GenerationLogprobsTrainer(KLPPOTrainer):
    """Reads the sampling policy's log-probs from generation whatever the dtype (klppo does only in float32), to
    compare them with a forward pass: its KL plan says so."""

    def __init__(self, *args, **kwargs):
        import dataclasses

        super().__init__(*args, **kwargs)
        self.kl_plan = dataclasses.replace(self.kl_plan, read_while_decoding=True)
        self.scorer.plan = self.kl_plan


def measure(dtype: str, prompts: list[str], response_length: int, seed: int) -> dict:
    path = resolve_model_path(OFFLINE_DEFAULT_MODEL)
    args = KLPPOConfig(
        output_dir="/tmp/klppo-bf16-logprobs",
        use_cpu=True,
        report_to="none",
        response_length=response_length,
        per_device_train_batch_size=len(prompts),
        kl_coef=0.05,
        seed=seed,
        disable_tqdm=True,
    )
    trainer = GenerationLogprobsTrainer(
        model=load_causal_lm(path, dtype=dtype),
        args=args,
        processing_class=load_tokenizer(path),
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    torch.manual_seed(seed)
    rollout = trainer.rollout(trainer.prompt_batch(prompts))
    rescored = trainer.score(rollout.sequences())
    mask = rollout.response_mask.bool()
    diff = (rescored.logp.double() - rollout.logp.double())[mask]
    ratio = diff.exp()
    return {
        "dtype": dtype,
        "tokens": int(mask.sum()),
        "max_abs_logp_diff": float(diff.abs().max()),
        "mean_abs_logp_diff": float(diff.abs().mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ratio_outside_clip_0.2": float(((ratio - 1).abs() > 0.2).double().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bf16_logprobs")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = load_prompt_dataset("klppo:offline-prompts", split="train")["prompt"][: args.prompts]
    rows = [measure(dtype, prompts, args.response_length, args.seed) for dtype in ("float32", "bfloat16")]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    lines = [
        "| dtype | tokens | max abs diff | mean abs diff | ratio min | ratio max | ratios beyond 1 +- 0.2 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['tokens']} | {r['max_abs_logp_diff']:.2e} | {r['mean_abs_logp_diff']:.2e} | "
            f"{r['ratio_min']:.4f} | {r['ratio_max']:.4f} | {r['ratio_outside_clip_0.2']:.1%} |"
        )
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
