"""Prompts and completions as text: plain strings or conversational message lists."""

from __future__ import annotations


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
