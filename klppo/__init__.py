"""klppo: PPO for Hugging Face causal LMs with first-class KL control.

``klppo.kl`` is pure torch and imports quickly; the trainer classes are imported lazily (on first use of the name)
so that ``import klppo.kl`` does not pull in transformers. ``dir(klppo)``, ``help(klppo)`` and IDEs list them all the
same (``__all__``, ``__dir__``).
"""

__version__ = "0.1.0"

__all__ = ["KLPPOConfig", "KLPPOTrainer", "PPOConfig", "PPOTrainer", "__version__"]


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name == "KLPPOConfig":
        from .ppo.config import KLPPOConfig

        return KLPPOConfig
    if name == "KLPPOTrainer":
        from .ppo.trainer import KLPPOTrainer

        return KLPPOTrainer
    if name in ("PPOConfig", "PPOTrainer"):  # TRL 1.12's names (`klppo.trl_compat`)
        from . import trl_compat

        return getattr(trl_compat, name)
    raise AttributeError(f"module 'klppo' has no attribute {name!r}")
