"""Reward functions with TRL's signature ``fn(prompts, completions, completion_ids=None, **kwargs)``.

- :func:`positive_sentiment_reward`: VADER sentiment of the completion (offline, no model).
- :func:`long_word_reward`: the share of the completion's words with at least 7 letters (offline).
- :func:`list_items_reward`: whether a long answer has the five list lines its prompt asks for (offline).
- :class:`RewardModelFunction`: a sequence-classification reward model as such a function.
- :func:`load_reward_funcs`: build reward functions from specs (callables, ``"klppo:sentiment"``,
  ``"module:function"``, ``"file.py:function"``, reward-model paths or Hub ids).

Prompts and completions are plain strings or conversational message lists
(``[{"role": ..., "content": ...}, ...]``), as in TRL's online trainers.
"""

from __future__ import annotations

from .combine import RewardFunctionError, combine_rewards, reward_values
from .lexical import long_word_reward, long_word_share
from .lists import list_item_score, list_items_reward
from .loading import BUILTIN_REWARDS, load_reward_funcs, reward_func_name, unique_names
from .reward_model import RewardModelFunction
from .sentiment import positive_sentiment_reward, sentiment_score
from .text import completion_text, is_conversational

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunctionError",
    "RewardModelFunction",
    "combine_rewards",
    "completion_text",
    "is_conversational",
    "list_item_score",
    "list_items_reward",
    "load_reward_funcs",
    "long_word_reward",
    "long_word_share",
    "positive_sentiment_reward",
    "reward_func_name",
    "reward_values",
    "unique_names",
    "sentiment_score",
]
