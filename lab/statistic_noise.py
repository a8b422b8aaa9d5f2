"""How noisy is a KL reading? `k1` against `full` on the same samples.

    python -m lab.statistic_noise --temperatures 0.7 0.5 --out results/kl_statistic_noise/smollm2.json

The reference is SmolLM2-135M-Instruct (the embedded offline model) at temperature 1; the policy is the same
model at a lower temperature, a distribution that differs from the reference at every position. For 64 of the
offline prompts, 12 response tokens are sampled from the policy (top-k and top-p off). On the same samples:

- `k1`: the sum over the response of `log pi(token) - log ref(token)`;
- `full`: the sum over the response of the exact KL of the two next-token distributions at each position.

Both have the sequence KL as expectation (the chain rule). The script prints their means, their per-sequence
standard deviations and the relative standard error of a reading over `--batch` sequences.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data import offline_prompts
from klppo.models import resolve_model_path


@torch.no_grad()
def measure(model, tokenizer, prompts: list[str], temperature: float, length: int) -> dict:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=length,
        min_new_tokens=length,
        pad_token_id=tokenizer.pad_token_id,
    )
    width = enc.input_ids.shape[1]
    responses = out[:, width:]
    attention = torch.cat([enc.attention_mask, torch.ones_like(responses)], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(out, attention_mask=attention, position_ids=positions).logits[:, width - 1 : -1].double()
    policy, ref = torch.log_softmax(logits / temperature, -1), torch.log_softmax(logits, -1)
    k1 = (policy.gather(-1, responses[..., None]) - ref.gather(-1, responses[..., None]))[..., 0].sum(1)
    full = (policy.exp() * (policy - ref)).sum(-1).sum(1)
    return {name: {"mean": float(x.mean()), "std": float(x.std())} for name, x in (("k1", k1), ("full", full))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 0.5])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="sequences per reading, for the relative error")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    path = resolve_model_path("klppo:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = offline_prompts("train")[: args.prompts]
    results = []
    for t in args.temperatures:
        r = {"temperature": t, **measure(model, tokenizer, prompts, t, args.length)}
        for name in ("k1", "full"):
            r[name]["reading_rel_error"] = r[name]["std"] / math.sqrt(args.batch) / r[name]["mean"]
            print(
                f"temperature {t}: {name:4s} mean {r[name]['mean']:.2f} per-sequence std {r[name]['std']:.2f} "
                f"reading of {args.batch}: {100 * r[name]['reading_rel_error']:.1f}%"
            )
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
