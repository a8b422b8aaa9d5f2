"""A sequence-classification reward model as a TRL-style reward function."""

from __future__ import annotations

from pathlib import Path

import torch

from .text import completion_text, is_conversational


class RewardModelFunction:
    """Score ``prompt + completion`` with a sequence-classification model (one output logit).

    Calling it follows TRL's reward-function signature
    ``fn(prompts, completions, completion_ids=None, **kwargs) -> list[float]`` and returns
    ``logits[:, label_index]`` for each pair, computed in batches, in eval mode, without gradients.

    Text sent to the reward model:

    - conversational inputs and a reward tokenizer with a chat template: the chat template applied
      to ``prompt_messages + completion_messages``, tokenized without extra special tokens (the
      template already holds them), as TRL does;
    - otherwise: ``prompt_text + completion_text`` (the last message's content of each, when
      conversational), tokenized with the tokenizer's special tokens.

    Sequences are right-padded and truncated from the left to ``max_length`` tokens, so the end of
    the completion (what the reward model reads last) is always kept.

    With ``token_ids=True`` the reward model reads the policy's own tokens, as TRL's PPO did: the
    ``prompt_ids`` and ``completion_ids`` the trainer passes (the completion up to and including its
    stop token), concatenated, with nothing decoded or re-encoded. This needs a reward model that
    shares the policy's tokenizer; `load_reward_funcs(..., policy_tokenizer=...)` turns it on when
    the two vocabularies are the same. The tokenizer then only gives the pad token id.

    Args:
        model_or_path: an ``AutoModelForSequenceClassification`` model, or a Hub id / local folder
            (or a special ``klppo:`` id) to load one from.
        tokenizer: the reward model's tokenizer; by default loaded from ``model_or_path`` (or the
            model's ``name_or_path``).
        batch_size: pairs per forward pass; `None`: 64 when the model is on a GPU (one or few large forward
            passes keep it busy), 8 elsewhere (a CPU keeps memory small).
        max_length: tokens per pair after truncation.
        device: where inputs go; by default the device of the model's first parameter, read at each
            call, so moving ``.model`` (e.g. by a trainer) is followed.
        label_index: the logit used as reward. ``None`` requires a model with exactly one label
            (``num_labels == 1``) and uses logit 0; set it to use, e.g., the "positive" logit of a
            two-class classifier.
        token_ids: score the policy's token ids (``prompt_ids`` + ``completion_ids``) instead of
            re-tokenized text; needs the policy's tokenizer.
        model_kwargs: passed to ``from_pretrained`` when loading from a path (e.g. ``dtype``).

    Attributes:
        model: the ``nn.Module``, frozen (``requires_grad=False``) and in eval mode.
        tokenizer: the tokenizer.
        __name__: the model's folder or repository name, for metric names.
    """

    def __init__(
        self,
        model_or_path,
        tokenizer=None,
        batch_size: int | None = None,
        max_length: int = 512,
        device=None,
        label_index: int | None = None,
        token_ids: bool = False,
        **model_kwargs,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ..models import ensure_pad_token, resolve_model_path

        if isinstance(model_or_path, (str, Path)):
            source = str(model_or_path)
            model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(source), **model_kwargs)
        else:
            model = model_or_path
            source = getattr(model.config, "name_or_path", "") or ""
        if tokenizer is None:
            if not source:
                raise ValueError(
                    "RewardModelFunction got a model with no name_or_path to load its tokenizer from: "
                    "pass tokenizer=..."
                )
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(source))

        num_labels = model.config.num_labels
        if label_index is None:
            if num_labels != 1:
                raise ValueError(
                    f"Reward model {source!r} has {num_labels} labels; a reward model has one output. "
                    "Pass label_index=<the logit to use as reward> (e.g. the 'positive' class of a "
                    "classifier), or wrap the model in your own reward function."
                )
            label_index = 0
        elif not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index} is out of range for a model with {num_labels} labels.")

        ensure_pad_token(tokenizer, f"reward model {source}")
        if model.config.pad_token_id is None:
            # Sequence-classification heads find each sequence's last token through the pad id.
            model.config.pad_token_id = tokenizer.pad_token_id

        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.label_index = label_index
        self.token_ids = token_ids
        self.__name__ = Path(source.rstrip("/")).name if source else type(model).__name__

    def use_token_ids_if_shared(self, policy_tokenizer) -> bool:
        """Score token ids (``token_ids``) when this reward model's tokenizer has the same vocabulary as the
        policy's, so that its ids mean the same tokens. Returns the choice."""
        self.token_ids = (
            self.tokenizer is policy_tokenizer or self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        )
        return self.token_ids

    def _batch_size(self, device) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return 64 if torch.device(device).type == "cuda" else 8

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        """Scores of token-id sequences (each prompt + completion), cut from the left to ``max_length``.

        Rows are left-padded (masked, with position ids counted from the first real token, as TRL's
        ``get_reward`` did), so the last position holds each row's last token whatever the pad id, which may
        lie outside the reward model's vocabulary (a pad token the policy's tokenizer added). As in TRL, a
        trailing token equal to the model's pad id (an EOS that doubles as pad) is not the one scored."""
        device = self.device if self.device is not None else next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        scores: list[torch.Tensor] = []
        size = self._batch_size(device)
        try:
            for start in range(0, len(sequences), size):
                batch = [list(s)[-self.max_length :] for s in sequences[start : start + size]]
                width = max(len(s) for s in batch)
                input_ids = torch.tensor([[0] * (width - len(s)) + s for s in batch], device=device)
                mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in batch], device=device)
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits
                scores.append(logits[:, self.label_index].float())
        finally:
            self.model.train(was_training)
        return torch.cat(scores).tolist() if scores else []  # one host sync, not one per batch

    def __repr__(self) -> str:
        return f"RewardModelFunction({self.__name__!r}, batch_size={self.batch_size}, max_length={self.max_length})"

    def format(self, prompt, completion) -> tuple[str, bool]:
        """The text scored for one pair and whether it already holds its special tokens."""
        use_template = bool(self.tokenizer.chat_template) and (
            is_conversational(prompt) or is_conversational(completion)
        )
        if use_template:
            if not is_conversational(prompt):
                prompt = [{"role": "user", "content": completion_text(prompt)}]
            if not is_conversational(completion):
                completion = [{"role": "assistant", "content": completion_text(completion)}]
            text = self.tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
            return text, True
        return completion_text(prompt) + completion_text(completion), False

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids=None, prompt_ids=None, **kwargs) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"Got {len(prompts)} prompts and {len(completions)} completions: they must pair up.")
        if self.token_ids:
            if prompt_ids is None or completion_ids is None:
                raise ValueError(
                    f"{self!r} scores token ids (token_ids=True) but was called without `prompt_ids` and "
                    "`completion_ids`; KLPPOTrainer passes both. Called by hand, pass them, or use token_ids=False."
                )
            return self.score_ids([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)])
        formatted = [self.format(p, c) for p, c in zip(prompts, completions)]
        device = self.device if self.device is not None else next(self.model.parameters()).device
        was_training = self.model.training
        truncation_side = self.tokenizer.truncation_side
        self.model.eval()
        self.tokenizer.truncation_side = "left"
        scores: list[float] = []
        try:
            size = self._batch_size(device)
            for start in range(0, len(formatted), size):
                batch = formatted[start : start + size]
                batch_scores = [0.0] * len(batch)
                # A batch is all templated or all plain text in practice; split it if mixed.
                for has_specials in sorted({s for _, s in batch}):
                    idx = [i for i, (_, s) in enumerate(batch) if s == has_specials]
                    enc = self.tokenizer(
                        [batch[i][0] for i in idx],
                        return_tensors="pt",
                        padding=True,
                        padding_side="right",
                        truncation=True,
                        max_length=self.max_length,
                        add_special_tokens=not has_specials,
                    ).to(device)
                    logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                    for i, value in zip(idx, logits[:, self.label_index].float().tolist()):
                        batch_scores[i] = value
                scores.extend(batch_scores)
        finally:
            self.tokenizer.truncation_side = truncation_side
            self.model.train(was_training)
        return scores
