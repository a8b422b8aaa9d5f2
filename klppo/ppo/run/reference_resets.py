"""Reference resets (`ref_reset_steps`): the reference becomes the current policy, as in long RL runs that reset it
(ProRL, arXiv 2505.24864, resets the reference and the optimizer).

What a reset does depends on what the reference is:

- a frozen copy (full fine-tuning): the policy's weights are copied into it;
- the policy with its LoRA adapter disabled: the adapter is merged into the base weights and a new one starts (the
  identity: its B matrices are zero), so the policy does not change and the adapter-disabled policy is the policy
  of the reset;
- a frozen copy of a pre-trained adapter (`ref_adapter_name`): the active adapter is copied into it.

Each is a set of tensors of the reference, the ones `reference_tensors` names: a checkpoint saves them (and their
values before the first reset, which score the KL to the initial model), so that a resumed run continues exactly.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def lora_layers(policy: nn.Module) -> list:
    """The LoRA layers of a PEFT policy that hold its active adapter."""
    from peft.tuners.lora import LoraLayer

    adapter = policy.active_adapter
    return [m for m in policy.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]


def reference_tensors(
    policy: nn.Module, ref_model: nn.Module | None, ref_adapter: str | None, adapter_reference: bool
) -> dict[str, torch.Tensor]:
    """`{name: tensor}` of what a reset writes: the frozen reference's weights; the base weights under the policy's
    LoRA layers; or the reference adapter's weights. Names are the policy's (or the reference model's)."""
    if not adapter_reference:
        return dict(ref_model.named_parameters())
    params = dict(policy.named_parameters())
    if ref_adapter is not None:
        return {n: p for n, p in params.items() if f".{ref_adapter}." in n}
    names = {id(layer.get_base_layer().weight): None for layer in lora_layers(policy)}
    return {n: p for n, p in policy.named_parameters(remove_duplicate=False) if id(p) in names}


@torch.no_grad()
def reset_reference(
    policy: nn.Module, ref_model: nn.Module | None, ref_adapter: str | None, adapter_reference: bool
) -> None:
    """Make the reference the current policy (see the module docstring); the policy itself does not change."""
    if not adapter_reference:
        source = dict(policy.named_parameters())
        for name, param in ref_model.named_parameters():
            param.copy_(source[name])
        return
    adapter = policy.active_adapter
    if ref_adapter is not None:
        params = dict(policy.named_parameters())
        for name, param in params.items():
            if f".{adapter}." in name:
                params[name.replace(f".{adapter}.", f".{ref_adapter}.")].copy_(param)
        return
    init = policy.peft_config[adapter].init_lora_weights
    for layer in lora_layers(policy):
        base = layer.get_base_layer()
        base.weight.add_(layer.get_delta_weight(adapter).to(base.weight.dtype))
        layer.reset_lora_parameters(adapter, init if init is not False else True)  # B = 0: the identity again


@contextmanager
def swapped_in(tensors: dict[str, torch.Tensor], values: dict[str, torch.Tensor]):
    """Inside the block, each of `tensors` holds `values[name]` (its storage swapped, not copied); they get their
    own back afterwards, bit for bit."""
    saved = {name: t.data for name, t in tensors.items()}
    try:
        for name, t in tensors.items():
            t.data = values[name].to(device=t.device, dtype=t.dtype)
        yield
    finally:
        for name, t in tensors.items():
            t.data = saved[name]


def clear_optimizer_state(optimizer) -> None:
    """Forget every parameter's optimizer state (Adam's moments and step counts), as at the start of training."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's wrapper
    optimizer.state.clear()


def check_reference_resets(
    fsdp: bool, policy: nn.Module, ref_model: nn.Module | None, adapter_reference: bool, ref_adapter: str | None
) -> None:
    """`ref_reset_steps` needs a reference it can write: refused, naming the fix, under FSDP (its sharded reference;
    DeepSpeed is refused by the config), for a `ref_model` that does not have the policy's weights, and for LoRA
    layers that cannot merge into a base weight of their own."""
    from ..generation.static_cache import mergeable_lora_layers

    if fsdp:
        raise ValueError(
            "`ref_reset_steps` is not available under FSDP: the sharded reference cannot take the policy's "
            "weights. Run it under plain accelerate or DDP, or set ref_reset_steps to 0."
        )
    if not adapter_reference:  # a frozen reference takes the policy's weights, name by name
        names = {n: p.shape for n, p in policy.named_parameters()}
        if hasattr(policy, "peft_config") or names != {n: p.shape for n, p in ref_model.named_parameters()}:
            raise ValueError(
                "`ref_reset_steps` copies the policy's weights into the reference, but the `ref_model` given does "
                "not have the policy's weights (another architecture, or a PEFT policy beside a separate "
                "reference). Leave ref_model unset (a LoRA policy then uses its adapter-disabled self, a full "
                "policy a frozen copy), or set ref_reset_steps to 0."
            )
    if adapter_reference and ref_adapter is None and mergeable_lora_layers(policy) is None:
        raise ValueError(
            "`ref_reset_steps` merges the LoRA adapter into the base weights, but this policy's LoRA layers cannot "
            "merge into a floating-point base weight of their own (quantized, DoRA or other variants, tied "
            "weights). Use plain LoRA on unquantized weights, or set ref_reset_steps to 0."
        )


@torch.no_grad()
def kl_to_initial(rollout, reference_logprobs, tensors: dict, initial: dict, plan, chunk: int, accelerator) -> dict:
    """`kl/initial`: the KL of the rollout's policy to the reference before the first reset (`k3` on the sampled
    tokens: unbiased and never negative; in the statistic's unit), from the reference (`reference_logprobs(part)`)
    with its first tensors (`initial`) swapped into `tensors`."""
    from ...kl import GlobalSums, estimate_kl
    from ...kl.reduce import unit_count

    mask = rollout.response_mask
    total = torch.zeros((), dtype=torch.float64, device=mask.device)
    with swapped_in(tensors, initial):
        for start in range(0, rollout.batch_size, chunk):
            part = rollout.select(slice(start, start + chunk))
            logp = reference_logprobs(part)
            k3 = estimate_kl("k3", part.logp, logp, log_ratio_clamp=plan.log_ratio_clamp)
            total += torch.where(part.response_mask.bool(), k3, 0.0).double().sum()
    stats = GlobalSums()
    stats.add("kl/initial", total, unit_count(mask, plan.unit))
    return stats.means(accelerator)
