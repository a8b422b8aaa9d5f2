"""Helpers shared by the tests."""

from __future__ import annotations

from klppo import KLPPOConfig
from klppo.ppo.config import EXPERIMENTAL_KEYS


def klppo_config(**kwargs) -> KLPPOConfig:
    """`KLPPOConfig(**kwargs)`, with the experimental settings among `kwargs` moved into its `experimental`
    mapping (so that a test can name every setting it changes in one flat list)."""
    experimental = {**(kwargs.pop("experimental", None) or {})}
    experimental.update({k: kwargs.pop(k) for k in list(kwargs) if k in EXPERIMENTAL_KEYS})
    return KLPPOConfig(**kwargs, experimental=experimental or None)
