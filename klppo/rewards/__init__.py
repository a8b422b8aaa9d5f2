"""Reward functions with TRL's signature ``fn(prompts, completions, completion_ids=None, **kwargs)``.

- :func:`positive_sentiment_reward`: VADER sentiment of the completion (offline, no model).
- :class:`RewardModelFunction`: a sequence-classification reward model as such a function.
- :func:`load_reward_funcs`: build reward functions from specs (callables, ``"klppo:sentiment"``,
  ``"module:function"``, ``"file.py:function"``, reward-model paths or Hub ids).

Prompts and completions are plain strings or conversational message lists
(``[{"role": ..., "content": ...}, ...]``), as in TRL's online trainers.
"""

from __future__ import annotations


# Defined before the submodule imports below, which use them.
def is_conversational(x) -> bool:
    """True for a list of ``{"role": ..., "content": ...}`` messages."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], dict) and "content" in x[0]


def completion_text(x) -> str:
    """The text of ``x``: the string itself, or the content of the last message of a conversation."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict) and "content" in x:
        return str(x["content"])
    if is_conversational(x):
        return str(x[-1]["content"])
    raise TypeError(f"Expected a string or a list of {{'role', 'content'}} messages, got {type(x).__name__}: {x!r:.80}")


from .loading import BUILTIN_REWARDS, load_reward_funcs, reward_func_name  # noqa: E402
from .reward_model import RewardModelFunction  # noqa: E402
from .sentiment import positive_sentiment_reward, sentiment_score  # noqa: E402

__all__ = [
    "BUILTIN_REWARDS",
    "RewardModelFunction",
    "completion_text",
    "is_conversational",
    "load_reward_funcs",
    "positive_sentiment_reward",
    "reward_func_name",
    "sentiment_score",
]
