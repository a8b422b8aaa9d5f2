"""What generation decodes with, kept from one rollout to the next: static KV caches (one per batch size) for the
compiled decoding step, and LoRA adapters merged into copies of the base weights."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager

import torch
from torch import nn

logger = logging.getLogger(__name__)


def mergeable_lora_layers(model) -> list | None:
    """The LoRA layers of a PEFT `model` when every one is a plain `lora.Linear` whose active adapters can be
    merged into a floating-point base weight of its own; None when none exists or any layer is otherwise (quantized
    base layers, LoRA variants such as DoRA or aLoRA, `target_parameters` wrappers, or a base weight shared with
    another parameter, as tied embeddings are: merging one module's update would change the other's)."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    storages = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    for layer in layers:
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if type(layer) is not LoraLinear or layer.merged or getattr(layer, "disable_adapters", False):
            return None
        if getattr(layer, "lora_variant", None) or getattr(layer, "parameter_name", None):
            return None
        if type(weight) is not nn.Parameter or not weight.is_floating_point() or storages[weight.data_ptr()] != 1:
            return None
    return layers or None


@contextmanager
def merged_lora(model, buffers: dict | None = None):
    """Sample from `model` with its active LoRA adapters merged into the base weights, then give the base weights
    back bit for bit.

    An unmerged LoRA layer runs its base matmul plus two small ones and a few elementwise ops; over the hundreds
    of LoRA layers and the dozens of decoding steps of one rollout, that overhead is a large part of generation.
    Merging (PEFT's own `merge`) writes `W + B A * scale` into a copy of each base weight; the original tensors are
    put back afterwards, so the base model (which is the reference when the adapter is disabled) never changes, not
    even by rounding, as subtracting the update again would. The logits differ from the unmerged model's by rounding
    only (about 1e-5 to 1e-4 in float32). No-op for a model without LoRA layers, or with a layer whose base weight is
    not a plain floating-point parameter of its own (see `mergeable_lora_layers`: those keep the unmerged path).

    `buffers` None: the copies are fresh tensors, freed after the block (one extra set of the targeted base weights
    while sampling). A dict: the copies are kept in it, by layer, and reused by every later call, so that the merged
    weights are the same tensors at every rollout (what a compiled decoding step with CUDA graphs needs: it records
    the weights' addresses); they then hold that memory for the whole run."""
    layers = mergeable_lora_layers(model)
    if not layers:
        yield
        return
    saved = []
    try:
        for layer in layers:
            base = layer.get_base_layer()
            bias = getattr(base, "bias", None)
            saved.append(
                (layer, base, base.weight.data, None if bias is None else bias.data, list(layer.merged_adapters))
            )
            base.weight.data = _merge_copy(base.weight.data, buffers, (id(layer), "weight"))
            if bias is not None:
                bias.data = _merge_copy(bias.data, buffers, (id(layer), "bias"))
            with torch.no_grad():
                layer.merge()  # in place, on the copies
        yield
    finally:
        for layer, base, weight, bias, merged in reversed(saved):
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            layer.merged_adapters = merged


def _merge_copy(tensor: torch.Tensor, buffers: dict | None, key) -> torch.Tensor:
    """A copy of `tensor` to merge into: a fresh one, or `buffers[key]` (made once) refilled."""
    if buffers is None:
        return tensor.clone()
    copy_ = buffers.get(key)
    if copy_ is None or copy_.shape != tensor.shape or copy_.dtype != tensor.dtype or copy_.device != tensor.device:
        copy_ = buffers[key] = torch.empty_like(tensor)
    return copy_.copy_(tensor)


class StaticCaches:
    """Static KV caches for generation (`cache_implementation="static"`), one per batch size, each of `max_len`
    positions: the widest prompt batch the run will decode (`prompt_width`) plus the response. Made once and
    reused by every rollout.

    With a static cache `generate` compiles the decoding step (on a GPU; `generation_config.compile_config` says how).
    Every tensor the compiled step sees then keeps its shape from one rollout to the next whatever the prompts'
    width, since the cache is as long as the widest batch: the step compiles once per batch size, and the policy's
    weight updates change values, not shapes. Each decoding step attends over the whole cache, so a cache no longer
    than the prompts need keeps that step short. A batch wider than `prompt_width` (prompts from outside the run's
    datasets) makes every cache `max_prompt_length` wide, once, and the step compiles again for it."""

    def __init__(self, config, prompt_width: int, response_length: int, max_prompt_length: int):
        self.config, self.response_length, self.max_prompt_length = config, int(response_length), int(max_prompt_length)
        self.prompt_width = min(int(prompt_width), self.max_prompt_length)
        self.caches: dict[int, object] = {}

    @property
    def max_len(self) -> int:
        """The caches' length in positions."""
        return self.prompt_width + self.response_length

    def __call__(self, batch_size: int, prompt_width: int = 0):
        from transformers import StaticCache

        if prompt_width > self.prompt_width:
            logger.warning(
                "A prompt batch %d tokens wide is wider than the run's prompts (%d): the static KV caches "
                "grow to max_prompt_length + response_length = %d positions, and the decoding step "
                "compiles again.",
                prompt_width,
                self.prompt_width,
                self.max_prompt_length + self.response_length,
            )
            self.prompt_width, self.caches = self.max_prompt_length, {}
        if batch_size not in self.caches:
            self.caches[batch_size] = StaticCache(config=self.config, max_cache_len=self.max_len)
        return self.caches[batch_size]


def supports_static_cache(model) -> bool:
    """Whether `model` (or the model inside a PEFT wrapper) decodes into a static cache: transformers marks the
    model classes whose forward compiles as one graph (`_can_compile_fullgraph`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "_can_compile_fullgraph", False))
