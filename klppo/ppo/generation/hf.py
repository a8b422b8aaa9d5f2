"""The `generate` engine: `GenerateEngine` turns a batch of prompts into sampled responses with transformers'
`generate` on the trainer's own model (the seam: `engine.py`).

It holds what sampling keeps from one rollout to the next: the sampling configuration (stop token, suppressed ids,
temperature), and with a static KV cache the caches themselves and the merged LoRA weights that the compiled
decoding step reads (`static_cache.py`). Each rollout it takes the policy out of its engine (ZeRO-3 gathers the
weights, activation checkpointing is turned off around decoding), puts it in its sampling form (eval mode, the adapter
merged) and decodes the whole batch in one `generate` call (`sampling.generate_responses`). Its sampling
distribution is the trainer's own forward at the same weights: nothing to sync, nothing to correct.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from trl.distributed import DistributedBackend
from trl.models.utils import unwrap_model_for_generation

from ..distributed import restore_zero3_hooks, root_unsharded, unwrap
from ..prompts import longest_prompt
from ..results import PromptBatch
from .engine import GenerationEngine, Sampled
from .sampling import Generation, contiguous_lm_head_input, generate_responses, sampling_setup
from .static_cache import StaticCaches, merged_lora, supports_static_cache

logger = logging.getLogger(__name__)


class GenerateEngine(GenerationEngine):
    """Samples a rollout's responses with `generate`, as the run's configuration and the KL plan say.

    Args:
        args: the run's `KLPPOConfig`.
        accelerator: the trainer's accelerator.
        tokenizer: the policy's tokenizer.
        policy: the policy (before distributed wrapping; its generation config fills unset sampling fields).
        engine: `"deepspeed"`, `"fsdp"` or None.
        checkpointing_kwargs: the kwargs activation checkpointing was turned on with (None: off).
        prompt_sets: the datasets whose prompts the run decodes (training, evaluation): a static cache is as long
            as their longest prompt allows (`klppo.ppo.prompts.longest_prompt`); none: `max_prompt_length`.

    Attributes:
        stop_token_id, suppressed_ids, generation_config: the sampling setup (`klppo.ppo.generation.sampling.sampling_setup`).
        static_caches: the static KV caches (`cache_implementation`), or None for transformers' dynamic cache.
    """

    name = "generate"

    def __init__(
        self, args, accelerator, tokenizer, policy, engine: str | None, checkpointing_kwargs=None, prompt_sets=()
    ):
        self.args, self.accelerator, self.engine = args, accelerator, engine
        self.pad_token_id = tokenizer.pad_token_id
        self._unwrapped = self._wrapped = None  # the actor-critic to decode with, inside `generating`
        self.checkpointing_kwargs = checkpointing_kwargs
        self.stop_token_id, self.suppressed_ids, self.generation_config = sampling_setup(
            args, tokenizer, getattr(policy, "generation_config", None)
        )
        self.static_caches = self._static_caches(policy, tokenizer, prompt_sets)
        if self.static_caches is not None:  # `generate` compiles its decoding step as configured
            self.generation_config.compile_config = args.compile_config()
        self.merged_weights: dict = {}  # with a static cache, the merged LoRA weights, kept for the run

    @property
    def compiled(self) -> bool:
        """Whether the decoding step is compiled (a static cache)."""
        return self.static_caches is not None

    def _static_caches(self, policy, tokenizer, prompt_sets) -> StaticCaches | None:
        """The static KV caches to decode into, with the decoding step compiled (`cache_implementation`), or None
        (the dynamic cache). `"auto"` takes them on a GPU; a model that transformers does not mark as compilable,
        DeepSpeed ZeRO-3, FSDP and a run without `max_prompt_length` keep the dynamic cache, with one log line."""
        args, choice = self.args, self.args.cache_implementation
        if choice == "dynamic" or (choice == "auto" and self.accelerator.device.type != "cuda"):
            return None
        why = None
        if not supports_static_cache(policy):
            why = f"{type(policy).__name__} is not marked as compilable by transformers"
        elif DistributedBackend(self.accelerator).is_zero3 or self.engine == "fsdp":
            why = "DeepSpeed ZeRO-3 and FSDP gather the weights anew for every rollout"
        elif args.max_prompt_length is None:
            why = "there is no max_prompt_length to size it"
        if why:
            if self.accelerator.is_main_process:
                logger.warning(
                    "Generation decodes into the dynamic KV cache, uncompiled: the static cache "
                    "(cache_implementation=%r) is not used, as %s.",
                    choice,
                    why,
                )
            return None
        width = args.max_prompt_length
        if any(dataset is not None for dataset in prompt_sets):
            width = longest_prompt(prompt_sets, tokenizer, args.max_prompt_length)
        caches = StaticCaches(policy.config, width, args.response_length, args.max_prompt_length)
        if self.accelerator.is_main_process:
            logger.info(
                "Generation decodes into a static KV cache of %d positions (the longest prompt, %d tokens, "
                "plus the response), its decoding step compiled (%s).",
                caches.max_len,
                width,
                args.compile_config(),
            )
        return caches

    @contextmanager
    def unwrapped(self, model_wrapped):
        """The actor-critic to generate with: TRL's `unwrap_model_for_generation` where it does work (ZeRO-3 gathers
        the weights, activation checkpointing is turned off around decoding and back on after it, with the run's
        kwargs), else the model itself. When the block raises, TRL's context restores neither ZeRO-3's hooks nor
        activation checkpointing; both come back here, for whatever runs next on the model."""
        model = unwrap(self.accelerator, model_wrapped)
        checkpointing = model.is_activation_checkpointing
        if not (self.engine == "deepspeed" or checkpointing):
            yield model
            return
        kwargs = self.checkpointing_kwargs
        try:
            with unwrap_model_for_generation(
                model_wrapped, self.accelerator, gradient_checkpointing_kwargs=kwargs
            ) as out:
                yield out
        except BaseException:
            if DistributedBackend(self.accelerator).is_zero3:
                restore_zero3_hooks(model_wrapped)
            if checkpointing and not model.is_activation_checkpointing:
                model.activation_checkpointing_enable(kwargs)
            raise

    @contextmanager
    def sampling_form(self, policy):
        """The policy as it samples: in eval mode (dropout is off in training too; one mode keeps a compiled decoding
        step from recompiling when training switches the model to train mode); the LM head's input made contiguous
        (generation's first step); a LoRA adapter merged into copies of the base weights
        (`merge_adapter_for_generation`), except under DeepSpeed or FSDP, whose sharded parameters are not plain
        tensors to copy. With a static cache the copies are kept for the run, so that the compiled step reads the
        same tensors at every rollout."""
        merge = self.args.experimental.merge_adapter_for_generation and self.engine is None
        buffers = self.merged_weights if self.compiled else None
        modes = {module: module.training for module in policy.modules()}
        policy.eval()
        try:
            with contiguous_lm_head_input(policy), merged_lora(policy, buffers) if merge else nullcontext():
                yield
        finally:
            for module, training in modes.items():
                module.training = training

    @contextmanager
    def generating(self, model_wrapped):
        """Around one rollout: the actor-critic unwrapped for decoding (`unwrapped`); yields the model to score
        with: under ZeRO-3 the unwrapped one, whose weights gathered for generation serve the scoring passes too
        (one gather per rollout instead of one per layer and forward pass), elsewhere the wrapped model."""
        with self.unwrapped(model_wrapped) as unwrapped:
            self._unwrapped, self._wrapped = unwrapped, model_wrapped
            try:
                yield unwrapped if DistributedBackend(self.accelerator).is_zero3 else model_wrapped
            finally:
                self._unwrapped = self._wrapped = None

    def generate(self, batch: PromptBatch, plan) -> Sampled:
        """One batch of prompts through `generate` (inside `generating`): the sequences, and what was read while
        decoding (the trainer's own log-probs: no `sampling_logp`)."""
        unwrapped = self._unwrapped
        with root_unsharded(self._wrapped), self.sampling_form(unwrapped.policy):
            generated = self.decode(unwrapped, batch.input_ids, batch.attention_mask, plan)
        sequences = self.sequences(batch, generated.tokens, self.pad_token_id, generated.finite)
        return Sampled(sequences, generated._replace(tokens=sequences.responses))

    def decode(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan) -> Generation:
        """Responses of `model` (the unwrapped actor-critic, in its sampling form) to left-padded prompts, reading
        while decoding what `plan` says (`KLPlan.read_while_decoding`, `keep_generation_logits`). With a static
        cache, a batch smaller than the rollout's (an evaluation's, the last prompts) is padded to its size with
        copies of its first row, dropped after decoding, so that it decodes with the rollout's compiled step instead
        of compiling one of its own."""
        rows, cache = input_ids.shape[0], None
        if self.compiled:
            size = max(rows, self.args.local_rollout_batch_size)
            fill = size - rows
            input_ids = torch.cat([input_ids, input_ids[:1].expand(fill, -1)]) if fill else input_ids
            attention_mask = (
                torch.cat([attention_mask, attention_mask[:1].expand(fill, -1)]) if fill else attention_mask
            )
            cache = self.static_caches(size, input_ids.shape[1])
        generated = generate_responses(
            model.policy,
            input_ids,
            attention_mask,
            self.generation_config,
            with_logprobs=plan.read_while_decoding,
            value_head=model.value_head if plan.read_while_decoding else None,
            keep_logits=plan.keep_generation_logits,
            synced=self.engine == "fsdp" and self.accelerator.num_processes > 1,
            check_finite=False,
            cache=cache,
        )
        if generated.tokens.shape[0] == rows:
            return generated
        return generated._replace(
            **{name: value[:rows] for name, value in generated._asdict().items() if isinstance(value, torch.Tensor)}
        )
