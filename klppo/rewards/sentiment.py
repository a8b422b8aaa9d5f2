"""Sentiment reward: VADER's compound score, a lexicon scorer that runs offline in microseconds.

VADER (Hutto & Gilbert, 2014, https://github.com/cjhutto/vaderSentiment) scores English text from a
hand-built lexicon plus rules for negation, intensifiers and punctuation. Its ``compound`` score is
in [-1, 1]; +1 is very positive. It makes the classic "steer an LM toward positive continuations"
task runnable with no model hub; being a lexicon, it is also easy to game (a policy learns to emit
words like "great" and "love"), which makes it a good testbed for KL control.
"""

from __future__ import annotations

from .text import completion_text

_ANALYZER = None


def _analyzer():
    global _ANALYZER
    if _ANALYZER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _ANALYZER = SentimentIntensityAnalyzer()
    return _ANALYZER


def sentiment_score(text: str) -> float:
    """VADER compound score of ``text``, in [-1, 1]."""
    return float(_analyzer().polarity_scores(text)["compound"])


def positive_sentiment_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Reward = VADER compound score of the completion alone, in [-1, 1].

    TRL's reward-function signature. Completions may be strings or conversational message lists
    (the last message's content is scored). The prompt is not scored: the policy is rewarded for
    what it writes, not for the prompt's tone.
    """
    return [sentiment_score(completion_text(c)) for c in completions]
