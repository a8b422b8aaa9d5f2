"""Long-word reward: the share of a completion's words that have at least 7 letters.

A second built-in task next to sentiment, with a different shape: it rewards vocabulary, not tone, it is
dense (every word counts) and bounded in [0, 1], and a policy can raise it by choosing longer words
without any change of meaning (or, being a lexical rule, game it with long made-up words). It runs offline
in microseconds. klppo uses it to check that KL-control settings chosen on the sentiment task carry over to
another reward without retuning.
"""

from __future__ import annotations

import re

from .text import completion_text

_WORD = re.compile(r"[A-Za-z]+")
LONG_WORD_LETTERS = 7


def long_word_share(text: str, letters: int = LONG_WORD_LETTERS) -> float:
    """Share of the words in ``text`` with at least ``letters`` letters; 0 for no words. A word is a run of ASCII
    letters, so an apostrophe or a hyphen splits one ("it's" is "it" and "s") and a non-ASCII letter too."""
    words = _WORD.findall(text)
    if not words:
        return 0.0
    return sum(len(w) >= letters for w in words) / len(words)


def long_word_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Reward = share of the completion's words with at least 7 letters, in [0, 1] (the prompt is not scored).

    TRL's reward-function signature; completions may be strings or conversational message lists.
    """
    return [long_word_share(completion_text(c)) for c in completions]
