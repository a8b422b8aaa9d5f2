"""What klppo's tests and its lab share: `klppo_config`, and (in `klppo.testing.bandit`) bandits on the tiny Llama
whose KL-regularised optimum is known in closed form."""

from __future__ import annotations

from klppo.ppo.config import EXPERIMENTAL_KEYS, KLPPOConfig

__all__ = ["klppo_config"]


def klppo_config(**kwargs) -> KLPPOConfig:
    """`KLPPOConfig(**kwargs)`, with the experimental settings among `kwargs` moved into its `experimental`
    mapping (so that a test or an experiment can name every setting it changes in one flat list); an
    `experimental` mapping given as well is kept, the flat keys added to it."""
    experimental = {**(kwargs.pop("experimental", None) or {})}
    experimental.update({k: kwargs.pop(k) for k in list(kwargs) if k in EXPERIMENTAL_KEYS})
    return KLPPOConfig(**kwargs, experimental=experimental or None)
