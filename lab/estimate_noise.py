"""How far one batch's estimate of beta* falls from the truth when the policy is already at the optimum.

The one-token bandit's reward (token ids divisible by 4) on a reference of 1,024 tokens with random logits (scale
0.5); the policy is the tilt at beta* = 0.5 and the target is its KL, so every batch drawn from it should give
log beta* = log 0.5. For each batch size, `--batches` batches are drawn and solved as the equilibrium controller
solves them (`klppo.kl.optimum.KLOptimum.solve`); printed: the mean of log(estimate / beta*) with its standard
error, the standard deviation and the 5/25/50/75/95th percentiles. From the repository root:

    python -m lab.estimate_noise --sizes 32 64 128 --batches 1500
"""

from __future__ import annotations

import argparse
import math

import torch

from klppo.kl.optimum import KLOptimum

BETA_STAR, VOCAB, MODULUS = 0.5, 1024, 4


def estimates(size: int, batches: int, seed: int = 0) -> torch.Tensor:
    """log(estimate / beta*) of `batches` batches of `size` sequences drawn from the optimum at beta*."""
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(0.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64), 0)
    reward = (torch.arange(VOCAB) % MODULUS == 0).double()
    optimum = KLOptimum()
    star = optimum.exact(ref, reward, BETA_STAR)
    target = float((star.exp() * (star - ref)).sum())
    draws = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        y = torch.multinomial(star.exp(), size, replacement=True, generator=draws)
        log_b = optimum.solve(reward[y], (star - ref)[y], target, math.log(1e-4), math.log(10.0))
        out.append(log_b - math.log(BETA_STAR))
    return torch.tensor(out, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--batches", type=int, default=1500)
    args = parser.parse_args()
    print("| sequences | mean log(estimate / beta*) | sd | 5% | 25% | 50% | 75% | 95% |")
    print("|" + " --- |" * 8)
    for size in args.sizes:
        x = estimates(size, args.batches)
        q = [float(x.quantile(p)) for p in (0.05, 0.25, 0.5, 0.75, 0.95)]
        print(
            f"| {size} | {float(x.mean()):+.3f} ± {float(x.std() / len(x) ** 0.5):.3f} | {float(x.std()):.2f} | "
            + " | ".join(f"{v:+.2f}" for v in q)
            + " |"
        )


if __name__ == "__main__":
    main()
