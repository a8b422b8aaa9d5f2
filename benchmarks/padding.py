"""What padded positions cost in klppo's PPO epochs, and whether removing them pays.

    python benchmarks/padding.py                      # SmolLM2-135M-Instruct, CPU, one thread
    python benchmarks/padding.py --device cuda --dtype bfloat16 --model-shape 360m --tokenizer .bench-assets

A rollout is left-padded to its longest prompt (responses here run to their full length, as they do at the default
task and in the benchmark's workloads, which have no stop token). For each shape (`prompts per rollout x prompts per
micro-batch x response tokens`), drawn from the offline prompt set, it reports the share of padded positions and
times one forward + backward of the policy over a micro-batch three ways:

- `padded`: the micro-batch as the rollout holds it, padded to the rollout's longest prompt (what klppo runs);
- `trimmed`: the columns that are padding in every row of the micro-batch dropped (exact: the same logits);
- `packed`: the micro-batch's real tokens in one row, `position_ids` restarting at each sequence and no attention
  mask: transformers then builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`);
  flash attention's variable-length kernels would skip the masked blocks, SDPA computes them.

The loss is the mean log-sum-exp of the response positions' logits, a stand-in with the PPO loss's shape; the
logits at the real positions are checked to agree between the three forms. Writes `<out>/padding.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SHAPES = {  # name: (prompts per rollout, prompts per micro-batch, response tokens)
    "default job (32 x 12, micro-batches of 8)": (32, 8, 12),
    "CPU benchmark (8 x 24, one micro-batch)": (8, 8, 24),
    "GPU benchmark (64 x 128, micro-batches of 8)": (64, 8, 128),
}
SHAPE_KEYS = {
    "default": "default job (32 x 12, micro-batches of 8)",
    "cpu": "CPU benchmark (8 x 24, one micro-batch)",
    "gpu": "GPU benchmark (64 x 128, micro-batches of 8)",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-shape",
        default=None,
        choices=["tiny", "135m", "360m", "1.7b"],
        help="a random model of SmolLM2's shape instead of SmolLM2-135M-Instruct's weights",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder (`bench.py --export-assets`'s) instead of the packaged SmolLM2's; with "
        "--model-shape, no model weights are needed",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts drawn per shape")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward + backward passes per form")
    parser.add_argument("--timed-micro-batches", type=int, default=2, help="micro-batches timed per rollout")
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPE_KEYS),
        default=sorted(SHAPE_KEYS),
        help="the shapes to run (default: all)",
    )
    parser.add_argument("--out", default="results/padding")
    return parser.parse_args(argv)


def load_model(args):
    from transformers import AutoModelForCausalLM

    from klppo.models import load_tokenizer, resolve_model_path

    if args.model_shape is None and args.tokenizer is not None:
        raise SystemExit("padding.py: --tokenizer goes with --model-shape (SmolLM2's weights come with its tokenizer)")
    path = resolve_model_path("klppo:smollm2-135m-instruct") if args.tokenizer is None else None
    tokenizer = load_tokenizer(args.tokenizer or path)
    dtype = getattr(torch, args.dtype)
    if args.model_shape is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        sys.path.insert(0, str(HERE))
        from bench_assets import shape_config

        model = AutoModelForCausalLM.from_config(shape_config(args.model_shape, tokenizer), dtype=dtype)
    return model.to(args.device).train(), tokenizer


def rollout(prompts: list[str], tokenizer, response_length: int, vocab: int, gen: random.Random) -> list[list[int]]:
    """Token ids of `prompt + response` per sequence (responses: random tokens of full length)."""
    ids = tokenizer(prompts)["input_ids"]
    return [x[-64:] + [gen.randrange(vocab) for _ in range(response_length)] for x in ids]


def padded(seqs: list[list[int]], width: int, pad: int, device) -> dict:
    input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}


def packed(seqs: list[list[int]], device) -> dict:
    input_ids = torch.tensor([[t for s in seqs for t in s]], device=device)
    position_ids = torch.tensor([[i for s in seqs for i in range(len(s))]], device=device)
    return {"input_ids": input_ids, "position_ids": position_ids}


def response_logits(model, inputs: dict, seqs: list[list[int]], response_length: int, form: str) -> torch.Tensor:
    """`[B, R, V]` logits at the positions that predict each response token, the LM head run on those positions
    only (`logits_to_keep` as an index tensor, as klppo's forwards do)."""
    if form == "packed":
        ends = torch.tensor([len(s) for s in seqs]).cumsum(0)
        keep = (ends[:, None] - response_length - 1 + torch.arange(response_length)).flatten()
        logits = model(**inputs, use_cache=False, logits_to_keep=keep.to(inputs["input_ids"].device)).logits
        return logits.reshape(len(seqs), response_length, -1)
    width = inputs["input_ids"].shape[1]
    keep = torch.arange(width - response_length - 1, width - 1, device=inputs["input_ids"].device)
    return model(**inputs, use_cache=False, logits_to_keep=keep).logits


def timed_pass(model, inputs, seqs, response_length, form, device) -> float:
    model.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    logits = response_logits(model, inputs, seqs, response_length, form)
    logits.float().logsumexp(-1).mean().backward()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args, model, tokenizer, prompts: list[str], shape: tuple[int, int, int], gen: random.Random) -> dict:
    batch, micro, length = shape
    pad, vocab = tokenizer.pad_token_id, model.config.vocab_size
    times = {"padded": [], "trimmed": [], "packed": []}
    positions = {"padded": 0, "trimmed": 0, "packed": 0}
    worst = 0.0
    for _ in range(args.rollouts):
        seqs = rollout(gen.sample(prompts, batch), tokenizer, length, vocab, gen)
        width = max(len(s) for s in seqs)
        for index, start in enumerate(range(0, batch, micro)):
            part = seqs[start : start + micro]
            forms = {
                "padded": padded(part, width, pad, args.device),
                "trimmed": padded(part, max(len(s) for s in part), pad, args.device),
                "packed": packed(part, args.device),
            }
            for form, inputs in forms.items():
                positions[form] += inputs["input_ids"].numel()
            if index >= args.timed_micro_batches:
                continue
            with torch.no_grad():
                ref = response_logits(model, forms["padded"], part, length, "padded").float()
                for form in ("trimmed", "packed"):
                    got = response_logits(model, forms[form], part, length, form).float()
                    worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
            passes = {form: [] for form in forms}
            for repeat in range(args.repeats + 1):  # the forms take turns; the first round warms up
                for form, inputs in forms.items():
                    seconds = timed_pass(model, inputs, part, length, form, args.device)
                    if repeat:
                        passes[form].append(seconds)
            for form in forms:
                times[form].append(statistics.median(passes[form]))
    total = {form: sum(t) for form, t in times.items()}
    return {
        "prompts_per_rollout": batch,
        "prompts_per_micro_batch": micro,
        "response_length": length,
        "padded_share": 1 - positions["packed"] / positions["padded"],
        "positions": positions,
        "seconds_per_micro_batch": {form: total[form] / len(times[form]) for form in times},
        "time_ratio_to_padded": {form: total[form] / total["padded"] for form in times},
        "max_relative_logit_difference": worst,
    }


def markdown(report: dict) -> str:
    lines = [
        "# Padded positions in the PPO epochs",
        "",
        f"`{report['command']}`; {report['model']}, {report['dtype']} on {report['device']}, {report['threads']} "
        f"thread(s); {report['rollouts']} rollouts per shape from the offline prompt set, the median of "
        f"{report['repeats']} forward + backward passes per micro-batch (the three forms taking turns), {report['timed_micro_batches']} micro-batches "
        "timed per rollout (the padded share counts them all).",
        "",
        "| shape | padded share of positions | time, trimmed / padded | time, packed / padded | padded s per micro-batch "
        "| largest logit difference (relative) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in report["shapes"].items():
        ratio = r["time_ratio_to_padded"]
        lines.append(
            f"| {name} | {r['padded_share']:.1%} | {ratio['trimmed']:.3f} | {ratio['packed']:.3f} | "
            f"{r['seconds_per_micro_batch']['padded']:.3f} | {r['max_relative_logit_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from klppo.data import offline_prompts

    model, tokenizer = load_model(args)
    prompts = offline_prompts("all")
    gen = random.Random(0)
    names = [SHAPE_KEYS[key] for key in ("default", "cpu", "gpu") if key in args.shapes]
    shapes = {name: measure(args, model, tokenizer, prompts, SHAPES[name], gen) for name in names}
    report = {
        "command": "python benchmarks/padding.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": f"random SmolLM2-{args.model_shape} shape" if args.model_shape else "SmolLM2-135M-Instruct",
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "rollouts": args.rollouts,
        "repeats": args.repeats,
        "timed_micro_batches": args.timed_micro_batches,
        "torch": torch.__version__,
        "shapes": shapes,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "padding.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "padding.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
