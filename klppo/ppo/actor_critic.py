"""Value models and the actor-critic module the trainer optimises.

Two layouts (`KLPPOConfig.critic`):

- `"separate"`: the critic is a backbone of its own plus a scalar head (initialised from the policy, the
  reward model or any path; a sequence-classification model is used as backbone + its `score` head).
- `"shared"`: a scalar head on the policy's last hidden state; one forward pass gives logits and values.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

logger = logging.getLogger(__name__)


@contextmanager
def last_hidden_states(model: nn.Module, last_position: bool = False):
    """Collect the last hidden state (the decoder's output, after its final norm) of every forward pass of
    `model` inside the block, from a hook on its decoder: what a value head reads, without asking the model for
    every layer's hidden states (`output_hidden_states`), which keeps all of them alive. Yields a list that
    receives one `[B, L, H]` tensor per forward pass, or with `last_position` a copy of its last position `[B, H]`
    (per generation step: the state before the token it samples; a copy, since a compiled step may reuse its
    output's memory at the next step)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__} has no separate decoder to read the last hidden state from.")
    captured: list[torch.Tensor] = []

    @torch.compiler.disable  # a compiled decoding step runs the hook as it is: traced, the growing list would recompile
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        captured.append(hidden[:, -1].clone() if last_position else hidden)

    handle = decoder.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def lm_head_of(model: nn.Module):
    """`model`'s LM head as a function of its last hidden states `[..., H] -> [..., V]`: its output embeddings, then
    what its forward does to their output (`klppo.ppo.scoring.logprobs.head_transform`)."""
    from .scoring.logprobs import head_transform

    head = model.get_output_embeddings()
    transform = head_transform(model.config)
    return head if transform is None else (lambda hidden: transform(head(hidden)))


def _same_logits(ours: torch.Tensor, theirs: torch.Tensor, model: nn.Module) -> bool:
    """Whether the LM head run on the last hidden states (`ours`) gives the model's own logits (`theirs`), within
    rounding; if not, say once that the head is read the memory-heavy way."""
    import logging

    scale = theirs.float().abs().amax().clamp(min=1.0)
    same = ours.shape == theirs.shape and bool(((ours.float() - theirs.float()).abs().amax() <= 1e-3 * scale).item())
    if not same:
        logging.getLogger(__name__).warning(
            "The LM head of %s on its last hidden states does not give the model's own logits (its forward transforms "
            "them in a way klppo does not know), so its logits are made for every response position at once: memory "
            "then grows with batch x response length x vocabulary.",
            type(model).__name__,
        )
    return same


def _not_views(result):
    """`result` with each tensor of a dict that is a view copied: FSDP2 warns at every forward of a module that
    returns a view (an in-place op on it would skip its pre-backward hook)."""
    if not isinstance(result, dict):
        return result
    return {k: v.clone() if isinstance(v, torch.Tensor) and v._base is not None else v for k, v in result.items()}


def hidden_size_of(config) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        return hidden_size_of(text_config)
    raise ValueError(f"Cannot find the hidden size of {type(config).__name__}; pass a value_model explicitly.")


class ValueHead(nn.Module):
    """Linear map from the last hidden state to a scalar value per position.

    Initialised to zero (weight and bias), so the first advantages are the rewards-to-go themselves: a
    random head gives per-token values of std ~1, which at the start of training outweigh the reward signal
    and which advantage whitening passes on to the policy at full strength ("The N Implementation Details of
    RLHF with PPO", Huang et al. 2023, initialise the value head to zero for the same reason).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # a copy, not the squeezed view: FSDP2 warns at every forward of a module that returns a view
        return self.summary(hidden_states.to(self.summary.weight.dtype)).squeeze(-1).clone()


class CriticModel(nn.Module):
    """A transformer backbone plus a scalar head: `forward(...) -> values [B, L]`."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = head

    @classmethod
    def from_model(cls, model: nn.Module) -> "CriticModel":
        """Build from a causal-LM or sequence-classification model (its backbone; its `score` head if it has
        one with a single output, else a fresh `ValueHead`)."""
        backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        if backbone is None:
            backbone = model.get_decoder() if hasattr(model, "get_decoder") else model
        score = getattr(model, "score", None)
        if isinstance(score, nn.Linear) and score.out_features == 1:
            return cls(backbone, _LinearValue(score))
        return cls(backbone, ValueHead(hidden_size_of(model.config)))

    HEAD_FILE = "value_head.safetensors"

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """Save the critic in a folder of its own: the backbone in Hugging Face format (`AutoModel`) and the head
        in `value_head.safetensors`; `CriticModel.from_pretrained(folder)`, or `value_model=folder` in the
        trainer, loads it back (to resume elsewhere, or to start another run's critic from it). `kwargs` go to the
        backbone's `save_pretrained` (e.g. `state_dict`, for weights gathered from shards)."""
        import json
        import os

        from safetensors.torch import save_file

        state_dict = kwargs.pop("state_dict", None)
        if state_dict is None:
            state_dict = self.state_dict()
        backbone_sd = {k[len("backbone.") :]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        head_sd = {
            k[len("head.") :]: v.detach().cpu().contiguous() for k, v in state_dict.items() if k.startswith("head.")
        }
        self.backbone.save_pretrained(save_directory, state_dict=backbone_sd, **kwargs)
        save_file(head_sd, os.path.join(save_directory, self.HEAD_FILE))
        with open(os.path.join(save_directory, "value_head.json"), "w") as f:
            json.dump({"head": type(self.head).__name__}, f)

    @classmethod
    def is_saved_critic(cls, path) -> bool:
        """Whether `path` is a folder written by `save_pretrained`."""
        import os

        return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, cls.HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, **kwargs) -> "CriticModel":
        """Load a critic saved by `save_pretrained`; `kwargs` go to `AutoModel.from_pretrained`."""
        import json
        import os

        from safetensors.torch import load_file
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype, **kwargs)
        with open(os.path.join(path, "value_head.json")) as f:
            kind = json.load(f)["head"]
        head_sd = load_file(os.path.join(path, cls.HEAD_FILE))
        if kind == "_LinearValue":
            weight = head_sd["score.weight"]
            head = _LinearValue(nn.Linear(weight.shape[1], weight.shape[0], bias="score.bias" in head_sd))
        else:
            head = ValueHead(hidden_size_of(backbone.config))
        head.load_state_dict(head_sd)
        return cls(backbone, head.to(dtype))

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.head(out.last_hidden_state)


class _LinearValue(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.score = linear

    def forward(self, hidden_states):
        return self.score(hidden_states.to(self.score.weight.dtype)).squeeze(-1).clone()  # not a view, as ValueHead


class ActorCritic(nn.Module):
    """Policy and critic as one module, so that one optimizer and one data-parallel wrapper cover both.

    `forward(input_ids, attention_mask, position_ids) -> (logits, values)`; with `compute_values=False`, or
    with neither a critic nor a value head (the critic-free advantage estimators), `values` is None;
    `response_length=R` computes logits only at the R positions that predict the last R tokens
    (`klppo.ppo.scoring.logprobs.response_positions`), `[B, R, V]`; `detach_value_input` overrides the constructor's for one call (a
    critic trained alone).

    With `read`, the logits are never made at once: `forward` returns `(read(source), values)`, with `source` a
    `klppo.ppo.scoring.logprobs.ResponseLogits` of the policy's last hidden states at the R predicting positions `[B, R, H]`
    and its LM head (`policy_head`), which the caller runs on blocks of positions (`read_response`). For a model
    whose logits `policy_head` does not reproduce (checked once, on the first such pass), `source` holds the
    model's own logits `[B, R, V]` instead.
    """

    def __init__(
        self,
        policy: nn.Module,
        critic: nn.Module | None = None,
        value_head: nn.Module | None = None,
        detach_value_input: bool = False,
    ):
        super().__init__()
        if critic is not None and value_head is not None:
            raise ValueError("ActorCritic takes at most one of `critic` (separate) or `value_head` (shared).")
        self.policy = policy
        self.critic = critic
        self.value_head = value_head
        # shared critic: with True, the value loss trains the head only, never the policy's trunk
        self.detach_value_input = detach_value_input
        # whether `policy_head` on the last hidden states gives the policy's logits: checked on the first forward
        # pass that reads the head in blocks (None until then); False: such passes read the model's own logits
        self.head_reads_hidden: bool | None = None

    @property
    def shared(self) -> bool:
        return self.value_head is not None

    @property
    def has_critic(self) -> bool:
        return self.critic is not None or self.value_head is not None

    @property
    def config(self):
        return self.policy.config

    @property
    def _no_split_modules(self) -> list[str]:
        """The transformer blocks of the policy and the critic: the units FSDP's transformer-based wrap shards."""
        blocks = set(getattr(self.policy, "_no_split_modules", None) or [])
        if self.critic is not None:
            backbone = self.critic.backbone
            blocks |= set(getattr(backbone, "_no_split_modules", None) or [])
        return sorted(blocks)

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        compute_values: bool = True,
        response_length: int = 0,
        detach_value_input: bool | None = None,
        read=None,
    ):
        from .scoring.logprobs import ResponseLogits, response_positions

        keep = response_positions(response_length, input_ids.shape[1], input_ids.device) if response_length else 0
        if read is not None and not response_length:
            raise ValueError("ActorCritic: `read` needs `response_length`.")
        from_hidden = read is not None and self.head_reads_hidden is not False
        if from_hidden:  # the model's own head on one position only: the check of `head_reads_hidden`
            keep = keep[-1:]
        shared_values = compute_values and self.shared
        with last_hidden_states(self.policy) if shared_values or from_hidden else nullcontext([None]) as hidden:
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
            )
        values = None
        if compute_values and self.has_critic:
            if self.shared:
                last = hidden[-1]
                detach = self.detach_value_input if detach_value_input is None else detach_value_input
                values = self.value_head(last.detach() if detach else last)
            else:
                values = self.critic(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        if read is None:
            return out.logits, values
        vocab = out.logits.shape[-1]
        if from_hidden:
            positions = response_positions(response_length, input_ids.shape[1], input_ids.device)
            states = hidden[-1].index_select(1, positions)  # [B, R, H], contiguous
            head = self.policy_head
            if self.head_reads_hidden is None:
                self.head_reads_hidden = _same_logits(head(states[:, -1:].detach()), out.logits.detach(), self.policy)
            if self.head_reads_hidden:
                return _not_views(read(ResponseLogits.from_hidden(states, head, vocab))), values
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=positions,
            )
        return _not_views(read(ResponseLogits.from_logits(out.logits))), values

    @property
    def policy_head(self):
        """The policy's LM head as a function of its last hidden states: `get_output_embeddings()` and what the
        model's forward does to its output (`klppo.ppo.scoring.logprobs.head_transform`)."""
        return lm_head_of(self.policy)

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether activation (gradient) checkpointing is on in any part of the actor-critic."""
        return any(getattr(m, "gradient_checkpointing", False) is True for m in self.modules())

    is_gradient_checkpointing = is_activation_checkpointing  # the name transformers < 5.20 reads

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        for module in self._backbones():
            _checkpointing(module, True, activation_checkpointing_kwargs)

    def activation_checkpointing_disable(self):
        for module in self._backbones():
            _checkpointing(module, False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """The name and keyword that transformers < 5.20 and TRL's `unwrap_model_for_generation` use."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs)

    gradient_checkpointing_disable = activation_checkpointing_disable

    def tie_weights(self, **kwargs) -> None:
        """Tie the policy's weights (and a separate critic's) as their configs say. accelerate's FSDP2 preparation
        with `cpu_ram_efficient_loading` moves the model to the meta device, which unties tied embeddings, then ties
        them again through this method: without it a tied LM head would train apart from its embedding, and the
        saved model (which keeps one of the two) would not be the trained one."""
        for module in self._backbones():
            if not hasattr(module, "tie_weights"):
                continue
            try:
                module.tie_weights()
            except KeyError:  # a LoRA layer wrapped around a tied LM head (transformers cannot set its weight)
                logger.warning(
                    "The policy's LM head is tied to its embedding and wrapped by a LoRA layer: its tie could not "
                    "be restored, so the two train apart under FSDP2. Leave lm_head out of lora_target_modules."
                )

    def _backbones(self) -> list[nn.Module]:
        return [self.policy] + ([self.critic.backbone] if self.critic is not None else [])


def _checkpointing(module: nn.Module, enable: bool, kwargs=None) -> None:
    """Turn activation checkpointing on or off through the model's current API (transformers >= 5.20 names it
    `activation_checkpointing_*`; older versions and other modules `gradient_checkpointing_*`)."""
    if enable:
        if hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(module, "gradient_checkpointing_enable"):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif hasattr(module, "activation_checkpointing_disable"):
        module.activation_checkpointing_disable()
    elif hasattr(module, "gradient_checkpointing_disable"):
        module.gradient_checkpointing_disable()
