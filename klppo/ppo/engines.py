"""What the sharding engines need from klppo's forward passes.

FSDP2 (`torch.distributed.fsdp.fully_shard`) gathers a module's own parameters only around that module's forward.
The actor-critic's root unit holds the parameters no wrapped block owns (embeddings, final norm, LM head, value
head): a forward that enters through a submodule instead of the root (generation on the policy, the critic, the
adapter-disabled reference, held-out evaluation) must gather them first. DeepSpeed ZeRO-3 needs nothing here:
its hooks sit on every submodule.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


@contextmanager
def root_unsharded(model: nn.Module):
    """Inside the block, the FSDP2 root's own parameters are whole, for forwards that do not enter through the
    root (a root forward in the block would reshard them on exit). A no-op for any other module."""
    if not is_fsdp2(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
