"""Several reward functions' results checked and combined into one score per completion."""

from __future__ import annotations

import torch

from .text import is_conversational


class RewardFunctionError(ValueError):
    """A reward function returned something other than one number (or None) per completion."""


def reward_values(raw, expected: int, name: str) -> list[float | None]:
    """Check one reward function's result and turn it into floats (None stays None: "not applicable").

    A reward function returns one number (or None) per completion; anything else is a bug in it, reported
    with its name, the expected length and what it returned (`RewardFunctionError`).
    """
    fix = f"return a list of {expected} numbers (None for samples the function does not apply to)"
    if raw is None or isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__"):
        raise RewardFunctionError(f"Reward function {name!r} returned {type(raw).__name__} {raw!r:.80}; {fix}.")
    if torch.is_tensor(raw):
        raw = raw.detach().flatten().tolist()
    if len(raw) != expected:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(raw)} values for {expected} completions; {fix}."
        )
    out: list[float | None] = []
    for i, v in enumerate(raw):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (str, bytes)) or (torch.is_tensor(v) and v.numel() != 1):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {type(v).__name__} {v!r:.60} for completion {i}; {fix}."
            )
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {type(v).__name__} {v!r:.60} for completion {i}; {fix}."
            ) from None
    return out


def combine_rewards(
    reward_funcs, weights, names, prompts: list, completions: list[str], completion_ids, extra: dict, device
):
    """Call every reward function once and combine their checked results by weight.

    Conversational prompts get completions as one assistant message each. None means "not applicable" (as in
    TRL): it adds nothing to the score. A NaN or inf value is kept, for the trainer's non-finite guard.

    Returns:
        `(scores, applicable, per_function)`: `scores [B]` float64, the weighted sum; `applicable [B]` bool,
        whether any function returned a number; `per_function`: `{name: (sum, count)}` of each function's
        applicable values.
    """
    if prompts and is_conversational(prompts[0]):
        completions_arg = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        completions_arg = completions
    scores = torch.zeros(len(completions), device=device, dtype=torch.float64)
    applicable = torch.zeros(len(completions), device=device, dtype=torch.bool)
    per_function = {}
    for fn, weight, name in zip(reward_funcs, weights, names):
        raw = fn(prompts=prompts, completions=completions_arg, completion_ids=completion_ids, **extra)
        checked = reward_values(raw, len(completions), name)
        known = torch.tensor([v is not None for v in checked], device=device)
        values = torch.tensor([0.0 if v is None else v for v in checked], device=device, dtype=torch.float64)
        per_function[name] = (values.sum(), known.sum())
        scores += weight * values
        applicable |= known
    return scores, applicable, per_function
