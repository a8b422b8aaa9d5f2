"""Prompts into rollout batches: dataset rows tokenized into left-padded batches, and the endless, seeded stream of
batches a run draws from."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader

from ..rewards.text import is_conversational
from .results import PromptBatch

logger = logging.getLogger(__name__)


def prompt_token_ids(features: list[dict], tokenizer, max_prompt_length: int | None) -> tuple[list, list[list[int]]]:
    """The prompts of dataset rows and their token ids, as `collate_prompts` reads them (unpadded)."""
    if "prompt" not in features[0]:  # pre-tokenized, as TRL's PPO scripts prepare their datasets
        ids = [list(f["input_ids"]) for f in features]
        prompts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    elif is_conversational(features[0]["prompt"]):
        prompts = [f["prompt"] for f in features]
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        ids = tokenizer(texts, add_special_tokens=False, padding=False)["input_ids"]
    else:
        prompts = [f["prompt"] for f in features]
        ids = tokenizer(prompts, padding=False)["input_ids"]
    if max_prompt_length:
        ids = [x[-max_prompt_length:] for x in ids]
    return prompts, ids


def collate_prompts(features: list[dict], tokenizer, max_prompt_length: int | None) -> PromptBatch:
    """Tokenize dataset rows (a `prompt` column, plain or conversational) into a left-padded batch. A
    conversational prompt goes through the tokenizer's chat template with the generation prompt; rows of
    pre-tokenized `input_ids` (and no `prompt`) are used as they are, their decoded text standing for the prompt.
    Prompts longer than `max_prompt_length` keep their last tokens. Other columns travel in `extra`."""
    prompts, ids = prompt_token_ids(features, tokenizer, max_prompt_length)
    if "prompt" not in features[0]:
        features = [{k: v for k, v in f.items() if k not in ("input_ids", "attention_mask")} for f in features]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    extra = {k: [f[k] for f in features] for k in features[0] if k != "prompt"}
    return PromptBatch(prompts, input_ids, attention_mask, extra)


def longest_prompt(datasets, tokenizer, max_prompt_length: int, chunk: int = 1024) -> int:
    """The most tokens any prompt of `datasets` (None entries skipped) has once tokenized as `collate_prompts` does,
    at most `max_prompt_length`: the widest batch a run's rollouts and evaluations can have. The scan stops at the
    first prompt that reaches `max_prompt_length`."""
    longest = 0
    for dataset in datasets:
        if dataset is None:
            continue
        if "prompt" not in dataset.column_names:  # pre-tokenized: the lengths are there
            longest = max(longest, max(map(len, dataset["input_ids"]), default=0))
            continue
        for start in range(0, len(dataset), chunk):
            rows = list(dataset.select(range(start, min(start + chunk, len(dataset)))))
            longest = max(longest, *(len(x) for x in prompt_token_ids(rows, tokenizer, max_prompt_length)[1]))
            if longest >= max_prompt_length:
                return max_prompt_length
    return min(longest, max_prompt_length) or max_prompt_length


def endless_prompt_batches(dataset, batch_size: int, collate, accelerator, seed: int, skip: int = 0):
    """Endless rollout batches of prompts for this rank, reshuffled each pass (seeded); the first `skip`
    batches are skipped (a resumed run continues where the checkpoint stopped). A prompt set smaller than one
    global rollout batch is cycled: each pass holds it as many times as one batch needs."""
    global_batch = batch_size * accelerator.num_processes
    if len(dataset) < global_batch:
        repeats = -(-global_batch // len(dataset))
        logger.info(
            "The prompt set (%d prompts) is smaller than one rollout batch of all processes (%d): each pass "
            "over it holds every prompt %d times.",
            len(dataset),
            global_batch,
            repeats,
        )
        dataset = dataset.select([i % len(dataset) for i in range(repeats * len(dataset))])
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
    )
    loader = accelerator.prepare_data_loader(loader)
    seen, epoch = 0, 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for batch in loader:
            seen += 1
            if seen > skip:
                yield batch
        epoch += 1
