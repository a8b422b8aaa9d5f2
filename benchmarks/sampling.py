"""Time one decoding step's draw of a token per row, three ways, on any device.

    python benchmarks/sampling.py                       # CPU, 8 and 64 rows of SmolLM2's 49,152-token vocabulary
    python benchmarks/sampling.py --device cuda --rows 64 256

The draws, each from unnormalised weights `exp(logits / T - max)` (what `klppo.ppo.generation.sampling.TemperatureSampler`
holds at each step):
- `inverse_cdf`: `klppo.ppo.generation.sampling.sample_categorical`, two-level inverse transform sampling (one uniform per row);
- `exponential_race`: `klppo.ppo.generation.sampling.sample_exponential_race`, `argmax(w / E)` with E ~ Exp(1);
- `multinomial`: `torch.multinomial(w, 1)`, what `generate(do_sample=True)` calls.
Prints the median time per step over `--repeats` steps after `--warmup`, in microseconds, and writes them as JSON to
`--out` when given. The sampler uses `klppo.ppo.generation.sampling.default_draw(device)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from klppo.ppo.generation.sampling import default_draw, sample_categorical, sample_exponential_race

DRAWS = {
    "inverse_cdf": sample_categorical,
    "exponential_race": sample_exponential_race,
    "multinomial": lambda w: torch.multinomial(w, 1).squeeze(1),
}


def time_draw(draw, weights: torch.Tensor, warmup: int, repeats: int) -> float:
    """Median seconds of one `draw(weights)`, synchronised on a GPU."""
    sync = torch.cuda.synchronize if weights.is_cuda else (lambda: None)
    for _ in range(warmup):
        draw(weights)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        draw(weights)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    generator = torch.Generator(device=args.device).manual_seed(0)
    results = {"device": args.device, "default_draw": default_draw(args.device), "vocab": args.vocab, "rows": {}}
    print(f"device {args.device} (klppo's draw there: {results['default_draw']}), vocabulary {args.vocab}")
    print("| rows | " + " | ".join(f"{name} (us)" for name in DRAWS) + " |")
    print("| --- |" + " --- |" * len(DRAWS))
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=args.device, generator=generator) * 3
        weights = (logits - logits.amax(-1, keepdim=True)).exp()
        row = {name: 1e6 * time_draw(draw, weights, args.warmup, args.repeats) for name, draw in DRAWS.items()}
        results["rows"][rows] = row
        print(f"| {rows} | " + " | ".join(f"{row[name]:.0f}" for name in DRAWS) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
