"""Held-out perplexity: how far the policy has moved from the language it started with."""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_perplexity(
    model,
    tokenizer,
    texts: Sequence[str],
    batch_size: int = 8,
    max_length: int = 256,
    accelerator=None,
) -> float:
    """Token-weighted perplexity of a causal LM on ``texts``: ``exp(sum NLL / number of tokens)``.

    Each text is tokenized on its own (the tokenizer's special tokens included, truncated to
    ``max_length`` tokens); every token after the first is predicted from the ones before it.
    The NLL sum and the token count are accumulated in float64 over all texts, so a long text
    weighs more than a short one (a mean of per-text perplexities would not).

    The model runs in eval mode without gradients; its previous train/eval mode is restored.
    Anything with a causal-LM ``forward(input_ids, attention_mask)`` returning ``.logits`` works
    (a PEFT model, a DDP-wrapped model).

    With an ``accelerator`` of more than one process, rank ``r`` scores ``texts[r::num_processes]``
    and ``(nll_sum, count)`` is summed over ranks with
    :func:`klppo.kl.reduce.reduce_sum_count`; every rank returns the same value. Every rank makes
    the same number of forward passes (a short shard is padded with zero-weight copies), as
    sharded models (DeepSpeed ZeRO-3, FSDP) need all ranks in every forward.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer (no pad token needed: batches are padded here, on the right).
        texts: the held-out texts; the same list on every rank.
        batch_size: texts per forward pass.
        max_length: tokens per text after truncation.
        accelerator: an ``accelerate.Accelerator`` (or ``None`` for a single process).

    Returns:
        The perplexity (a Python float).
    """
    from .kl.reduce import reduce_sum_count

    texts = list(texts)
    if not texts:
        raise ValueError("heldout_perplexity got no texts: pass at least one non-empty text.")
    num_processes = getattr(accelerator, "num_processes", 1) if accelerator is not None else 1
    rank = getattr(accelerator, "process_index", 0) if accelerator is not None else 0
    shard = texts[rank::num_processes]
    per_rank = math.ceil(len(texts) / num_processes)
    weights = [1.0] * len(shard) + [0.0] * (per_rank - len(shard))
    shard = shard + [texts[0]] * (per_rank - len(shard))

    if accelerator is not None:
        device = accelerator.device
    else:
        device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(shard), batch_size):
            batch_ids = tokenizer(shard[start : start + batch_size], truncation=True, max_length=max_length)[
                "input_ids"
            ]
            longest = max(len(ids) for ids in batch_ids)
            input_ids = torch.zeros((len(batch_ids), longest), dtype=torch.long)
            attention_mask = torch.zeros((len(batch_ids), longest), dtype=torch.long)
            for row, ids in enumerate(batch_ids):  # right padding: the real tokens see no pad
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            row_weight = torch.tensor(weights[start : start + batch_size], dtype=torch.float64, device=device)

            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            # position t predicts token t+1: [B, T-1, V] against [B, T-1]
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none")
            mask = attention_mask[:, 1:].to(torch.float64) * row_weight[:, None]
            total += (nll.to(torch.float64) * mask).sum()
            count += mask.sum()
    finally:
        model.train(was_training)

    total, count = reduce_sum_count(total, count, accelerator)
    if count.item() == 0:
        raise ValueError("heldout_perplexity found no token to predict: use texts longer than one token.")
    mean_nll = total.item() / count.item()
    if not mean_nll < 709.0:  # exp overflows float64 above ~709.78; NaN fails this test too
        warnings.warn(
            f"Held-out perplexity is not finite (mean negative log-likelihood {mean_nll:.4g}): the policy has "
            "diverged. Logged as inf; lower the learning rate or raise the KL coefficient.",
            stacklevel=2,
        )
        return math.inf
    return math.exp(mean_nll)


def eval_scores(trainer, prompts) -> float:
    """`eval/scores`: the mean reward of the policy's completions of `prompts` (up to `local_rollout_batch_size`
    per rank, dealt round-robin), sampled from a private random stream so that evaluating does not change the
    training run. Every rank samples as many rows as the first: a sharded policy (FSDP, ZeRO-3) needs every rank in
    every forward pass, and the rewards' statistics are reduced over ranks; a rank short of prompts fills up with
    copies of the first, weighted 0."""
    from .kl import reduce_sum_count

    args, acc = trainer.args, trainer.accelerator
    total = min(len(prompts), args.local_rollout_batch_size * acc.num_processes)
    rows = [prompts[i] for i in range(acc.process_index, total, acc.num_processes)]
    per_rank = math.ceil(total / acc.num_processes)
    weights = [1.0] * len(rows) + [0.0] * (per_rank - len(rows))
    rows += [prompts[0]] * (per_rank - len(rows))
    _, rewards = trainer.sample(rows, seed=args.seed + trainer.state.global_step)
    weights = torch.tensor(weights, dtype=torch.float64, device=rewards.scores.device)
    score_sum, count = reduce_sum_count((rewards.scores.double() * weights).sum(), weights.sum(), acc)
    return (score_sum / count).item()


def completion_rows(step: int, prompts: list, rewards, n: int = 4) -> list[dict]:
    """Up to `n` completions of an update as table rows: step, prompt, completion, score."""
    from .rewards.text import completion_text

    return [
        {"step": step, "prompt": completion_text(p), "completion": c, "score": float(s)}
        for p, c, s in list(zip(prompts, rewards.completions, rewards.scores.tolist()))[:n]
    ]
