"""The PPO trainer: configuration, rollout, advantages, losses, value model, trainer."""

from .config import KLPPOConfig

__all__ = ["KLPPOConfig", "KLPPOTrainer"]


def __getattr__(name):
    if name == "KLPPOTrainer":
        from .trainer import KLPPOTrainer

        return KLPPOTrainer
    raise AttributeError(f"module 'klppo.ppo' has no attribute {name!r}")
