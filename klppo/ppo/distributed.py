"""What the distributed engines (DDP, DeepSpeed, FSDP2) need from klppo's forward passes, backward passes and
optimizer steps.

`backward` and `optimizer_step`: a mini-batch's last micro-batch is the accumulation boundary. DeepSpeed's engine is
told it (its ZeRO-2/3 refuse `no_sync`), runs its own backward and step and clips the gradients itself
(`gradient_clipping`); elsewhere accelerate's backward, clipping to `max_grad_norm`, and the optimizer's step.

FSDP2 (`torch.distributed.fsdp.fully_shard`) gathers a module's own parameters only around that module's forward.
The actor-critic's root unit holds the parameters no wrapped block owns (embeddings, final norm, LM head, value
head): a forward that enters through a submodule instead of the root (generation on the policy, the critic, the
adapter-disabled reference, held-out evaluation) must gather them first. DeepSpeed ZeRO-3 needs nothing here:
its hooks sit on every submodule.
"""

from __future__ import annotations

import atexit
import functools
import math
import weakref
from contextlib import contextmanager

import torch
from torch import nn

_UNWRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unwrap(accelerator, model: nn.Module) -> nn.Module:
    """`accelerator.unwrap_model(model)`, looked up once per wrapped model: accelerate's reads the installed packages'
    metadata on every call (2 ms, a tenth of the tiny model's update, which calls it twice)."""
    found = _UNWRAPPED.get(model)
    unwrapped = found() if found is not None else None
    if unwrapped is None:
        unwrapped = accelerator.unwrap_model(model)
        _UNWRAPPED[model] = weakref.ref(unwrapped)  # weak both ways: an unwrapped model may be its own key
    return unwrapped


def restore_zero3_hooks(engine) -> None:
    """Put back the ZeRO-3 parameter hooks of `engine` (a `DeepSpeedEngine`) that TRL's `remove_hooks` took off for
    decoding on gathered weights, if they are off: without them every forward pass would see the partitioned, empty
    parameters. A no-op while the hooks are on (adding them twice would gather twice) or before the first step."""
    from trl.models.utils import add_hooks

    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    if offload is not None and getattr(offload, "forward_hooks", None) == []:
        add_hooks(engine)


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of `model`: after a forward without backward, FSDP2 leaves the root's parameters
    whole, and every unit's with `reshard_after_forward=False`, as plain tensors; what is written into those is lost
    at the next reshard, and the optimizer's state maps to the sharded parameters. A no-op for other models."""
    for module in model.modules():
        if is_fsdp2(module):
            module.reshard()


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


_UNSHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root_unsharded's depth per module


@contextmanager
def root_unsharded(model: nn.Module):
    """Inside the block, the FSDP2 root's own parameters are whole, for forwards that do not enter through the
    root (a root forward in the block would reshard them on exit) and for its LM head run on hidden states
    (`klppo.ppo.scoring.logprobs.read_response`). Nested blocks of one module unshard and reshard once, at the outermost.
    A no-op for any other module."""
    if not is_fsdp2(model) or _UNSHARDED.get(model, 0) > 0:
        if is_fsdp2(model):
            _UNSHARDED[model] += 1
            try:
                yield
            finally:
                _UNSHARDED[model] -= 1
        else:
            yield
        return
    # FSDP2 names its root at the first forward. Were that first forward one of the submodule forwards below, their
    # blocks would take themselves for roots and the actor-critic's own forward would fail ("already lazily
    # initialized"); `unshard` does not do this naming, so do it here (private in torch 2.11-2.13).
    fsdp_state = getattr(model, "_get_fsdp_state", None)
    if fsdp_state is not None:
        fsdp_state()._lazy_init()
    model.unshard()
    _UNSHARDED[model] = 1
    try:
        yield
    finally:
        _UNSHARDED[model] = 0
        model.reshard()


def unshard_again(model: nn.Module) -> None:
    """Inside a `root_unsharded(model)` block, make the root's parameters whole again after a forward that entered
    through it (which reshards them on exit). A no-op elsewhere."""
    if is_fsdp2(model) and _UNSHARDED.get(model, 0) > 0:
        model.unshard()


def load_full_weights(model: nn.Module, weights: dict) -> None:
    """Load whole tensors (a klppo checkpoint's trainable weights) into the matching weights of `model`; a weight
    that FSDP2 shards (a DTensor) takes its shard of the whole tensor. Weights not named are left as they are."""
    import torch

    reshard_all(model)  # load into the shards: whole parameters left by a no-grad forward would be thrown away
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            param = params[name]
            value = value.to(device=param.device, dtype=param.dtype)
            if hasattr(param, "device_mesh"):  # a DTensor: this rank's shard, laid out as the weight is
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while it is still whole (registered once).
    Exiting with a Gloo group alive can abort a rank after its work is done ("terminate called without an active
    exception", PyTorch issue 190489): the group's worker threads are torn down with the interpreter."""

    def destroy() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(destroy)


def backward(
    accelerator, model_wrapped, loss: torch.Tensor, boundary: bool, deepspeed: bool, discard: bool = False
) -> None:
    """Backward pass of one micro-batch's loss. The loss is this rank's share of the mini-batch's global mean, and
    data parallelism averages gradients over ranks, hence the factor `num_processes`; accumulation needs no factor,
    as every micro-batch's loss is already divided by the mini-batch's global counts, and accelerate's own division by
    its accumulation steps is off (transformers' `Trainer` builds the accelerator with one step). Under DeepSpeed the engine is
    told where the accumulation boundary is (accelerate would make every micro-batch one) and must not rescale by
    its own accumulation count; `discard` poisons the boundary pass so that the engine's overflow check drops the
    accumulated gradients (DeepSpeed offers no other way to drop them)."""
    loss = loss * accelerator.num_processes
    if not deepspeed:
        accelerator.backward(loss)
        return
    model_wrapped.set_gradient_accumulation_boundary(boundary)
    model_wrapped.backward(loss * math.nan if discard else loss, scale_wrt_gas=False)


def optimizer_step(
    accelerator, model_wrapped, optimizer, scheduler, max_grad_norm: float | None, deepspeed: bool
) -> float | None:
    """Clip the gradients and take the optimizer step (and the scheduler's) unless their norm is not finite. Returns
    the gradient norm before clipping (None when it is not measured). DeepSpeed's engine clips
    (`gradient_clipping`) and skips non-finite gradients itself."""
    from torch.profiler import record_function

    if deepspeed:
        model_wrapped.step()
        grad_norm = model_wrapped.get_global_grad_norm()
    else:
        grad_norm = None
        if max_grad_norm and max_grad_norm > 0:
            with record_function("klppo/clip_grad_norm"):
                grad_norm = float(accelerator.clip_grad_norm_(model_wrapped.parameters(), max_grad_norm))
        if grad_norm is None or math.isfinite(grad_norm):
            with record_function("klppo/optimizer_step"):
                optimizer.step()
    grad_norm = None if grad_norm is None else float(grad_norm)
    if (grad_norm is None or math.isfinite(grad_norm)) and scheduler is not None:
        scheduler.step()
    return grad_norm
