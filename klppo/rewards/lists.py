"""List-format reward: a verifiable check of the shape of a long answer.

The prompts of `klppo:list-prompts` ask for five items of a topic, one per line, each explained in a sentence: an
answer of about 100-150 tokens. The reward checks the format alone, so it needs no model and cannot be argued with:
the share of the five asked-for items that appear as list lines (a line that starts with `-`, `*`, `•`, or a number
followed by `.` or `)`), less 0.2 for each list line past the fifth, in [0, 1]. SmolLM2-135M-Instruct meets it only
sometimes at first (it often answers in prose, or with fewer items), which leaves room to learn over long
responses.
"""

from __future__ import annotations

import re

from .text import completion_text

LIST_ITEMS = 5
_ITEM = re.compile(r"^\s*(?:[-*\u2022]|\d{1,2}[.)])\s+\S")


def list_item_count(text: str) -> int:
    """The number of lines of `text` that are list items (`- x`, `* x`, `• x`, `1. x`, `1) x`)."""
    return sum(bool(_ITEM.match(line)) for line in text.splitlines())


def list_item_score(text: str, items: int = LIST_ITEMS) -> float:
    """`min(n, items) / items - 0.2 * max(n - items, 0)`, clipped at 0, for `n` list lines in `text`."""
    n = list_item_count(text)
    return max(0.0, min(n, items) / items - 0.2 * max(n - items, 0))


def list_items_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Reward = `list_item_score` of the completion alone, in [0, 1] (TRL's reward-function signature)."""
    return [list_item_score(completion_text(c)) for c in completions]
